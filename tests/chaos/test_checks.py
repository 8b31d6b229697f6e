"""The chaos harness's checker, without sockets: each break kind is reported when its
transcript shows it, and a clean transcript of every shape has none (so the checks can fail
and do not fail for nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chaos.checks import (
    BREAK_KINDS,
    Availability,
    ReplicaTimeline,
    Seen,
    Spec,
    Transcript,
    check,
    no_replica_verdict,
    parse_sse,
    serving_intervals,
    view,
)
from chaos.traffic import reference

RID = "req_" + "a" * 26
SSE = {"content-type": "text/event-stream", "x-gateway-request-id": RID}
JSON = {"content-type": "application/json", "x-gateway-request-id": RID}


def spec(family: str = "chat", stream: bool = True, key: str | None = None,
         max_tokens: int = 4) -> Spec:
    return Spec(family=family, stream=stream, prompt="hello", seed=3, max_tokens=max_tokens,
                key=key)


def data(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chat_stream(tokens: list[str], end: str = "done", role: int = 1,
                error: dict[str, Any] | None = None) -> str:
    out = ""
    for _ in range(role):
        out += data({"choices": [{"delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}]})
    for tok in tokens:
        out += data({"choices": [{"delta": {"content": tok}, "finish_reason": None}]})
    if end == "done":
        out += data({"choices": [{"delta": {}, "finish_reason": "length"}]})
        out += "data: [DONE]\n\n"
    elif end == "error":
        out += data({"error": error}) + "data: [DONE]\n\n"
    return out


def ours(n: int) -> dict[str, Any]:
    return {"message": "Generation was interrupted after part of the answer was sent",
            "type": "server_error", "code": "upstream_decode_interrupted", "request_id": RID,
            "partial_output": True, "retryable": False, "delivered_output_tokens": n,
            "delivered_output_tokens_exact": True}


def record(outcome: str | None, delivered: int, sent: bool = True, exact: bool = True,
           attempts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"request_id": RID, "phase": "done" if outcome else "prefill",
            "outcome": outcome, "first_delta_sent": sent,
            "delivered_output_tokens": delivered, "delivered_output_tokens_exact": exact,
            "first_delta_at": 100.0 if sent else None,
            "attempts": attempts if attempts is not None else [
                {"attempt": 1, "admitted_at": 99.0, "released": sent}]}


def transcript(s: Spec, body: str, status: int = 200, headers: dict[str, str] | None = None,
               err: str | None = None, rec: dict[str, Any] | None = None,
               rec_status: int = 200, repeats: list[Seen] | None = None,
               elapsed: float = 0.5, processor_fault: bool = False) -> Transcript:
    seen = Seen(status=status, headers=headers if headers is not None else SSE, body=body,
                transport_error=err, elapsed_s=elapsed)
    return Transcript(index=0, spec=s, seen=seen, reference=reference(s), hang_bound_s=30.0,
                      request_id=RID, record=rec, record_status=rec_status,
                      repeats=repeats or [], processor_fault=processor_fault)


def kinds(t: Transcript) -> list[str]:
    return sorted({b.kind for b in check(t)})


def test_the_reference_is_the_demo_replicas_answer() -> None:
    # The same rule as devkit/demo/tokens.py: " word" tokens, fully determined.
    ref = reference(spec())
    assert len(ref) == 4 and all(t.startswith(" ") for t in ref)
    assert reference(spec()) == ref
    assert reference(spec(family="messages")) == ref  # one user message, the same prompt
    assert reference(spec(family="completions")) != ref


def test_a_clean_complete_stream_has_no_break() -> None:
    s = spec()
    t = transcript(s, chat_stream(reference(s)), rec=record("completed", 4))
    assert check(t) == []


def test_a_clean_interrupted_stream_has_no_break() -> None:
    s = spec()
    t = transcript(s, chat_stream(reference(s)[:2], end="error", error=ours(2)),
                   rec=record("upstream_decode_interrupted", 2))
    assert check(t) == []


def test_stitched_answers_are_reported() -> None:
    """Two lifecycles: the first attempt's two tokens, then a whole second answer."""
    s = spec()
    ref = reference(s)
    body = chat_stream(ref[:2], end="none") + chat_stream(ref)
    t = transcript(s, body, rec=record("completed", 4))
    got = kinds(t)
    assert "two_lifecycles" in got and "not_prefix" in got


