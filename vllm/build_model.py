"""Build a tiny LlamaForCausalLM + byte-level BPE tokenizer + ChatML-like template, offline.

Nothing comes from a hub. Seed 1234 and a generated, fixed corpus: every rebuild gives
byte-identical weights and tokenizer files (`--check` proves it by building twice).

The LM-head rows of special tokens and of tokens that do not decode to printable ASCII are
zeroed, so greedy (temperature 0) output is printable and never hits EOS: it always runs to
`max_tokens` (`finish_reason: "length"`), one non-empty content delta per token.

Shapes:
  default  2 layers, hidden 256, 4 heads x 64, MLP 512, max positions 512   (~1.7 M params)
  slow     8 layers, hidden 1024, 16 heads x 64, MLP 2048, max positions 4096 (~85 M params):
           a real prefill/decode window on CPU (~25 tok/s per stream, prefill ~ms per token)

Run with the vLLM venv's python (needs torch, transformers, tokenizers, safetensors):
  .venv-vllm/bin/python vllm/build_model.py --out build/tiny-llama [--shape slow]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

SEED = 1234
VOCAB_SIZE = 652
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHAPES: dict[str, dict[str, int]] = {
    "default": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512,
                "max_position_embeddings": 512},
    "slow": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 16, "head_dim": 64, "intermediate_size": 2048,
             "max_position_embeddings": 4096},
}
# Bump when the recipe changes: a stamp with another value makes the target rebuild.
RECIPE = "tiny-llama/3"

_WORDS_TEXT = (
    "the a an of to and in is it that for on with as was at by this be from or are "
    "gateway replica stream token delta prefill decode cache request answer model server "
    "quick brown fox jumps over lazy dog worker engine queue batch attempt lease fence "
    "journal client error retry deliver first last every never always count check test "
    "kernel thread core memory block page write read send close open wait time state "
    "function code value index number string list table field record event chunk byte "
    "alpha beta gamma delta epsilon zeta theta lambda sigma omega north south east west "
    "red green blue yellow black white small large fast slow early late old new good "
    "run runs running ran walk walks quickly slowly carefully simply clearly counts"
)
WORDS = _WORDS_TEXT.split()


def corpus(n_sentences: int = 160) -> list[str]:
    """~6 KB of generated English, the same on every run."""
    rng = random.Random(SEED)
    out: list[str] = []
    for _ in range(n_sentences):
        n = rng.randint(4, 12)
        words = [rng.choice(WORDS) for _ in range(n)]
        s = " ".join(words).capitalize()
        if rng.random() < 0.2:
            s += f" {rng.randint(0, 999)}"
        out.append(s + rng.choice([".", ".", ".", "?", "!", ","]))
    return out


def build_tokenizer(out: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
        pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Make sure the template is on disk whatever the transformers version does with it.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return fast


def printable_ids(fast: object) -> set[int]:
    """Token ids that decode, alone, to a non-empty string of printable ASCII (0x20-0x7e)."""
    special = {fast.convert_tokens_to_ids(t) for t in SPECIALS}  # type: ignore[attr-defined]
    ok: set[int] = set()
    for i in range(len(fast)):  # type: ignore[arg-type]
        if i in special:
            continue
        s = fast.decode([i], skip_special_tokens=False)  # type: ignore[attr-defined]
        if s and all(0x20 <= ord(c) <= 0x7E for c in s):
            ok.add(i)
    return ok


def build_model(out: Path, shape: str, fast: object) -> dict[str, object]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}  # type: ignore[attr-defined]
    cfg = LlamaConfig(
        vocab_size=len(fast), **SHAPES[shape],  # type: ignore[arg-type]
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"], torch_dtype="float32")
    with torch.no_grad():
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        keep = printable_ids(fast)
        mask = torch.ones(cfg.vocab_size, dtype=torch.bool)
        mask[sorted(keep)] = False
        model.lm_head.weight[mask] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "printable_tokens": len(keep), "zeroed_rows": int(mask.sum())}


def digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.name == "build-info.json" or not p.is_file():
            continue
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def build(out: Path, shape: str) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    try:
        fast = build_tokenizer(tmp)
        info = build_model(tmp, shape, fast)
        info.update({"recipe": RECIPE, "shape": shape, "seed": SEED, "vocab": len(fast),
                     "sha256": digest(tmp)})
        (tmp / "build-info.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def up_to_date(out: Path, shape: str) -> bool:
    stamp = out / "build-info.json"
    if not stamp.exists():
        return False
    info = json.loads(stamp.read_text())
    return bool((info.get("recipe"), info.get("shape")) == (RECIPE, shape)
                and info.get("sha256") == digest(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--check", action="store_true",
                    help="build a second copy and fail unless it is byte-identical")
    a = ap.parse_args(argv)
    out: Path = a.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not a.force and up_to_date(out, a.shape):
        print(f"model up to date: {out} ({a.shape})")
    else:
        info = build(out, a.shape)
        print(f"built {out}: {json.dumps(info, sort_keys=True)}")
    if a.check:
        mine = json.loads((out / "build-info.json").read_text())["sha256"]
        twin = out.parent / (out.name + ".check")
        try:
            other = build(twin, a.shape)
        finally:
            shutil.rmtree(twin, ignore_errors=True)
        if other["sha256"] != mine:
            print(f"NOT deterministic: {mine} != {other['sha256']}", file=sys.stderr)
            return 1
        print(f"deterministic: a second build has the same sha256 {mine[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
