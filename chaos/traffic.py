"""Client traffic: seeded request specs, and one bounded send that keeps what came back."""

from __future__ import annotations

import random
import time

import httpx

from devkit.demo.tokens import chat_prompt, generate_tokens

from .checks import FAMILIES, Seen, Spec

# Per-request replica faults (README, devkit/demo/replica.py). `freeze-after-deltas` is left
# out: it stops the replica until someone continues it; the chaos loop freezes replicas.
# {n} is a token index drawn per request.
REQUEST_FAULTS: tuple[str, ...] = (
    "kill-before-headers", "kill-after-headers", "kill-after-compute:{n}",
    "kill-after-deltas:{n}", "reset-after-deltas:{n}", "stall-after-deltas:{n}",
    "error-after-deltas:{n}", "slow-first-delta:0.4", "overloaded:503",
    "overloaded:429:0",
)
PROMPTS: tuple[str, ...] = ("hello", "tell me a story", "what is a lease",
                            "name three rivers", "explain fencing", "count to five")


def reference(spec: Spec) -> list[str]:
    """The demo replica's deterministic answer for this request (devkit/demo/tokens.py):
    computed, not asked, so no replica's state can change it."""
    if spec.family == "completions":
        prompt = spec.prompt
    else:  # chat and messages: one user message; responses: `input` as one user item
        prompt = chat_prompt([{"role": "user", "content": spec.prompt}])
    return generate_tokens(prompt, spec.seed, spec.max_tokens)


def make_spec(rng: random.Random, index: int, run_tag: str, fault_share: float,
              keyed_share: float) -> Spec:
    family = rng.choice(FAMILIES)
    stream = rng.random() < 0.75
    max_tokens = rng.randint(3, 16)
    key = f"chaos-{run_tag}-{index}" if rng.random() < keyed_share else None
    fault = fault_attempt = None
    if rng.random() < fault_share:
        fault = rng.choice(REQUEST_FAULTS).format(n=rng.randint(0, max_tokens))
        if rng.random() < 0.15:
            fault_attempt = "all"
    return Spec(family=family, stream=stream, prompt=rng.choice(PROMPTS),
                seed=rng.randint(0, 5), max_tokens=max_tokens, key=key, fault=fault,
                fault_attempt=fault_attempt, token_delay_ms=rng.choice((0, 5, 20, 60)))


def send(client: httpx.Client, spec: Spec, bound_s: float, with_fault: bool = True) -> Seen:
    """One POST, read to its end or to `bound_s` (then `timed_out`): never longer.

    The read timeout is the bound itself, and the elapsed time is checked between chunks,
    so neither a silent nor a trickling stream holds the worker past it (plus one read).
    """
    started, t0 = time.time(), time.monotonic()
    status, headers, raw, err, timed_out = 0, {}, b"", None, False
    try:
        with client.stream("POST", spec.path, json=spec.body(),
                           headers=spec.headers(with_fault),
                           timeout=httpx.Timeout(bound_s, connect=5.0)) as r:
            status, headers = r.status_code, {k.lower(): v for k, v in r.headers.items()}
            for chunk in r.iter_raw():
                raw += chunk
                if time.monotonic() - t0 > bound_s:
                    timed_out, err = True, "client bound reached"
                    break
    except httpx.TimeoutException as e:
        timed_out, err = True, f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        err = f"{type(e).__name__}: {e}"
    return Seen(status=status, headers=headers, body=raw.decode("utf-8", "replace"),
                transport_error=err, started_at=started, elapsed_s=time.monotonic() - t0,
                timed_out=timed_out)
