"""Exact delivered token counts: the engine's own running count, asked for and taken back.

`delivered_output_tokens` counted content events, and engines merge several tokens into one
event under load. OpenAI-compatible engines (vLLM, SGLang) can put their running count in
every chunk (`stream_options.continuous_usage_stats`); the gateway asks for it on streaming
chat and completions requests and strips from each chunk what the client did not ask for,
so the client's stream is byte for byte the one it would have had (decision 0018).

Everything here is pure: the request rewrite and the per-event strip work on bytes.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from typing import Any

from .sse import USAGE_MEMBER, SseEvent, parse_event_json

__all__ = ["UsageMode", "ask_for_usage", "take_found_usage", "take_run_usage", "take_usage"]


class UsageMode(enum.StrEnum):
    """What the guard does with the `usage` of each chunk."""

    OFF = "off"  # not asked for: chunks pass untouched, any usage in them is still read
    STRIP_ALL = "strip_all"  # the gateway asked: every usage goes, the usage-only chunk too
    STRIP_RUNNING = "strip_running"  # the client asked for the final usage chunk only
    KEEP = "keep"  # the client asked for both itself: forwarded as is, read


# The engine's request option for streams that report a running count.
ASKED = {"include_usage": True, "continuous_usage_stats": True}
# What goes in after the body's opening brace when it has no option: a constant, encoded
# once (json.dumps with options builds an encoder per call: ~30k instructions a request).
_INSERTED = b'"stream_options":' + json.dumps(ASKED, separators=(",", ":")).encode()

_OPENING = re.compile(rb"\A(?:\xef\xbb\xbf)?[ \t\r\n]*\{")


def ask_for_usage(body: bytes, obj: Mapping[str, Any]) -> tuple[bytes, UsageMode]:
    """The request body to send upstream, and what the guard must do with the chunks.

    `obj` is the body already parsed (a streaming chat or completions request). The body is
    not re-encoded when it has no `stream_options` (the option goes in after its opening
    brace): every other byte reaches the engine as the client wrote it.
    """
    opts = obj.get("stream_options")
    if opts is None and "stream_options" not in obj:
        m = _OPENING.match(body)
        if m is None:
            return body, UsageMode.OFF
        end = m.end()
        rest = body[end:]
        sep = b"" if rest.lstrip().startswith(b"}") else b","
        return body[:end] + _INSERTED + sep + rest, UsageMode.STRIP_ALL
    if not isinstance(opts, dict):
        return body, UsageMode.OFF  # the engine answers a malformed option itself
    final = opts.get("include_usage") is True
    running = final and opts.get("continuous_usage_stats") is True
    if running:
        return body, UsageMode.KEEP
    new = dict(obj)
    new["stream_options"] = {**opts, **ASKED}
    out = json.dumps(new, separators=(",", ":"), ensure_ascii=False).encode()
    return out, (UsageMode.STRIP_RUNNING if final else UsageMode.STRIP_ALL)


# `,"usage":{...}` as the last member of a chunk: a flat object or one level of nesting
# (`prompt_tokens_details`). `,"` never occurs inside a JSON string (its quotes are
# escaped), so a match is a member, and the lookahead makes it the top-level object's last.
_USAGE_MEMBER = re.compile(rb',"usage":\{(?:[^{}]|\{[^{}]*\})*\}(?=\}[ \t]*(?:\r\n?|\n))')
# The member in the exact form of the chunks sse's fast path matches: no alternation to
# backtrack over, a fraction of the general pattern's cost on every chunk of a run.
_FAST_USAGE = re.compile(USAGE_MEMBER)
_FAST_USAGE_LAST = re.compile(USAGE_MEMBER + rb"(?=\}[ \t]*(?:\r\n?|\n))")
_COMPLETION = re.compile(rb'"completion_tokens":([0-9]{1,12})[,}]')
_COMPLETION_KEY = b'"completion_tokens":'
_NO_CHOICES = b'"choices":[]'


def _count(member: bytes) -> int | None:
    m = _COMPLETION.search(member)
    return int(m.group(1)) if m is not None else None


def _last_count(raw: bytes) -> int | None:
    """The running count in a run's last event (None if that event has none). The key,
    with its quotes unescaped, cannot occur inside a JSON string."""
    k = raw.rfind(_COMPLETION_KEY)
    if k < 0 or k < raw.rfind(b"\ndata: ", 0, len(raw) - 2):
        return None
    k += len(_COMPLETION_KEY)
    end = k
    while end < len(raw) and 0x30 <= raw[end] <= 0x39:
        end += 1
    return int(raw[k:end]) if end > k else None


# Where a one-event run's running usage member starts (sse.USAGE_MEMBER; a quote inside a
# JSON string is escaped, so this is the member).
_MEMBER_START = b',"usage":{"prompt_tokens":'


# Module globals for the per-chunk reads (an enum member read through its class costs
# ~900 instructions on CPython 3.11; decision 0041).
_OFF, _KEEP, _STRIP_ALL = UsageMode.OFF, UsageMode.KEEP, UsageMode.STRIP_ALL


def take_usage(mode: UsageMode, e: SseEvent) -> tuple[bytes, int | None]:
    """The bytes to forward for one event (or a merged run), and the engine's running
    completion count it carried (None: it carried none)."""
    raw = e.raw
    if b'"usage":{' not in raw:
        return raw, None
    if not e.data:
        return take_run_usage(mode, raw, e.content_units)
    m = _FAST_USAGE_LAST.search(raw) or _USAGE_MEMBER.search(raw)
    if m is None:
        return _slow(mode, e)
    n = _count(m.group(0))
    if mode is _OFF or mode is _KEEP:
        return raw, n
    if _NO_CHOICES in e.data:
        # The usage-only chunk that ends a stream asked to include usage.
        return (b"" if mode is _STRIP_ALL else raw), n
    return raw[:m.start()] + raw[m.end():], n


def take_found_usage(mode: UsageMode, raw: bytes, at: int, digits: bytes
                     ) -> tuple[bytes, int | None]:
    """`take_run_usage` for one token event whose usage member starts at `at` (-1: it has
    none), its completion count's bytes `digits` (found by sse's decoder or by a find)."""
    if at < 0:
        return raw, None
    n = int(digits) if digits.isdigit() else None
    if mode is _OFF or mode is _KEEP:
        return raw, n
    return raw[:at] + b"}\n\n", n


def take_run_usage(mode: UsageMode, raw: bytes, events: int) -> tuple[bytes, int | None]:
    """`take_usage` for a merged run of `events` token events (sse._FAST_RUN, `raw` its
    bytes): each event ends with its usage, if any, in the form the run matched."""
    if events == 1:
        # One event (most messages): its usage, if any, is its last member, found from the
        # end; the event's bytes after it are its closing `}` and the blank line.
        i = raw.rfind(_MEMBER_START)
        if i < 0:
            return raw, None
        tail = raw.rpartition(_COMPLETION_KEY)[2]  # `N}}\n\n` or `N,"completion_...`
        comma = tail.find(b",")
        return take_found_usage(mode, raw, i, tail[:tail.find(b"}") if comma < 0 else comma])
    if b'"usage":{' not in raw:
        return raw, None
    # Several events: the regex's `sub` and `_last_count`'s scan measured cheaper than
    # finds and splits (decision 0043).
    n = _last_count(raw)
    if mode is _OFF or mode is _KEEP:
        return raw, n
    return _FAST_USAGE.sub(b"", raw), n


def _slow(mode: UsageMode, e: SseEvent) -> tuple[bytes, int | None]:
    """An event the byte rules do not cover (usage not last, a multi-line data field):
    parsed, and re-encoded without usage when it must go."""
    obj = parse_event_json(e.data)
    if obj is None or not isinstance(obj.get("usage"), dict):
        return e.raw, None
    v = obj["usage"].get("completion_tokens")
    n = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    if mode is _OFF or mode is _KEEP:
        return e.raw, n
    if obj.get("choices") == []:
        return (b"" if mode is _STRIP_ALL else e.raw), n
    del obj["usage"]
    head = b"event: " + e.event.encode() + b"\n" if e.event else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":"),
                                          ensure_ascii=False).encode() + b"\n\n", n
