"""Tokenizers for `accounting.tokenizers`, loaded once at start-up (decision 0018).

A stream whose engine reports no running usage (Responses, Messages, or an engine that
ignores the option) is counted by re-encoding the text the client received with the
model's own tokenizer. The files are read at start-up, so a missing file or a missing
`tokenizers` package fails then, naming the field, not on the first interrupted stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.config import AccountingConfig, ConfigError

Counter = Callable[[str], int]


def load_tokenizers(cfg: AccountingConfig) -> dict[str, Counter]:
    """model -> a function counting the tokens of a text (special tokens not added)."""
    if not cfg.tokenizers:
        return {}
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("accounting.tokenizers", "needs the `tokenizers` package (the "
                          "`tokenizer` extra: pip install 'llm-failover-extproc[tokenizer]'; "
                          "the default image carries it)") from None
    out: dict[str, Counter] = {}
    for model, path in cfg.tokenizers:
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own exception types
            raise ConfigError(f"accounting.tokenizers.{model}",
                              f"cannot load tokenizer {path!r}: {e}") from None
        out[model] = _counter(tok)
    return out


def _counter(tok: Any) -> Counter:
    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids) if text else 0
    return count
