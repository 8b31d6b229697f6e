"""Header names the gateway owns. Clients may not set them: the guard overwrites them."""

REQUEST_ID = "x-gateway-request-id"
ATTEMPT_ID = "x-gateway-attempt-id"
IDEMPOTENCY_KEY = "idempotency-key"
ENVOY_ATTEMPT_COUNT = "x-envoy-attempt-count"
ENVOY_REQUEST_ID = "x-request-id"
# gRPC initial metadata each Envoy filter sends so one process can serve both roles.
ROLE_METADATA = "x-extproc-role"
# Set by the guard for the gate: the request's compatibility group and its prompt size.
FINGERPRINT = "x-gateway-fingerprint"
PROMPT_TOKENS = "x-gateway-prompt-tokens"
# Guard -> gate: attempt 1 was admitted in the guard's intake transaction (its id).
PREADMITTED = "x-gateway-preadmitted"
# Gate -> guard on the released response headers: the attempt the guard now owns (JSON).
HANDOFF = "x-gateway-attempt-handoff"
# Guard -> gate: when the request was accepted (epoch seconds): the start of its
# whole first-delta budget (timeouts.first_delta_total_s).
ACCEPTED_AT = "x-gateway-accepted-at"
# Guard -> gate: the request span's W3C trace context, so the attempt spans join its trace
# (a client's own traceparent is the parent of the request span, not of the attempts).
TRACEPARENT = "x-gateway-traceparent"
# On Envoy's own 5xx replies (its local_reply_config): its response flags (decision 0024).
ENVOY_REPLY = "x-gateway-envoy-reply"
# On every error response the processor writes itself (its code): the guard leaves these as
# they are and puts any other 5xx body (a replica's own) in our shape.
GATEWAY_ERROR = "x-gateway-error"
# Guard -> gate: a repeat of a key runs again (decision 0027): the journal's number of an
# attempt is this offset plus Envoy's x-envoy-attempt-count (which starts at 1 again).
ATTEMPT_OFFSET = "x-gateway-attempt-offset"
# Gate -> replica only: the attempt's own secret (decision 0028), which the replica's worker
# presents on its tool calls. Never in a response to a client, a log line, a span or the
# hand-off; the guard removes it from every response toward the client.
ATTEMPT_SECRET = "x-gateway-attempt-secret"
# Gate -> replica's agent: this processor process's instance id, so the agent writes its
# "first content left" word under `<prefix>/src/<processor>/` for this process's watch
# (decision 0034).
PROCESSOR = "x-gateway-processor"
OWNED = (REQUEST_ID, ATTEMPT_ID, FINGERPRINT, PROMPT_TOKENS, PREADMITTED, HANDOFF, ACCEPTED_AT,
         TRACEPARENT, ATTEMPT_OFFSET, ATTEMPT_SECRET, PROCESSOR)
