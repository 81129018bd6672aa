"""The generation proof of a causal LM converted with ``generate=True``.

Through the generated model.py (``init_cache`` / ``decode`` / ``generate``), against the torch
model it came from:

* **greedy tokens**: ``generate`` for :data:`STEPS` new tokens equals torch's
  ``generate(do_sample=False)`` at each prompt of :data:`PROMPTS`. A row that parts from
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
#: (batch, prompt length) of each check.
PROMPTS = ((1, 6), (2, 11))
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
    for batch, prompt in PROMPTS:
        steps = min(STEPS, limit - prompt)
        if steps < 1:
            continue
        gen = torch.Generator().manual_seed(batch * 100 + prompt)
        ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
        with torch.no_grad():
            want = lm.generate(
                ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
            ).numpy()
        got = np.asarray(
            generated.generate(module, variables, ids.numpy(), steps, eos_token_id=None)
        )
        ties, parted = _divergences(lm, got, want, prompt, policy)
        tokens_ok &= not parted
        # Each cached step against the full forward at its position.
        decodes = min(DECODES, steps - 1)
        full_ids = torch.from_numpy(want[:, : prompt + decodes])
        with torch.no_grad():
            full = lm(full_ids).logits.float().numpy()
        cache = generated.init_cache(batch, prompt + decodes)
        logits, cache = generated.decode(
            module, variables, want[:, :prompt], np.arange(prompt), cache
        )
        metrics = [compare("prefill", np.asarray(logits), full[:, :prompt], policy)]
        for t in range(prompt, prompt + decodes):
            logits, cache = generated.decode(
                module, variables, want[:, t : t + 1], np.array([t]), cache
            )
            metrics.append(compare(f"decode@{t}", np.asarray(logits)[:, 0], full[:, t], policy))
        worst = max(metrics, key=lambda m: (not m.passed, m.excess or 0.0))
        steps_ok &= worst.passed
        rows.append(
            {
                "batch": batch,
                "prompt": prompt,
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
    report.notes.append(
        "generation: "
        + "; ".join(
            f"batch {r['batch']} prompt {r['prompt']}: {r['new_tokens']} greedy tokens "
            f"{'equal' if r['tokens_equal'] else 'differ' if r['parted'] else 'equal up to ties'}"
            f", {r['cached_steps']} cached steps max |diff| {r['max_abs']:.2e}"
            for r in rows
        )
    )
    return section


def _divergences(lm: Any, got: np.ndarray, want: np.ndarray, prompt: int, policy: Any):
    """Rows where the tokens part: ``(ties, parted)`` as ``[{"row", "step"}]``. A tie is a
    step where torch's logits of the two tokens are within the policy's tolerance."""
    import torch

    ties, parted = [], []
    for row in range(got.shape[0]):
        differ = np.nonzero(got[row, prompt:] != want[row, prompt:])[0]
        if not differ.size:
            continue
        step = int(differ[0])
        position = prompt + step
        with torch.no_grad():
            logits = lm(torch.from_numpy(want[row : row + 1, :position])).logits[0, -1]
        a, b = float(logits[want[row, position]]), float(logits[got[row, position]])
        rtol, atol = policy.tolerances(np.float32)
        bound = atol + rtol * max(abs(a), abs(b))
        (ties if abs(a - b) <= bound else parted).append({"row": row, "step": step})
    return ties, parted
