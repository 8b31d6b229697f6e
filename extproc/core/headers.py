"""Header names the gateway owns. Clients may not set them: the guard overwrites them."""

REQUEST_ID = "x-gateway-request-id"
ATTEMPT_ID = "x-gateway-attempt-id"
IDEMPOTENCY_KEY = "idempotency-key"
ENVOY_ATTEMPT_COUNT = "x-envoy-attempt-count"
ENVOY_REQUEST_ID = "x-request-id"
# gRPC initial metadata each Envoy filter sends so one process can serve both roles.
ROLE_METADATA = "x-extproc-role"
OWNED = (REQUEST_ID, ATTEMPT_ID)