def test_a_non_prefix_text_is_reported() -> None:
    s = spec()
    ref = reference(s)
    t = transcript(s, chat_stream([ref[0], " foreign", *ref[2:]]),
                   rec=record("completed", 4))
    assert "not_prefix" in kinds(t)
    assert "incomplete_answer" in kinds(t)


def test_a_record_that_disagrees_with_the_client_is_reported() -> None:
    s = spec()
    ref = reference(s)
    # The client read 2 units and our terminal event; the record says 3, exact.
    t = transcript(s, chat_stream(ref[:2], end="error", error=ours(2)),
                   rec=record("upstream_decode_interrupted", 3))
    assert kinds(t) == ["journal_disagrees"]
    # A cut before any content, recorded as one delivered token, exact (issue 24, 2).
    t = transcript(s, chat_stream([], end="none"), err="RemoteProtocolError: cut",
                   rec=record("upstream_decode_interrupted", 1))
    assert "journal_disagrees" in kinds(t)
    # A complete answer recorded as interrupted.
    t = transcript(s, chat_stream(ref), rec=record("upstream_decode_interrupted", 4))
    assert kinds(t) == ["journal_disagrees"]


def test_a_terminal_event_that_miscounts_is_reported() -> None:
    s = spec()
    t = transcript(s, chat_stream(reference(s)[:2], end="error", error=ours(3)),
                   rec=record("upstream_decode_interrupted", 2))
    assert kinds(t) == ["terminal_disagrees"]


def test_a_cut_stream_is_documented_only_after_content_or_with_the_processor_down() -> None:
    s = spec()
    ref = reference(s)
    after = transcript(s, chat_stream(ref[:2], end="none"), err="RemoteProtocolError: x",
                       rec=record("upstream_decode_interrupted", 2))
    assert check(after) == []
    before = transcript(s, chat_stream([], end="none"), err="RemoteProtocolError: x",
                        rec=record("upstream_failed", 0, sent=False))
    assert "undocumented_cut" in kinds(before)
    # Decision 0025: a released first delta that never left: the fence kept, 0 delivered.
    never_left = transcript(s, chat_stream([], end="none"), err="RemoteProtocolError: x",
                            rec=record("upstream_failed", 0, sent=True))
    assert check(never_left) == []
    proc = transcript(s, chat_stream([], end="none"), err="RemoteProtocolError: x",
                      rec=record("gateway_interrupted", 0, sent=False),
                      processor_fault=True)
    assert check(proc) == []


def test_a_clean_end_without_terminal_event_and_a_hang_are_reported() -> None:
    s = spec()
    t = transcript(s, chat_stream(reference(s)[:2], end="none"),
                   rec=record("upstream_decode_interrupted", 2))
    assert kinds(t) == ["no_terminal"]
    t = transcript(s, chat_stream(reference(s), end="done"), elapsed=31.0,
                   rec=record("completed", 4))
    assert kinds(t) == ["hang"]


def test_envoys_anonymous_reply_is_an_undocumented_error() -> None:
    s = spec()
    t = transcript(s, "", status=502, headers={"content-type": "text/plain"}, rec=None,
                   rec_status=0)
    assert kinds(t) == ["undocumented_error"]
    # While the processor is down Envoy fails closed with 500: documented.
    t = transcript(s, "", status=500, headers={}, rec=None, rec_status=0,
                   processor_fault=True)
    assert check(t) == []


def test_a_rerun_after_delivery_in_the_record_is_reported() -> None:
    s = spec()
    atts = [{"attempt": 1, "admitted_at": 99.0, "released": True},
            {"attempt": 2, "admitted_at": 100.5, "released": False}]
    t = transcript(s, chat_stream(reference(s)), rec=record("completed", 4, attempts=atts))
    assert kinds(t) == ["rerun_after_delivery"]


