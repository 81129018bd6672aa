"""The generation proof of a causal LM converted with ``generate=True``.

Through the generated model.py (``init_cache`` / ``decode`` / ``generate``), against the torch
model it came from:

* **greedy tokens**: ``generate`` for :data:`STEPS` new tokens equals torch's
  ``generate(do_sample=False)`` at each prompt of :data:`PROMPTS`, one of them a left-padded
  batch with its ``attention_mask``. A row that parts from
  torch's counts as agreeing only at a tie: the two tokens' torch logits at that step within
  the float32 tolerance (the rest of that row is then not compared);
* **cached steps**: the logits of the prefill and of :data:`DECODES` one-token decode steps
  equal torch's full forward at those positions, under the dtype policy (float32 against
  float32; the float64 oracle judges the step's prefill in the main check).

The section goes into ``report.generation`` (``parity.json``); a failure fails the report.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: New tokens generated per prompt (fewer when the model's positions end sooner).
STEPS = 24
#: (batch, prompt length, left padding of the last row) of each check: the second batch holds
#: prompts of two lengths (``attention_mask``).
PROMPTS = ((1, 6, 0), (2, 11, 4))
#: One-token decode steps after the prefill whose logits are compared.
DECODES = 3


def _load_generated(out_dir: Path) -> Any:
    name = f"_xconv_generated_{abs(hash(str(out_dir)))}"
    spec = importlib.util.spec_from_file_location(name, out_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def check_generation(lm: Any, out_dir: Path, report: Any, options: Any = None) -> dict:
    """Run the checks of this module on the model.py in ``out_dir``; record them in
    ``report`` (``report.generation``, its verdict and notes) and return the section."""
    import torch

    from xconv.parity.metrics import compare
    from xconv.parity.policies import resolve_policy

    generated = _load_generated(Path(out_dir))
    module, variables = generated.load(out_dir)
    limit = generated.MAX_LENGTH or 10**9
    vocab = int(getattr(lm.config, "vocab_size", 0) or 0) or 2
    policy = resolve_policy("dtype")
    rows, steps_ok, tokens_ok = [], True, True
    for batch, prompt, pad in PROMPTS:
        steps = min(STEPS, limit - prompt)
        if steps < 1:
            continue
        gen = torch.Generator().manual_seed(batch * 100 + prompt)
        ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
        mask = torch.ones_like(ids)
        mask[-1, :pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
        with torch.no_grad():
            want = lm.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            ).numpy()
        got = np.asarray(
            generated.generate(
                module, variables, ids.numpy(), steps, attention_mask=mask.numpy(),
                eos_token_id=None,
            )
        )  # fmt: skip
        ties, parted = _divergences(lm, got, want, mask.numpy(), policy)
        tokens_ok &= not parted
        # Each cached step against the full forward at its position (padding slots excluded).
        decodes = min(DECODES, steps - 1)
        cache_mask = _extended(mask.numpy(), prompt + decodes)
        full = _forward(lm, want[:, : prompt + decodes], cache_mask)
        cache = generated.init_cache(batch, prompt + decodes)
        logits, cache = generated.decode(
            module, variables, want[:, :prompt], np.arange(prompt), cache, cache_mask
        )
        kept = mask.numpy() == 1
        metrics = [compare("prefill", np.asarray(logits)[kept], full[:, :prompt][kept], policy)]
        for t in range(prompt, prompt + decodes):
            logits, cache = generated.decode(
                module, variables, want[:, t : t + 1], np.array([t]), cache, cache_mask
            )
            metrics.append(compare(f"decode@{t}", np.asarray(logits)[:, 0], full[:, t], policy))
        worst = max(metrics, key=lambda m: (not m.passed, m.excess or 0.0))
        steps_ok &= worst.passed
        rows.append(
            {
                "batch": batch,
                "prompt": prompt,
                "left_padding": pad,
                "new_tokens": steps,
                "tokens_equal": bool((got == want).all()),
                "ties": ties,
                "parted": parted,
                "cached_steps": 1 + decodes,
                "worst_step": worst.name,
                "max_abs": worst.max_abs,
                "passed": not parted and worst.passed,
            }
        )
    section = {
        "passed": steps_ok and tokens_ok,
        "policy": "greedy tokens against torch generate(do_sample=False); cached-step logits "
        "against torch's full forward, dtype policy",
        "runs": rows,
    }
    report.generation = section
    if not section["passed"]:
        report.passed = False
        report.reason = report.reason or "generation differs from torch (see generation)"
    report.notes.append("generation: " + "; ".join(_summary(r) for r in rows))
    return section


def _summary(run: dict) -> str:
    padded = f" (last row left-padded by {run['left_padding']})" if run["left_padding"] else ""
    tokens = "equal" if run["tokens_equal"] else "differ" if run["parted"] else "equal up to ties"
    return (
        f"batch {run['batch']} prompt {run['prompt']}{padded}: {run['new_tokens']} greedy "
        f"tokens {tokens}, {run['cached_steps']} cached steps max |diff| {run['max_abs']:.2e}"
    )


def _extended(mask: np.ndarray, length: int) -> np.ndarray:
    """The prompt's ``attention_mask`` followed by ones up to ``length`` slots."""
    full = np.ones((mask.shape[0], length), mask.dtype)
    full[:, : mask.shape[1]] = mask
    return full


def _forward(lm: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """torch's full-forward logits of ``ids`` under ``mask``, each row numbered as
    transformers' generate numbers it (the count of unmasked slots before a token)."""
    import torch

    attention = torch.from_numpy(mask[:, : ids.shape[1]]).long()
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    with torch.no_grad():
        out = lm(torch.from_numpy(ids), attention_mask=attention, position_ids=positions)
    return out.logits.float().numpy()


def _divergences(lm: Any, got: np.ndarray, want: np.ndarray, mask: np.ndarray, policy: Any):
    """Rows where the tokens part: ``(ties, parted)`` as ``[{"row", "step"}]``. A tie is a
    step where torch's logits of the two tokens are within the policy's tolerance."""
    prompt = mask.shape[1]
    ties, parted = [], []
    for row in range(got.shape[0]):
        differ = np.nonzero(got[row, prompt:] != want[row, prompt:])[0]
        if not differ.size:
            continue
        step = int(differ[0])
        position = prompt + step
        row_mask = _extended(mask[row : row + 1], position)
        logits = _forward(lm, want[row : row + 1, :position], row_mask)[0, -1]
        a, b = float(logits[want[row, position]]), float(logits[got[row, position]])
        rtol, atol = policy.tolerances(np.float32)
        bound = atol + rtol * max(abs(a), abs(b))
        (ties if abs(a - b) <= bound else parted).append({"row": row, "step": step})
    return ties, parted
