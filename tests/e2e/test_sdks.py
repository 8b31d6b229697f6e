"""What the official SDKs raise or yield on the gateway's terminal event (docs/errors.md).

Through the real gateway (Envoy, etcd, our processor, demo replicas): the openai SDK on
chat, completions and Responses streams, the anthropic SDK on Messages streams, each after
two delivered deltas, when the stream is ended by us (an in-band error replaced, or a stall)
and when the upstream is physically reset (no event can be injected then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from openai.types.responses import ResponseFailedEvent, ResponseStreamEvent

from .conftest import Gateway

pytestmark = pytest.mark.e2e

ENDED_BY_US = ["stall-after-deltas:2", "error-after-deltas:2"]
INTERRUPTED = "Generation was interrupted after part of the answer was sent"


def ours(rid: str, error_type: str, exact: bool) -> dict[str, Any]:
    """Our terminal error; the count is the engine's (exact) for chat and completions,
    whose chunks carry the running usage the gateway asked for (decision 0018)."""
    return {"message": INTERRUPTED, "type": error_type, "code": "upstream_decode_interrupted",
            "request_id": rid, "partial_output": True, "retryable": False,
            "delivered_output_tokens": 2, "delivered_output_tokens_exact": exact}


def drain(make: Callable[[], Iterable[Any]]) -> tuple[list[Any], BaseException | None]:
    got: list[Any] = []
    try:
        for item in make():
            got.append(item)
    except Exception as e:  # what the SDK raises is the subject of the test
        return got, e
    return got, None


def raise_on_failed(events: Iterable[ResponseStreamEvent]) -> Iterator[ResponseStreamEvent]:
    """The client code docs/errors.md gives for Responses: the openai SDK yields a
    `response.failed` (and an `error`) event instead of raising; raise it here."""
    for ev in events:
        if ev.type == "response.failed":
            err = ev.response.error
            raise RuntimeError(f"{err.code if err else 'failed'}: "
                               f"{err.message if err else ''}", ev.response)
        if ev.type == "error":
            raise RuntimeError(f"{ev.code}: {ev.message}", ev)
        yield ev


@pytest.fixture
def oai(gw: Gateway) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=gw.stack.base_url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


@pytest.fixture
def ant(gw: Gateway) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=gw.stack.base_url, api_key="unused", max_retries=0)
    yield c
    c.close()


def _chat(c: openai.OpenAI, fault: str) -> Any:
    return c.chat.completions.create(model="demo-model", max_tokens=6, stream=True,
                                     messages=[{"role": "user", "content": "hi"}],
                                     extra_headers={"x-replica-fault": fault})


def _completions(c: openai.OpenAI, fault: str) -> Any:
    return c.completions.create(model="demo-model", prompt="hi", max_tokens=6, stream=True,
                                extra_headers={"x-replica-fault": fault})


@pytest.mark.parametrize("fault", ENDED_BY_US)
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_openai_chat_and_completions_raise_api_error(oai: openai.OpenAI, fault: str,
                                                     api: str) -> None:
    got, e = drain(lambda: (_chat if api == "chat" else _completions)(oai, fault))
    # APIError itself (not APIStatusError: the HTTP status was 200), body = our error object.
    assert type(e) is openai.APIError
    assert e.message == INTERRUPTED and e.code == "upstream_decode_interrupted"
    assert isinstance(e.body, dict)
    rid = e.body["request_id"]
    assert e.body == ours(rid, "server_error", True)
    texts = [(ch.choices[0].delta.content if api == "chat" else ch.choices[0].text)
             for ch in got if ch.choices]
    assert [t for t in texts if t] == texts[-2:] and len([t for t in texts if t]) == 2


@pytest.mark.parametrize("fault", ENDED_BY_US)
def test_openai_responses_yields_response_failed(oai: openai.OpenAI, fault: str) -> None:
    def make() -> Any:
        return oai.responses.create(model="demo-model", input="hi", max_output_tokens=6,
                                    stream=True, extra_headers={"x-replica-fault": fault})
    got, e = drain(make)
    # The SDK does not raise: the last thing it yields is our response.failed event.
    assert e is None
    assert [ev.type for ev in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.failed"]
    failed = got[-1]
    assert isinstance(failed, ResponseFailedEvent)
    assert failed.sequence_number == got[-2].sequence_number + 1
    assert failed.response.id == got[0].response.id and failed.response.status == "failed"
    err = failed.response.error
    assert err is not None and err.code == "upstream_decode_interrupted"
    assert err.message == INTERRUPTED
    rid = err.model_dump()["request_id"]  # our fields come through as extra attributes
    assert err.model_dump() == {**ours(rid, "server_error", False), "param": None,
                                "misalignment": None}
    # The streaming helper does the same: no exception, the event is yielded.
    def helper() -> Iterator[Any]:
        with oai.responses.stream(model="demo-model", input="hi", max_output_tokens=6,
                                  extra_headers={"x-replica-fault": fault}) as s:
            yield from s
    got2, e2 = drain(helper)
    assert e2 is None and got2[-1].type == "response.failed"
    # With the documented client code, it raises.
    got3, e3 = drain(lambda: raise_on_failed(make()))
    assert isinstance(e3, RuntimeError) and str(e3.args[0]).startswith(
        "upstream_decode_interrupted: ")
    assert [ev.type for ev in got3].count("response.output_text.delta") == 2


@pytest.mark.parametrize("fault", ENDED_BY_US)
def test_anthropic_messages_raises_api_status_error_with_status_200(
        ant: anthropic.Anthropic, fault: str) -> None:
    def make() -> Any:
        return ant.messages.create(model="demo-model", max_tokens=6, stream=True,
                                   messages=[{"role": "user", "content": "hi"}],
                                   extra_headers={"x-replica-fault": fault})
    got, e = drain(make)
    # APIStatusError itself (no subclass maps status 200), its body our whole error event.
    assert type(e) is anthropic.APIStatusError
    assert e.status_code == 200
    assert isinstance(e.body, dict) and e.body["type"] == "error"
    rid = e.body["error"]["request_id"]
    assert e.body == {"type": "error", "error": ours(rid, "api_error", False)}
    assert [ev.type for ev in got] == ["message_start", "content_block_start",
                                       "content_block_delta", "content_block_delta"]
    def helper() -> Iterator[Any]:
        with ant.messages.stream(model="demo-model", max_tokens=6,
                                 messages=[{"role": "user", "content": "hi"}],
                                 extra_headers={"x-replica-fault": fault}) as s:
            yield from s
    got2, e2 = drain(helper)
    assert type(e2) is anthropic.APIStatusError and e2.status_code == 200
    assert [ev.type for ev in got2].count("text") == 2


def test_after_a_physical_reset_the_sdks_raise_transport_errors(
        oai: openai.OpenAI, ant: anthropic.Anthropic) -> None:
    fault = "kill-after-deltas:2"
    for make in (lambda: _chat(oai, fault), lambda: _completions(oai, fault),
                 lambda: oai.responses.create(model="demo-model", input="hi",
                                              max_output_tokens=6, stream=True,
                                              extra_headers={"x-replica-fault": fault})):
        got, e = drain(make)
        assert type(e) is openai.APIConnectionError, e
        assert len(got) >= 2
    got, e = drain(lambda: ant.messages.create(
        model="demo-model", max_tokens=6, stream=True,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-replica-fault": fault}))
    # The anthropic SDK does not wrap it: its HTTP library's own error comes through.
    assert isinstance(e, httpx2.RemoteProtocolError), e
    assert not isinstance(e, anthropic.APIError)
    assert [ev.type for ev in got][-2:] == ["content_block_delta", "content_block_delta"]


def test_failover_before_the_first_delta_is_invisible_to_both_sdks(
        gw: Gateway, oai: openai.OpenAI, ant: anthropic.Anthropic) -> None:
    ref = [ev.type for ev in oai.responses.create(model="demo-model", input="hi",
                                                  max_output_tokens=6, stream=True)]
    got = [ev.type for ev in oai.responses.create(
        model="demo-model", input="hi", max_output_tokens=6, stream=True,
        extra_headers={"x-replica-fault": "kill-before-headers"})]
    assert got == ref and ref[-1] == "response.completed" and ref.count("response.created") == 1
    # The killed replica is back and Envoy routes to it again before the next kill: with
    # both of two replicas killed 40 ms apart, the first one ejected on its failure
    # (decision 0024), the second request would rightly find no replica to re-run on.
    gw.stack.wait_replicas_healthy()
    with ant.messages.stream(model="demo-model", max_tokens=6,
                             messages=[{"role": "user", "content": "hi"}],
                             extra_headers={"x-replica-fault": "kill-after-headers"}) as s:
        text = s.get_final_text()
    with ant.messages.stream(model="demo-model", max_tokens=6,
                             messages=[{"role": "user", "content": "hi"}]) as s:
        assert s.get_final_text() == text and len(text.split()) == 6