def err_seen(status: int, code: str, **extra: Any) -> Seen:
    return Seen(status=status, headers=JSON,
                body=json.dumps({"error": {"code": code, "request_id": RID, **extra}}))


def test_repeats_of_a_key() -> None:
    s = spec(key="k1")
    ref = reference(s)
    done = record("completed", 4)
    ok = transcript(s, chat_stream(ref), rec=done,
                    repeats=[err_seen(409, "request_already_completed")])
    assert check(ok) == []
    stuck = transcript(s, chat_stream(ref), rec=done,
                       repeats=[err_seen(409, "request_in_progress", retryable=True)] * 3)
    assert kinds(stuck) == ["key_stuck"]
    rerun = transcript(s, chat_stream(ref), rec=done,
                       repeats=[Seen(status=200, headers=SSE, body=chat_stream(ref))])
    assert kinds(rerun) == ["rerun_after_delivery"]
    wrong = transcript(s, chat_stream(ref), rec=done,
                       repeats=[err_seen(409, "request_already_finished")])
    assert check(wrong) == []  # an end, not the same words: not a break
    never = transcript(s, chat_stream(ref), rec=done)
    assert kinds(never) == ["key_stuck"]


def test_a_retryable_failure_that_delivered_nothing_may_run_again() -> None:
    s = spec(key="k2")
    first = json.dumps({"error": {"code": "upstream_unavailable", "request_id": RID,
                                  "retryable": True, "partial_output": False}})
    rec = record("upstream_failed", 0, sent=False)
    refused = transcript(s, first, status=503, headers=JSON, rec=rec,
                         repeats=[err_seen(409, "request_already_finished")])
    assert kinds(refused) == ["retryable_key_refused"]
    ran = transcript(s, first, status=503, headers=JSON, rec=rec,
                     repeats=[Seen(status=200, headers=SSE, body=chat_stream(reference(s)))])
    assert check(ran) == []


def test_a_journal_unavailable_intake_left_in_progress_is_unsettled() -> None:
    s = spec(key="k3")
    first = json.dumps({"error": {"code": "journal_unavailable", "request_id": RID,
                                  "retryable": True}})
    rec = record(None, 0, sent=False)
    t = transcript(s, first, status=503, headers=JSON, rec=rec,
                   repeats=[err_seen(409, "request_in_progress")] * 5)
    assert kinds(t) == ["key_stuck", "record_unsettled"]


@pytest.mark.parametrize("family", ["completions", "responses", "messages"])
def test_other_families_complete_and_stitched(family: str) -> None:
    s = spec(family=family)
    ref = reference(s)

    def stream(tokens: list[str], complete: bool = True) -> str:
        if family == "completions":
            body = "".join(data({"choices": [{"text": t, "finish_reason": None}]})
                           for t in tokens)
            return body + (data({"choices": [{"text": "", "finish_reason": "length"}]})
                           + "data: [DONE]\n\n" if complete else "")
        if family == "responses":
            body = "event: response.created\n" + data({"type": "response.created"})
            body += "".join("event: response.output_text.delta\n"
                            + data({"type": "response.output_text.delta", "delta": t})
                            for t in tokens)
            return body + ("event: response.completed\n"
                           + data({"type": "response.completed"}) if complete else "")
        body = "event: message_start\n" + data({"type": "message_start"})
        body += "".join("event: content_block_delta\n"
                        + data({"type": "content_block_delta",
                                "delta": {"type": "text_delta", "text": t}}) for t in tokens)
        return body + ("event: message_stop\n" + data({"type": "message_stop"})
                       if complete else "")

    assert check(transcript(s, stream(ref), rec=record("completed", 4))) == []
    stitched = transcript(s, stream(ref[:1], complete=False) + stream(ref),
                          rec=record("completed", 4))
    assert "not_prefix" in kinds(stitched)
    if family != "completions":
        assert "two_lifecycles" in kinds(stitched)


