"""adapters/tokenizer: `accounting.tokenizers` is read at start-up, so a file that cannot be
loaded stops the start naming the model's field; a loaded one counts a text's tokens without
special tokens, and an empty text as none."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.adapters.tokenizer import load_tokenizers
from extproc.core.config import AccountingConfig, ConfigError, load_config

tokenizers = pytest.importorskip("tokenizers")


def _cfg(tok: dict[str, str]) -> AccountingConfig:
    return load_config({"accounting": {"tokenizers": tok}}).accounting


def _word_level(path: Path) -> str:
    """A tiny real tokenizer file: whitespace-split words, a post-processor that would add
    [CLS]/[SEP] if special tokens were asked for."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok.save(str(path))
    return str(path)


def test_no_tokenizers_configured_loads_nothing() -> None:
    assert load_tokenizers(_cfg({})) == {}


def test_a_loaded_tokenizer_counts_without_special_tokens(tmp_path: Path) -> None:
    counters = load_tokenizers(_cfg({"m1": _word_level(tmp_path / "t.json")}))
    assert set(counters) == {"m1"}
    count = counters["m1"]
    assert count("hello world hello") == 3  # not 5: [CLS] and [SEP] are not the client's
    assert count("unknown words") == 2
    assert count("") == 0


@pytest.mark.parametrize("content", [None, "{not json"])
def test_a_file_that_cannot_be_loaded_fails_the_start_naming_the_model(
        tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        load_tokenizers(_cfg({"llama": str(path)}))
    assert "accounting.tokenizers.llama" in str(e.value) and str(path) in str(e.value)
