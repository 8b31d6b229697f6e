"""Deterministic token generation for the demo replica.

Every replica must produce byte-identical output for the same request, so that a
re-run of a request on another replica (or on the same one after a restart) can
be compared chunk for chunk. Hence: no randomness, no clock, no process state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_SEED = 0
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_CAP = 4096

# Exactly 64 short words so that one hash byte (masked to 6 bits) picks one uniformly.
WORDS: tuple[str, ...] = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
    "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey", "xray",
    "yankee", "zulu", "red", "orange", "yellow", "green", "blue", "indigo",
    "violet", "black", "white", "grey", "north", "south", "east", "west",
    "stone", "river", "cloud", "light", "shadow", "field", "forest", "ocean",
    "copper", "silver", "gold", "iron", "glass", "paper", "signal", "packet",
    "route", "frame", "token", "stream", "delta", "retry", "proxy", "cache",
)  # fmt: skip
assert len(WORDS) == 64


def generate_tokens(
    prompt: str, seed: int = DEFAULT_SEED, max_tokens: int = DEFAULT_MAX_TOKENS
) -> list[str]:
    """Return ``max_tokens`` tokens, each ``" " + word``, fully determined by the inputs.

    The rule (kept simple so anyone can re-derive it):
    ``state_0 = sha256(utf8(prompt) + b"|" + ascii(str(seed)))``;
    for ``i`` in ``0..max_tokens-1``:
    ``state_{i+1} = sha256(state_i + b"|" + ascii(str(i)))`` and token ``i`` is
    ``" " + WORDS[state_{i+1}[0] & 63]``.

    Raises ``ValueError`` when ``max_tokens`` is outside ``0..MAX_TOKENS_CAP``.
    """
    if max_tokens < 0 or max_tokens > MAX_TOKENS_CAP:
        raise ValueError(f"max_tokens must be between 0 and {MAX_TOKENS_CAP}, got {max_tokens}")
    state = hashlib.sha256(prompt.encode("utf-8") + b"|" + str(seed).encode("ascii")).digest()
    tokens: list[str] = []
    for i in range(max_tokens):
        state = hashlib.sha256(state + b"|" + str(i).encode("ascii")).digest()
        tokens.append(" " + WORDS[state[0] & 63])
    return tokens


def _content_text(content: Any) -> str:
    """Flatten OpenAI message content: a string, or a list of ``{"type":"text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise ValueError("message content must be a string, a list of text parts or null")


def chat_prompt(messages: Iterable[Mapping[str, Any]]) -> str:
    """Build the generation prompt of a chat request.

    The exact rule: for each message in order, ``role + "\\n" + text + "\\n"``, all
    concatenated, where ``text`` is the string content, or the concatenation of the
    ``text`` fields of list-form content parts (non-text parts ignored), or ``""``
    for null content. Tool calls and other fields do not influence the output.
    """
    out: list[str] = []
    for message in messages:
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError("every message needs a string 'role'")
        out.append(f"{role}\n{_content_text(message.get('content'))}\n")
    return "".join(out)


def count_prompt_tokens(prompt: str) -> int:
    """A stable stand-in for a tokenizer: whitespace-separated words in the prompt."""
    return len(prompt.split())