def test_a_unary_answer_must_be_the_whole_reference() -> None:
    s = spec(stream=False)
    ref = "".join(reference(s))
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": ref}}],
                       "usage": {"completion_tokens": 4}})
    assert check(transcript(s, body, headers=JSON, rec=record("completed", 4))) == []
    short = json.dumps({"choices": [{"message": {"content": ref[:-3]}}]})
    assert kinds(transcript(s, short, headers=JSON, rec=record("completed", 4))) == [
        "incomplete_answer"]


def test_sse_reading_drops_a_half_event_and_every_kind_is_described() -> None:
    evs = parse_sse('data: {"a": 1}\n\nevent: x\ndata: {"b"')
    assert evs == [(None, {"a": 1})]
    assert view(spec(), Seen(200, SSE, "")).outcome == "unended"
    assert all(BREAK_KINDS.values())


def test_a_replicas_own_overloaded_answer_passed_on_is_documented() -> None:
    s = spec()
    body = json.dumps({"error": {"message": "replica overloaded", "code": 503}})
    rec = {**record("upstream_failed", 0, sent=False), "cause": "http 503"}
    assert check(transcript(s, body, status=503, headers=JSON, rec=rec)) == []
    rec["cause"] = "upstream"  # the journal does not say so: not a documented answer
    assert kinds(transcript(s, body, status=503, headers=JSON, rec=rec)) == [
        "undocumented_error"]


def test_the_evidence_of_a_break_names_the_client_view_record_and_log_lines(
        tmp_path: Path) -> None:
    from chaos.runner import Report, render_evidence, render_summary
    s = spec()
    t = transcript(s, chat_stream(reference(s)[:2], end="error", error=ours(2)),
                   rec=record("upstream_decode_interrupted", 3))
    (tmp_path / "processor.log").write_text(f'{{"msg": "request finished", "request_id": '
                                            f'"{RID}"}}\n{{"msg": "other"}}\n')
    rep = Report(options={"seed": 1, "etcd_members": 3}, transcripts=[t], faults=[],
                 breaks=[(t, b) for b in check(t)], workdir=tmp_path, started_at=0.0,
                 wall_s=1.0)
    ev = render_evidence(rep)
    assert f"== journal_disagrees {RID}" in ev and "request finished" in ev
    assert '"outcome": "upstream_decode_interrupted"' in ev and "other" not in ev
    assert "journal_disagrees" in render_summary(rep) and not rep.ok
    d = rep.to_dict()
    assert d["breaks"][0]["logs"] == [f"processor.log: {{\"msg\": \"request finished\", "
                                      f"\"request_id\": \"{RID}\"}}"]
    assert d["summary"]["breaks_by_kind"] == {"journal_disagrees": 1}


def test_an_error_answer_after_a_fence_whose_delta_never_left() -> None:
    # Decision 0057: a non-200 answer carried no release, so the fence is taken back.
    s = spec()
    body = json.dumps({"error": {"code": "upstream_unavailable", "request_id": RID,
                                 "retryable": True}})
    ok = transcript(s, body, status=503, headers=JSON,
                    rec=record("upstream_failed", 0, sent=False))
    assert check(ok) == []
    kept = transcript(s, body, status=503, headers=JSON,
                      rec=record("upstream_failed", 0, sent=True))
    assert kinds(kept) == ["journal_disagrees"]
    assert "a release that never left is taken back" in check(kept)[0].detail
    # ... unless the processor died before the retry or the outcome could take it back.
    died = transcript(s, body, status=503, headers=JSON, processor_fault=True,
                      rec=record("upstream_failed", 0, sent=True))
    assert check(died) == []
    claims = transcript(s, body, status=503, headers=JSON,
                        rec=record("upstream_decode_interrupted", 1, sent=True))
    assert kinds(claims) == ["journal_disagrees"]


