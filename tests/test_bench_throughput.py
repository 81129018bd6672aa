"""benchmarks/bench_throughput.py: the hand-written Flax models match torch, the table's ratios
and target verdicts follow the timings, and a --quick run of the small CNN completes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("flax")
pytest.importorskip("transformers")


def test_hand_written_resnet_loads_torch_weights():
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    from benchmarks import flax_models as fm

    torch.manual_seed(0)
    config = ResNetConfig(depths=[1, 1], hidden_sizes=[16, 32], embedding_size=8, num_labels=5)
    model = ResNetForImageClassification(config).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x).logits.numpy()
    flax_model = fm.ResNet(depths=(1, 1), hidden_sizes=(16, 32), embedding_size=8, num_classes=5)
    nhwc = x.numpy().transpose(0, 2, 3, 1)
    variables = fm.from_torch_state(flax_model, nhwc, fm.resnet_state(model.state_dict()))
    got = np.asarray(flax_model.apply(variables, nhwc))
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_hand_written_bert_loads_torch_weights():
    import torch
    from transformers import BertConfig, BertModel

    from benchmarks import flax_models as fm

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state.numpy()
    flax_model = fm.Bert(vocab_size=100, hidden=32, layers=2, heads=4, intermediate=64)
    variables = fm.from_torch_state(flax_model, ids.numpy().astype(np.int32), model.state_dict())
    got = np.asarray(flax_model.apply(variables, ids.numpy().astype(np.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_hand_written_encoder_loads_torch_weights():
    import torch

    from benchmarks import bench_throughput as bt
    from benchmarks import flax_models as fm

    module = bt.build_torch("transformer")
    x = bt.make_input("transformer", 2)[:, :16]
    with torch.no_grad():
        want = module(torch.as_tensor(x)).numpy()
    flax_model = fm.Encoder()
    got = np.asarray(flax_model.apply(fm.from_torch_state(flax_model, x, module.state_dict()), x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _row(path, dtype, infer, note="", parity="pass"):
    return {
        "path": path,
        "dtype": dtype,
        "infer": infer,
        "train": {},
        "infer_compile": {},
        "train_compile": {},
        "conversion_s": 1.0,
        "parity": parity,
        "note": note,
    }


def test_table_ratios_and_targets_follow_the_timings():
    from benchmarks import bench_throughput as bt

    result = {
        "model": "cnn",
        "batches": [1],
        "meta": {"from_torch_s": 1.0},
        "rows": [
            _row("onnxruntime, torch.onnx export", "fp32", {1: 1.0}),
            _row("onnxruntime, xconv .onnx", "fp32", {1: 1.5}),
            _row("torch2jax (t2j) + jit", "fp32", {1: 0.8}),
            _row("hand-written Flax + jit", "fp32", {1: 1.0}),
            _row("xconv to_jax + jit", "fp32", {1: 0.5}),
            _row("xconv generated Flax + jit", "fp32", {1: 0.9}),
            _row("xconv to_jax + jit", "bf16", {}, note="not available at this commit"),
        ],
    }
    text = "\n".join(bt.render_model(result))
    gen = next(line for line in text.splitlines() if line.startswith("| xconv generated Flax"))
    assert "| ×1.12 | ×0.90 |" in gen  # 0.9 / 0.8 (t2j is the best JAX path), 0.9 / 1.0
    assert "xconv generated Flax + jit fp32 infer b=1: ×1.12 the best JAX path" in text
    assert "xconv to_jax + jit fp32 infer" not in text.split("Targets")[1]  # ×0.62 and ×0.50: met
    assert "onnxruntime, xconv .onnx fp32 infer b=1: ×1.50 the torch.onnx export" in text
    assert "xconv to_jax + jit bf16 infer b=1: not measured (not available at this commit)" in text
    # A peer that fails parity computes another function: no bar for the others.
    result["rows"][2]["parity"] = "FAIL (max err 3.3e-04)"
    text = "\n".join(bt.render_model(result))
    gen = next(line for line in text.splitlines() if line.startswith("| xconv generated Flax"))
    assert "| ×0.90 | ×0.90 |" in gen  # the hand-written Flax is the best JAX path now
    assert "the best JAX path" not in text.split("Targets")[1]
    # One that fails on a GPU at JAX's default (TF32) dots only computes the same function.
    result["rows"][2]["parity"] = (
        "FAIL on gpu:0 (max err 2.6e-03); pass at matmul precision highest"
    )
    gen = next(
        line for line in bt.render_model(result) if line.startswith("| xconv generated Flax")
    )
    assert "| ×1.12 | ×0.90 |" in gen


@pytest.mark.slow
def test_quick_run_on_the_small_cnn(tmp_path):
    out = tmp_path / "throughput.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_throughput.py"),
            "--models",
            "cnn",
            "--quick",
            "--skip",
            "torch",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for path in (
        "hand-written Flax + jit",
        "xconv to_jax + jit",
        "xconv generated Flax + jit",
        "onnxruntime, xconv .onnx",
    ):
        line = next(x for x in text.splitlines() if x.startswith(f"| {path} | fp32"))
        cells = [c.strip() for c in line.split("|")]
        assert float(cells[3].replace(",", "")) > 0, line  # b=1 throughput measured
        assert "pass" in line, line  # parity verdict vs torch
    assert "## GPU" in text


def _result(rows, batches=(1,)):
    return {"model": "cnn", "batches": list(batches), "meta": {"from_torch_s": 1.0}, "rows": rows}


def _stamp(commit, load="1.00 1.00 1.00"):
    return {"commit": commit, "date": "d", "load_before": load, "load_after": load, "argv": []}


def test_runs_merge_into_the_store_and_each_section_names_its_runs():
    from benchmarks import bench_throughput as bt
    from benchmarks import throughput_store as store

    stored: dict = {}
    fp32 = [
        _row("hand-written Flax + jit", "fp32", {1: 1.0}),
        _row("xconv to_jax + jit", "fp32", {1: 2.0}),
    ]
    store.merge(stored, "cpu", _result(fp32), _stamp("aaa"))
    # a bf16 run, then an fp32 run of b=8 only: the older rows and batches stay
    store.merge(
        stored, "cpu", _result([_row("xconv to_jax + jit", "bf16", {1: 3.0})]), _stamp("bbb")
    )
    b8 = [
        _row("xconv to_jax + jit", "fp32", {8: 4.0}),
        _row("torch.compile", "fp32", {}, note="not run"),
    ]
    store.merge(stored, "cpu", _result(b8, batches=(8,)), _stamp("ccc"))
    # a path measured nothing this time: its stored timings stay
    store.merge(
        stored,
        "cpu",
        _result([_row("hand-written Flax + jit", "fp32", {}, note="x")]),
        _stamp("ddd"),
    )
    stored = json.loads(json.dumps(stored))  # through the .json file's types
    (result,) = store.results(stored, "cpu", ["cnn"])
    rows = {(r["path"], r["dtype"]): r for r in result["rows"]}
    assert result["batches"] == [1, 8]
    assert rows["xconv to_jax + jit", "fp32"]["infer"] == {1: 2.0, 8: 4.0}
    assert rows["xconv to_jax + jit", "bf16"]["infer"] == {1: 3.0}
    assert rows["hand-written Flax + jit", "fp32"]["infer"] == {1: 1.0}
    assert [r["commit"] for r in result["runs"]] == ["aaa", "bbb", "ccc"]  # ddd measured nothing
    text = "\n".join(bt.render_model(result))
    to_jax = next(x for x in text.splitlines() if x.startswith("| xconv to_jax + jit | fp32"))
    assert to_jax.endswith("| 1/3 |")  # b=1 from run 1, b=8 from run 3
    assert "- run 2: commit `bbb`" in text and "bf16 b=1" in text
    assert "- run 3: commit `ccc`" in text and "fp32 b=8" in text


def test_a_training_only_run_keeps_the_inference_cells_and_shows_peak_memory():
    from benchmarks import bench_throughput as bt
    from benchmarks import throughput_store as store

    stored: dict = {}
    old = _row("xconv to_jax + jit", "fp32", {32: 2.0})  # no peak fields: stored before them
    store.merge(stored, "cpu", _result([old], batches=(32,)), _stamp("aaa"))
    new = _row("xconv to_jax + jit", "fp32", {})
    new.update(train={32: 6.0}, train_compile={32: 9.0}, train_peak={32: 1536.4})
    store.merge(stored, "cpu", _result([new], batches=(32,)), _stamp("bbb"))
    stored = json.loads(json.dumps(stored))
    (result,) = store.results(stored, "cpu", ["cnn"])
    (row,) = result["rows"]
    assert row["infer"] == {32: 2.0} and row["train"] == {32: 6.0}
    assert row["run"] == {"infer": {32: 1}, "train": {32: 2}}
    text = "\n".join(bt.render_model(result))
    infer, train = (x for x in text.splitlines() if x.startswith("| xconv to_jax + jit"))
    assert "| — | 1.0 |" in infer  # no peak stored for the older run: a dash, then conversion s
    assert "| 9.0 | 1,536 | 1.0 |" in train  # compile s, peak MiB, conversion s
    # The first call's peak: what it added to the process's resident memory.
    seconds, peak = bt.first_call(lambda: np.ones(64 << 20, np.uint8).sum())
    assert seconds > 0
    if Path("/proc/self/clear_refs").exists():  # Linux: the peak mark must be read
        assert peak is not None and 60 < peak < 200, peak


def test_a_gpu_run_names_its_device_and_versions_in_its_own_section():
    from benchmarks import bench_throughput as bt
    from benchmarks import throughput_store as store

    stored: dict = {}
    cpu = _row("xconv to_jax + jit", "fp32", {1: 2.0})
    store.merge(stored, "cpu", _result([cpu]), _stamp("aaa"))
    gpu = _row("xconv to_jax + jit", "fp32", {1: 0.001})
    stamp = {**_stamp("bbb"), "device": "NVIDIA H200", "versions": "torch 2.11.0, jax 0.11.2"}
    store.merge(stored, "gpu", _result([gpu]), stamp)
    stored = json.loads(json.dumps(stored))
    sections = {b: store.results(stored, b, ["cnn"]) for b in stored}
    text = bt.render(sections, {"machine": "m", "versions": "v", "devices": "CpuDevice(id=0)"})
    cpu_text, gpu_text = text.split("## GPU")
    assert "- run 1: commit `aaa`" in cpu_text and "H200" not in cpu_text
    assert "- run 1: commit `bbb`" in gpu_text
    assert "on NVIDIA H200 with torch 2.11.0, jax 0.11.2" in gpu_text
    assert "not the device's" in gpu_text and "Not measured (no device lent)" not in gpu_text
    assert bt._accelerator("cpu") == {}  # CPU runs keep the header's versions


def test_processes_combine_into_per_timing_medians():
    from benchmarks import throughput_store as store

    def run(hand, xc, parity="pass"):
        rows = [
            _row("hand-written Flax + jit", "fp32", hand),
            _row("xconv to_jax + jit", "fp32", xc, parity=parity),
        ]
        return json.loads(json.dumps(_result(rows, batches=(1, 8))))  # as the worker writes it

    results = [
        run({1: 1.0, 8: 9.0}, {1: 2.0}),
        {"model": "cnn", "error": "worker exited with 1"},
        run({1: 3.0, 8: 5.0}, {1: 1.0, 8: 4.0}, parity="FAIL (max err 1e-1)"),
        run({1: 2.0, 8: 7.0}, {1: 5.0}),
    ]
    combined = store.combine(results)
    hand, xc = combined["rows"]
    assert hand["infer"] == {1: 2.0, 8: 7.0}  # medians of the three that ran
    assert xc["infer"] == {1: 2.0, 8: 4.0}  # b=8: the one process that measured it
    assert xc["parity"].startswith("FAIL")  # one failing process fails the row
    assert hand["parity"] == "pass"
    assert combined["meta"]["processes"] == 3
    # every process's own timing, in process order, where all three measured the batch
    assert hand["processes"]["infer"] == {1: [1.0, 3.0, 2.0], 8: [9.0, 5.0, 7.0]}
    assert xc["processes"]["infer"] == {1: [2.0, 1.0, 5.0], 8: [None, 4.0, None]}
    assert store.combine(results[1:2])["error"]  # every process failed: the error stands
    assert store.combine(results[:1])["rows"][0]["infer"] == {1: 1.0, 8: 9.0}
    assert store.combine(results[:1])["rows"][0]["processes"]["infer"] == {}


def test_a_missed_target_names_its_ratio_over_the_processes():
    from benchmarks import bench_throughput as bt
    from benchmarks import throughput_store as store

    def run(hand, xc):
        rows = [
            _row("hand-written Flax + jit", "fp32", {1: hand}),
            _row("xconv to_jax + jit", "fp32", {1: xc}),
        ]
        return json.loads(json.dumps(_result(rows)))

    # per process x0.90, x1.00, x1.10: the median x1.00 misses x0.95, by less than the spread
    stored = store.merge(
        {}, "cpu", store.combine([run(1.0, 0.9), run(2.0, 2.0), run(3.0, 3.3)]), _stamp("a")
    )
    stored = json.loads(json.dumps(stored))
    (result,) = store.results(stored, "cpu", ["cnn"])
    targets = "\n".join(bt.render_model(result)).split("Targets")[1]
    assert (
        "xconv to_jax + jit fp32 infer b=1: ×1.00 the hand-written Flax "
        "(target ≤ ×0.95; ×0.90–×1.10 in the 3 processes)"
    ) in targets
    # a single-process rerun of the batch replaces the medians: no stale spread stays
    store.merge(stored, "cpu", run(1.0, 1.2), _stamp("b"))
    stored = json.loads(json.dumps(stored))
    (result,) = store.results(stored, "cpu", ["cnn"])
    targets = "\n".join(bt.render_model(result)).split("Targets")[1]
    assert "×1.20 the hand-written Flax (target ≤ ×0.95)" in targets


def test_the_default_doc_is_not_written_from_uncommitted_code(monkeypatch):
    from benchmarks import bench_throughput as bt
    from benchmarks import throughput_store as store

    monkeypatch.setattr(store, "commit", lambda outputs=(): "abc" + store.DIRTY)
    ran = []
    monkeypatch.setattr(bt.subprocess, "run", lambda *a, **k: ran.append(a))
    assert bt.main(["--models", "cnn"]) == 2
    assert not ran  # refused before measuring anything


def test_a_batch_no_path_of_the_dtype_ran_is_not_a_miss():
    """bf16 runs at b=1 only for the big models: its b=8 is no target miss; a path that did
    not run where the hand-written model did is one."""
    from benchmarks import bench_throughput as bt

    result = {
        "model": "resnet50",
        "batches": [1, 8],
        "meta": {"from_torch_s": 1.0},
        "rows": [
            _row("hand-written Flax + jit", "fp32", {1: 1.0, 8: 4.0}),
            _row("xconv to_jax + jit", "fp32", {1: 0.9}),
            _row("hand-written Flax + jit", "bf16", {1: 1.0}),
            _row("xconv to_jax + jit", "bf16", {1: 0.9}),
        ],
    }
    targets = "\n".join(bt.render_model(result)).split("Targets")[1]
    assert "xconv to_jax + jit fp32 infer b=8: not measured" in targets
    assert "bf16 infer b=8" not in targets


def test_paths_are_timed_interleaved_and_a_failing_call_is_reported():
    from benchmarks import bench_throughput as bt

    order: list[str] = []

    def call(name):
        return lambda: order.append(name)

    def broken():
        order.append("broken")
        raise RuntimeError("lost the device")

    got = bt.interleaved_medians([call("a"), broken, call("b")], repeat=6)
    # one call of each per round, broken tried once, the rounds in varying orders
    assert order.count("a") == order.count("b") == 6 and order.count("broken") == 1
    timed = [n for n in order if n != "broken"]
    rounds = list(zip(timed[::2], timed[1::2], strict=True))
    assert all(set(p) == {"a", "b"} for p in rounds), order
    assert len(set(rounds)) == 2, order
    assert isinstance(got[1], RuntimeError)
    assert all(isinstance(t, float) and t >= 0 for t in (got[0], got[2]))


def test_a_path_no_longer_measured_can_be_dropped_from_the_store():
    from benchmarks import throughput_store as store

    def row(path, run):
        empty = {"infer": {}, "train": {}, "infer_compile": {}, "train_compile": {}}
        return {
            **empty,
            "path": path,
            "dtype": "fp32",
            "infer": {1: 0.1},
            "run": {"infer": {1: run}, "train": {}},
        }

    data = {
        "cpu": {
            "cnn": {
                "batches": [1],
                "meta": {},
                "runs": [{"commit": "a"}, {"commit": "b"}],
                "rows": [row("old layout", 1), row("hand", 2)],
            }
        }
    }
    assert store.drop(data, "cpu", "old layout") == 1
    entry = data["cpu"]["cnn"]
    assert [r["path"] for r in entry["rows"]] == ["hand"]
    assert entry["runs"] == [{"commit": "b"}] and entry["rows"][0]["run"]["infer"] == {1: 1}


def test_dense_layout_paths_compute_one_function_and_count_eigen_dots():
    """benchmarks/bench_dense_layout.py: its four formulations compute the same function
    (forward and gradient), and the dot counter reads only the compiled entry computation."""
    import jax

    from benchmarks import bench_dense_layout as bd

    paths = bd._paths(d=16, layers=2)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    outs = [np.asarray(jax.jit(apply)(params, x)) for apply, params in paths.values()]
    assert np.abs(outs[0]).max() > 0.1
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)
    stepped = [bd._step(apply)(params, x) for apply, params in paths.values()]
    assert len(stepped) == 4
    ff1 = [stepped[0]["block_0"]["ff1"]["kernel"], stepped[1]["block_0"]["ff1"]["kernel"]]
    ff1 += [stepped[2][0][0], stepped[3][0][0].T]
    for k in ff1[1:]:
        np.testing.assert_allclose(np.asarray(k), np.asarray(ff1[0]), rtol=1e-5, atol=1e-6)
    text = "%fused { %dot.1 = f32[2,2] dot(a, b) }\nENTRY %main {\n  %dot.2 = f32[4] dot(c, d)\n}"
    assert bd._eigen_dots(text) == 1


def test_attention_core_paths_compute_one_function():
    """benchmarks/bench_attention_core.py: its four formulations (and the generated Flax's
    ``_dot_product_attention`` helper among them) compute the same attention and gradient."""
    import jax

    from benchmarks import bench_attention_core as ba

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 8, 3, 4)).astype(np.float32) for _ in range(3))
    paths = ba.paths()
    assert "_dot_product_attention" in paths
    outs = [np.asarray(jax.jit(f)(q, k, v)) for f in paths.values()]
    assert np.abs(outs[0]).max() > 0.1
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)
    grads = [ba._grad(f)(q, k, v) for f in paths.values()]
    for g in grads[1:]:
        for a, b in zip(g, grads[0], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_roofline_counts_a_paths_flops_and_renders_its_rate():
    """benchmarks/bench_roofline.py: XLA's flop count of a path's compiled call is the
    arithmetic it does (2·m·n·k for one matmul; the SGD step several times that), and the
    table gives each path's rate against the matmul's."""
    from benchmarks import bench_roofline as rl
    from benchmarks.bench_throughput import JaxPath

    w = np.ones((8, 4), np.float32)
    path = JaxPath(lambda p, x: x @ p["w"], {"w": w})
    x = path.inputs(np.ones((16, 8), np.float32))
    assert rl.flops(path, x, "infer") >= 2 * 16 * 8 * 4
    assert rl.flops(path, x, "train") > 2 * rl.flops(path, x, "infer")
    call, count = rl.matmul(32, 8)
    assert count == 2 * 32 * 8 * 32
    assert 0 < rl.peak_rate(call, count, calls=3) < float("inf")
    rows = [
        {
            "model": "bert",
            "batch": 1,
            "mode": "infer",
            "path": p,
            "gflop": 1.0,
            "ms": ms,
            "gflops": 1e3 / ms,
            "of_peak": 1e3 / ms / 100,
            "x_hand": ms / 10,
            "peak": 100.0,
            "peak_shape": "(128, 768) @ (768, 3072)",
        }
        for p, ms in (("hand-written Flax", 10.0), ("xconv to_jax", 9.0))
    ]
    text = rl.render(rows, "test")
    assert "| bert | 1 | infer | xconv to_jax | 1.00 | 9.0 | 111 | 111 % | ×0.90 |" in text
    assert "| bert | 1 | infer | 100 % | ×1.00 | ×0.90 |" in text


def test_jax_and_interop_docs_render_their_rows():
    """benchmarks/bench_jax.py and bench_interop.py write their tables (no table in the
    README typed by hand): a peer that does not run says why instead of a time."""
    from benchmarks import bench_interop, bench_jax

    row = {"torch_ms": 2.0, "ort_ms": 0.5, "xconv_jax_ms": 1.0, "jax_vs_torch": 2.0}
    text = bench_jax.render(
        [{"model": "resnet", "batch": 32, **row, "jax_vs_ort": 0.5, "max_abs_err": 2e-7}], "test"
    )
    assert (
        "| ResNet-style CNN 3×32×32 (32) | 2.000 | 0.500 | 1.000 | 2.00× | 0.50× | 2.0e-07 |"
        in text
    )
    rows = [
        {
            "model": "mlp",
            "batch": 1,
            "xconv_ms": 0.05,
            "t2j_ms": 0.1,
            "xconv_err": 6e-8,
            "t2j_err": 1e-4,
        },
        {
            "model": "cnn",
            "batch": 1,
            "xconv_ms": 0.2,
            "xconv_err": 6e-8,
            "t2j_error": "KeyError: x",
        },
    ]
    bridge = {"jax_ms": 0.02, "j2t_ms": 0.14, "jax_fb_ms": 0.06, "j2t_fb_ms": 0.45, "grad_err": 0.0}
    text = bench_interop.render(rows, bridge, "test")
    assert "| MLP 16-32-32-8 (1) | 0.050 | 0.100 | 0.50 | 6.0e-08 | 1.0e-04 |" in text
    assert (
        "| ResNet-style CNN 3×32×32 (1) | 0.200 | — | — | 6.0e-08 | does not run: KeyError: x |"
        in text
    )
    assert "| forward, `torch.no_grad()` | 0.020 | 0.140 | 7.0× |" in text


def test_a_tree_copy_is_stamped_with_the_commit_it_was_copied_from(monkeypatch):
    from benchmarks import throughput_store as store

    monkeypatch.setattr(store, "_git", lambda *args: "")  # no .git
    monkeypatch.delenv("XCONV_TREE_COMMIT", raising=False)
    assert store.commit() == "unknown"
    monkeypatch.setenv("XCONV_TREE_COMMIT", "abc1234")
    assert store.commit() == "abc1234 (copy)"
    # a copy whose .git is another commit's, its files changed against it: the sender's word
    monkeypatch.setattr(store, "_git", lambda *a: "577c464" if "rev-parse" in a else " M x.py")
    assert store.commit() == "abc1234 (copy)"


def test_a_model_from_torch_cannot_convert_still_times_the_other_paths(monkeypatch, tmp_path):
    """torch 2.11's exporter failed on the transformer with a dynamic batch (on the lent GPU
    machine): the worker then died and the model lost every path's row. Now xconv's rows say
    why and the others run."""
    import xconv
    from benchmarks import bench_throughput as bt

    def broken(*args, **kwargs):
        raise xconv.errors.ConversionError("torch.onnx could not translate the program")

    monkeypatch.setattr(xconv, "from_torch", broken)
    # the worker points inductor at a cache folder it deletes after: restored after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "result.json"
    argv = ["--quick", "--skip", "torch,peers", "--worker", "cnn", "--json", str(out)]
    assert bt.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert rows["hand-written Flax + jit"]["infer"]  # timed
    for path in ("xconv to_jax + jit", "xconv generated Flax + jit", "onnxruntime, xconv .onnx"):
        assert "from_torch failed: ConversionError" in rows[path]["note"], rows[path]
    text = "\n".join(bt.render_model(result))
    assert "from_torch (dynamic batch) failed: ConversionError" in text
