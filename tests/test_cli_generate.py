"""``xconv torch-to-flax FOLDER --generate``: a causal LM's save_pretrained folder becomes a
Flax model.py that generates, and parity.json proves it against torch (greedy tokens and
cached steps, :mod:`xconv.parity.generation`)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = transformers.GPT2Config(vocab_size=80, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=48, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


def _converted(path, target, out):
    """``xconv torch-to-TARGET FOLDER --generate``: the CLI's output, the passed report's
    generation runs and the generated model.py, imported."""
    result = CliRunner().invoke(main, [f"torch-to-{target}", str(path), "-o", str(out),
                                       "--generate"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and report["generation"]["passed"], report["generation"]
    spec = importlib.util.spec_from_file_location(f"cli_generated_{target}", out / "model.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    return result.output, report["generation"]["runs"], generated


def test_generate_folder_writes_a_model_that_generates_like_torch(folder, tmp_path):
    path, model = folder
    out = tmp_path / "out"
    output, runs, generated = _converted(path, "flax", out)
    assert [r["new_tokens"] for r in runs] == [24, 24] and all(r["tokens_equal"] for r in runs)
    assert [r["left_padding"] for r in runs] == [0, 4]  # a batch of prompts of two lengths
    assert "greedy tokens equal" in output and "left-padded by 4" in output
    module, variables = generated.load(out)
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0).numpy()  # fmt: skip
    got = np.asarray(generated.generate(module, variables, ids.numpy(), 10, eos_token_id=None))
    assert (got == want).all()


def test_generate_to_jax_writes_a_function_that_generates_like_torch(folder, tmp_path):
    """``torch-to-jax --generate``: model.py's ``load()`` gives ``(fn, params)`` and the same
    ``init_cache`` / ``decode`` / ``generate`` over them; parity.json has the same proof."""
    path, model = folder
    out = tmp_path / "out"
    _, runs, generated = _converted(path, "jax", out)
    assert all(r["tokens_equal"] for r in runs)
    assert ruff_findings(out / "model.py", line_length=100) == ""
    fn, params = generated.load(out)
    ids = torch.randint(3, 80, (2, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0).numpy()  # fmt: skip
    got = generated.generate(fn, params, ids.numpy(), 10, attention_mask=mask.numpy(),
                             eos_token_id=None)  # fmt: skip
    assert (np.asarray(got) == want).all()


def test_generate_usage_errors(folder, tmp_path):
    path, _ = folder
    runner = CliRunner()
    result = runner.invoke(main, ["torch-to-onnx", str(path), "-o", str(tmp_path / "j"),
                                  "--generate"])  # fmt: skip
    assert result.exit_code == 2 and "--generate" in result.output
    result = runner.invoke(main, ["torch-to-flax", "--module", "transformers:GPT2LMHeadModel",
                                  "--config", str(path / "config.json"), "--weights", str(path),
                                  "-o", str(tmp_path / "w"), "--generate"])  # fmt: skip
    assert result.exit_code == 2 and "not with --weights" in result.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "j").exists()


def test_a_wrong_model_fails_the_generation_check(folder, tmp_path):
    """The section judges: the converted folder with one layer-1 weight scaled by 1.01
    fails it (the logits of the cached steps part from torch's full forward)."""
    import types

    import jax
    from flax import serialization

    from xconv.parity.generation import check_generation

    path, model = folder
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["torch-to-flax", str(path), "-o", str(out), "--generate",
                                       "--no-check"])  # fmt: skip
    assert result.exit_code == 0, result.output
    stored = out / "variables.msgpack"
    variables = serialization.msgpack_restore(stored.read_bytes())
    leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
    path_1 = next(p for p, v in leaves if "h_1" in jax.tree_util.keystr(p) and v.ndim == 2)
    wrong = jax.tree_util.tree_map_with_path(lambda p, v: v * 1.01 if p == path_1 else v, variables)
    stored.write_bytes(serialization.msgpack_serialize(wrong))
    report = types.SimpleNamespace(passed=True, reason=None, notes=[], generation=None)
    section = check_generation(model, out, report)
    assert not section["passed"] and not report.passed, section
    assert "generation differs" in report.reason