def test_a_request_killed_with_its_processor_before_its_intake_has_no_record() -> None:
    s = spec()
    body = json.dumps({"error": {"code": "upstream_unavailable", "request_id": RID,
                                 "retryable": True}})
    gone = transcript(s, body, status=500, headers=JSON, rec=None, rec_status=404,
                      processor_fault=True)
    assert check(gone) == []
    unexplained = transcript(s, body, status=503, headers=JSON, rec=None, rec_status=404)
    assert kinds(unexplained) == ["record_missing"]


def test_a_record_settled_after_its_processor_died_is_documented_only_then() -> None:
    s = spec()
    ref = reference(s)
    lost = {**record("gateway_interrupted", 0), "cause": "processor_lost",
            "delivered_output_tokens_exact": False,
            "delivered_output_tokens_bound": "unknown"}
    # A complete answer whose outcome write died with the processor (etcd away): the record
    # says it does not know; documented when a processor was killed after the start ...
    t = transcript(s, chat_stream(ref), rec=lost)
    t.processor_killed_after_start = True
    assert kinds(t) == []
    # ... and a break when none was.
    t = transcript(s, chat_stream(ref), rec=lost)
    assert kinds(t) == ["journal_disagrees"]
    # Without the "unknown" bound it is still compared, and disagrees.
    t = transcript(s, chat_stream(ref), rec={**lost, "delivered_output_tokens_bound": None})
    t.processor_killed_after_start = True
    assert "journal_disagrees" in kinds(t)


# --- healthy_replica_passed_over: the replicas' timeline against "no replica served it" ----

R1, R2, R3 = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"


def samples(t0: float, t1: float, down: tuple[tuple[float, float], ...] = (),
            step: float = 0.1) -> tuple[tuple[float, bool], ...]:
    """A sample every `step` s from t0 to t1, False inside the `down` windows."""
    out = []
    n = round((t1 - t0) / step)
    for i in range(n + 1):
        t = round(t0 + i * step, 3)
        out.append((t, not any(a <= t <= b for a, b in down)))
    return tuple(out)


def test_serving_intervals_leave_out_deaths_freezes_restarts_and_sampling_gaps() -> None:
    tl = ReplicaTimeline("r1", R1, samples(0.0, 10.0, down=((3.0, 3.5),)),
                         events=((6.0, "frozen"), (7.0, "thawed"), (8.5, "restarted")))
    assert serving_intervals(tl) == [(0.0, 2.9), (3.6, 6.0), (7.0, 8.25), (8.5, 10.0)]
    # Two samples 0.8 s apart: what happened between them is not known, so not serving.
    gap = tuple(x for x in samples(0.0, 4.0) if not 1.1 < x[0] < 1.9)
    assert serving_intervals(ReplicaTimeline("r1", R1, gap)) == [(0.0, 1.1), (1.9, 4.0)]
    # Held down and never released: not serving from the hold on.
    held = ReplicaTimeline("r1", R1, samples(0.0, 4.0), events=((2.0, "held_down"),))
    assert serving_intervals(held) == [(0.0, 2.0)]


def availability(r3: ReplicaTimeline | None = None, lag_s: float = 4.0,
                 max_attempts: int = 2) -> Availability:
    """r1 dead from 100 to 112, r2 frozen from 101 to 106, r3 serving all along (unless
    given): a request answered `503 upstream_unavailable` at 105 had r3 to go to."""
    return Availability(
        replicas=(ReplicaTimeline("r1", R1, samples(90.0, 120.0, down=((100.0, 112.0),))),
                  ReplicaTimeline("r2", R2, samples(90.0, 120.0),
                                  events=((101.0, "frozen"), (106.0, "thawed"))),
                  r3 or ReplicaTimeline("r3", R3, samples(90.0, 120.0),
                                        envoy=((90.0, "healthy"),))),
        lag_s=lag_s, max_attempts=max_attempts)


def unavailable(attempts: list[dict[str, Any]], av: Availability | None,
                code: str = "upstream_unavailable", status: int = 503,
                s: Spec | None = None, processor_fault: bool = False) -> Transcript:
    body = json.dumps({"error": {"code": code, "request_id": RID, "retryable": True,
                                 "partial_output": False}})
    t = transcript(s or spec(), body, status=status, headers=JSON, elapsed=3.0,
                   rec=record("upstream_failed", 0, sent=False, attempts=attempts),
                   processor_fault=processor_fault)
    t.seen.started_at = 104.0
    t.availability = av
    return t


def refused(n: int) -> dict[str, Any]:
    """An attempt Envoy could not connect for (no gate ran; closed by the next one)."""
    return {"attempt": n, "released": False, "failure_class": "never_started",
            "fence": "taken_over"}


def reached(n: int, replica: str, cls: str = "upstream_dead",
            cause: str = "upstream") -> dict[str, Any]:
    return {"attempt": n, "replica": replica, "released": False, "failure_class": cls,
            "envoy_cause": cause, "fence": "revoke"}


def test_a_request_with_budget_left_while_a_replica_served_is_passed_over() -> None:
    # One attempt reached a replica (the dead r1's stale health), the other was never
    # started, and the request ended 503 with r3 serving since 4 s before it began.
    t = unavailable([reached(1, R1, cause="UF"), refused(2)], availability())
    assert kinds(t) == ["healthy_replica_passed_over"]
    detail = check(t)[0].detail
    assert "1 of 2 attempts" in detail
    assert "r3 (serving since 4 s before; Envoy: healthy)" in detail
    # No attempt reached a replica at all: the same.
    assert kinds(unavailable([refused(1), refused(2)], availability())) == [
        "healthy_replica_passed_over"]
    # The other "no replica" answers count too.
    for code, status in (("upstream_timeout", 504), ("no_compatible_replica", 503),
                         ("retry_budget_exhausted", 503)):
        assert kinds(unavailable([reached(1, R2, "upstream_timeout", "UT")],
                                 availability(), code, status)) == [
            "healthy_replica_passed_over"], code


def test_an_attempt_that_failed_on_a_serving_replica_is_passed_over() -> None:
    t = unavailable([reached(1, R1, cause="UF"), reached(2, R3, "upstream_dead", "UC")],
                    availability())
    assert kinds(t) == ["healthy_replica_passed_over"]
    assert "attempt 2 went to r3, serving throughout" in check(t)[0].detail


def test_a_budget_spent_on_failing_replicas_is_not_passed_over() -> None:
    # Both attempts that count went to replicas that were failing (r1 dead, r2 frozen):
    # max_attempts is the policy, r3's being there does not change it.
    spent = [reached(1, R1, cause="UF"), reached(2, R2, "upstream_timeout", "UT")]
    assert check(unavailable(spent, availability())) == []
    # With a budget of 3 the same record had one left: passed over.
    assert kinds(unavailable(spent, availability(max_attempts=3))) == [
        "healthy_replica_passed_over"]


def test_no_replica_serving_for_the_whole_window_and_the_lag_is_no_break() -> None:
    attempts = [refused(1), refused(2)]
    # r3 restarted (a request's kill fault) 2 s before the request began: Envoy may not
    # have seen it healthy again yet (lag 4 s), so nothing was passed over ...
    late = ReplicaTimeline("r3", R3, samples(90.0, 120.0, down=((101.5, 102.0),)),
                           events=((101.6, "restarted"),))
    assert check(unavailable(attempts, availability(late))) == []
    # ... but with a 1 s lag it had been serving long enough.
    assert kinds(unavailable(attempts, availability(late, lag_s=1.0))) == [
        "healthy_replica_passed_over"]
    # r3 frozen during the request: nothing served it.
    frozen = ReplicaTimeline("r3", R3, samples(90.0, 120.0),
                             events=((106.0, "frozen"), (109.0, "thawed")))
    assert check(unavailable(attempts, availability(frozen))) == []


def test_only_fault_free_no_replica_answers_are_judged() -> None:
    attempts = [refused(1), refused(2)]
    av = availability()
    faulty = Spec(family="chat", stream=True, prompt="hello", seed=3, max_tokens=4,
                  fault="overloaded:503", fault_attempt="*")
    assert check(unavailable(attempts, av, s=faulty)) == []
    assert check(unavailable(attempts, av, processor_fault=True)) == []
    assert check(unavailable(attempts, None)) == []  # no timeline: no judgement
    # Not a "no replica" answer: etcd's, not the replicas'.
    assert check(unavailable(attempts, av, "journal_unavailable")) == []


def test_envoys_own_view_names_a_replica_that_came_up_within_the_lag() -> None:
    # r3 came back (a request's kill fault) 1 s before the request began at 104: within the
    # 4 s lag, so only Envoy's sampled view can say it was there to go to.
    def r3(envoy: tuple[tuple[float, str], ...]) -> ReplicaTimeline:
        return ReplicaTimeline("r3", R3, samples(90.0, 120.0, down=((101.0, 102.9),)),
                               events=((101.0, "restarted"),), envoy=envoy)
    attempts = [refused(1), refused(2)]
    seen = r3(((90.0, "healthy"), (101.0, "/failed_outlier_check"), (103.4, "healthy")))
    t = unavailable(attempts, availability(seen))
    assert kinds(t) == ["healthy_replica_passed_over"]
    assert "healthy in Envoy's view as it began" in check(t)[0].detail
    # Envoy still had it ejected or failing its checks: nothing passed over.
    ejected = r3(((90.0, "healthy"), (101.0, "/failed_outlier_check")))
    assert check(unavailable(attempts, availability(ejected))) == []
    # Envoy's view changed right at the start (within the sampling slack): not counted.
    flipped = r3(((90.0, "healthy"), (101.0, "/failed_active_hc"), (103.9, "healthy")))
    assert check(unavailable(attempts, availability(flipped))) == []


def test_the_report_counts_no_replica_answers_by_verdict_and_keeps_the_timeline(
        tmp_path: Path) -> None:
    from chaos.runner import Report, render_summary
    av = availability()
    passed = unavailable([refused(1), refused(2)], av)
    spent = unavailable([reached(1, R1, cause="UF"), reached(2, R2, "upstream_timeout", "UT")],
                        av)
    none_up = unavailable([refused(1)], availability(
        ReplicaTimeline("r3", R3, samples(90.0, 120.0), events=((105.0, "frozen"),))))
    ts = [passed, spent, none_up]
    rep = Report(options={"seed": 1, "etcd_members": 3}, transcripts=ts, faults=[],
                 breaks=[(t, b) for t in ts for b in check(t)], workdir=tmp_path,
                 started_at=0.0, wall_s=1.0, availability=av)
    d = rep.to_dict()
    assert d["summary"]["no_replica_answers_fault_free"] == {
        "budget_spent_on_failing_replicas": 1, "no_replica_serving": 1, "passed_over": 1}
    assert d["summary"]["breaks_by_kind"] == {"healthy_replica_passed_over": 1}
    assert [q["no_replica_verdict"] for q in d["requests"]] == [
        "passed_over", "budget_spent_on_failing_replicas", "no_replica_serving"]
    assert d["requests"][1]["attempts"] == spent.record["attempts"]  # type: ignore[index]
    r1 = d["availability"]["replicas"][0]
    assert r1["name"] == "r1" and r1["down"] == [[100.0, 112.0]]
    assert "budget_spent_on_failing_replicas" in render_summary(rep)


def test_an_attempt_failed_while_its_journal_had_no_quorum_is_not_passed_over() -> None:
    # Soak seed 22 after the fixes: attempt 1 on a replica serving throughout failed at
    # its fence while a majority of etcd was down (`fence lost`), attempt 2's replica was
    # dead. Nothing can be journaled without quorum: the documented cost, not a pass-over.
    attempts = [reached(1, R3, "ended_by_gateway", "n/a"), reached(2, R1, cause="UF")]
    t = unavailable(attempts, availability())
    assert kinds(t) == ["healthy_replica_passed_over"]  # without the journal's fault
    t.journal_down = True
    assert check(t) == []
    assert no_replica_verdict(t) == ("journal_down", "")
