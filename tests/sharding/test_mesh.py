"""Converted models on an 8-device mesh (8 forced CPU devices, in a subprocess).

``mesh_worker`` converts the transformer and ResNet fixtures (torch -> IR -> Flax with each
partitioning strategy, Orbax weights), loads them onto 1x8 / 2x4 / 8x1 meshes with the
generated ``load(out_dir, mesh=)``, runs ``check_parity(..., mesh=)`` against the torch
source, takes one jitted training step sharded, and probes ``to_jax(mesh=)``'s errors. JAX
fixes its device count at start, so it runs in its own process; this suite keeps one device.
The default suite runs each strategy and each mesh once per model; ``-m slow`` runs all 18.
"""

from __future__ import annotations

import pytest

from tests.sharding.conftest import run_mesh_worker

SIZES = {
    "1x8": {"data": 1, "model": 8},
    "2x4": {"data": 2, "model": 4},
    "8x1": {"data": 8, "model": 1},
}


def _expected_shards(spec: list, mesh: str) -> int:
    n = 1
    for entry in spec:
        if entry is None:
            continue
        for axis in ("data", "model"):
            if f"'{axis}'" in entry or entry == axis:
                n *= SIZES[mesh][axis]
    return n


def _check_runs(result: dict, expected_pairs: int) -> None:
    assert result["devices"] == 8
    runs = result["runs"]
    assert len(runs) == expected_pairs
    for r in runs:
        where = f"{r['model']} {r['strategy']} {r['mesh']}"
        assert r["passed"], f"{where}: {r['verdict']}"
        assert r["mesh_report"] == SIZES[r["mesh"]], where
        assert r["n_params_reported"] > 10, where
        # The largest kernel really is split as its spec says...
        assert r["shards"] == _expected_shards(r["spec"], r["mesh"]), (where, r["spec"])
        # ... and split at all, unless the strategy's mesh axis has size 1 (TP on 8x1 is
        # pure data parallelism: parameters replicated, batch split).
        if not (r["strategy"] == "tp" and r["mesh"] == "8x1"):
            assert r["shards"] > 1, (where, r["spec"])
    kinds = {(r["model"], r["strategy"]) for r in runs}
    assert len(kinds) == 6  # both models, every strategy
    assert {r["mesh"] for r in runs} == set(SIZES)


def test_both_fixtures_pass_parity_sharded_on_every_mesh_and_strategy(default_run):
    _check_runs(default_run, 6)
    specs = {(r["model"], r["strategy"]): r["spec"] for r in default_run["runs"]}
    # FSDP splits one dimension over all 8 devices; TP the wide one over model; both: two.
    assert specs["transformer", "fsdp"] == ["('data', 'model')", None]
    assert specs["transformer", "tp"] == [None, "model"]
    assert specs["transformer", "fsdp+tp"] == ["data", "model"]
    assert specs["resnet", "fsdp+tp"] == [None, None, "data", "model"]


def test_generated_rule_table_and_source_are_deterministic(default_run):
    rules = {(r["model"], r["strategy"]): r["rules"] for r in default_run["runs"]}
    assert ["mlp", "model"] in rules["transformer", "tp"]
    assert ["embed", ["data", "model"]] in rules["transformer", "fsdp"]
    assert default_run["deterministic"] is True


def test_one_training_step_runs_sharded_and_matches_torch(default_run):
    """torch's SGD (momentum, weight decay) as optax via xconv.training, one jitted step on
    the 2x4 mesh with fsdp+tp, against torch's own step on the source module."""
    t = default_run["training"]["transformer"]
    loss_torch, loss_mesh = t["loss"]
    assert abs(loss_torch - loss_mesh) <= 1e-5 * max(1.0, abs(loss_torch))
    assert t["n_params"] == t["n_torch_params"]  # every parameter compared
    assert t["max_update"] > 1e-2  # the step moved the weights
    assert t["max_param_diff"] <= 1e-6, t  # float32 reduction-order noise only
    assert t["params_split_after_step"] >= t["n_params"] // 2  # still sharded after the step


def test_nnx_output_loads_onto_the_mesh_and_passes_parity(default_run):
    """``to_flax(api="nnx", partitioning="tp")``: ``load(mesh="1x8")`` restores the state
    straight onto the mesh; the largest kernel is split 8 ways over model; parity passes."""
    r = default_run["nnx"]["transformer"]
    assert r["passed"], r["verdict"]
    assert r["mesh_report"] == SIZES["1x8"]
    assert "model" in r["spec"] and r["shards"] == 8, r
    assert r["n_params"] > 10


def test_block_outputs_are_constrained_to_the_batch_over_data(default_run):
    """``with constrained(mesh):`` (generated, linen): every block's output gets a
    ``with_logical_constraint`` (batch over data) under jit on 2x4; numbers unchanged."""
    c = default_run["constrained"]
    assert c["n_block_classes"] >= 2, c  # the root and at least one source block class
    assert c["n_constraints"] >= c["n_block_classes"], c
    assert c["max_abs"] <= 1e-5, c  # float32 reduction order only
    assert c["out_spec"][0] == "data", c


def test_to_jax_on_a_mesh_and_its_errors(default_run):
    tj = default_run["to_jax"]
    assert tj["max_abs"] < 1e-5
    assert tj["ff1_spec"] == ["model", None]  # torch layout (out, in): out over model
    assert any("not divisible" in n for n in tj["notes"])  # vocab 50 on model=4: replicated
    errors = default_run["errors"]
    for label, message in errors.items():
        assert message is not None, f"{label}: no error raised"
        assert message.startswith("ShardingError"), f"{label}: {message}"
    assert "16 devices" in errors["mesh_mismatch"]
    assert "unknown mesh axis 'fsdp'" in errors["unknown_mesh_axis"]
    assert "unknown logical axis 'hidden'" in errors["unknown_logical_axis"]


@pytest.mark.slow
def test_full_matrix_all_strategies_on_all_meshes(tmp_path_factory):
    result = run_mesh_worker(tmp_path_factory, "full")
    _check_runs(result, 18)
    # Weights-only path: the torch state_dict streamed into an Orbax checkpoint on the mesh
    # loads exactly as the one to_flax wrote, with the same shardings.
    ws = result["weights_stream"]
    assert ws["same_keys"] and ws["same_specs"] and ws["split"] > 10
    assert ws["max_abs"] == 0.0
    # The meta-device route with its layerwise parity: the Orbax parts read back bit for bit.
    _check_meta_route(result["meta_route"])
    assert result["meta_route"]["parity"] is True, result["meta_route"]["output"]
    # onnx-to-jax --mesh 2x4: the to_jax candidate placed by the default fsdp+tp rules.
    _check_cli_convert(result["cli_convert"]["jax"], "jax")


def test_cli_check_runs_the_candidate_on_the_mesh(default_run):
    r = default_run["cli_check"]
    assert r["exit_code"] == 0, r["output"]
    text = r["output"].replace("\n", " ")
    assert "mesh:2x4" in text and "candidate sharded over mesh data=2 x model=4" in text
    # The folder's module carries its table: the check places params by its own RULES.
    assert "module's own RULES (PARTITIONING='fsdp+tp')" in text


def _check_cli_convert(r: dict, target: str) -> None:
    assert r["exit_code"] == 0, r["output"]
    assert r["passed"] is True, r["notes"]
    # parity.json and the printed report state the mesh and each parameter's sharding.
    assert r["mesh"]["shape"] == {"data": 2, "model": 4}
    assert "mesh: data=2 x model=4;" in r["output"]
    assert "candidate sharded over mesh data=2 x model=4" in " ".join(r["notes"])
    params = r["mesh"]["params"]
    assert len(params) > 10
    split = [p for p, s in params.items() if "model" in s]
    assert len(split) >= 8, params
    if target == "flax":
        # The user's JSON table: mlp over model, vocab kept whole; restored onto the mesh.
        assert params["params/layers_0/ff1/kernel"] == "(None, 'model')"
        assert params["params/head/kernel"] == "(None, None)"
        assert "parameters keep the shardings they were placed with" in r["notes"]


def test_cli_conversion_checks_parity_on_the_mesh_with_a_rules_file(default_run):
    """``xconv onnx-to-flax --partitioning rules.json --mesh 2x4``: the conversion's own
    parity check restores the output onto the mesh by the user's table and passes there."""
    _check_cli_convert(default_run["cli_convert"]["flax"], "flax")


def _check_meta_route(r: dict) -> None:
    assert r["exit_code"] == 0, r["output"]
    assert r["partitioning"] == "fsdp"
    # One Orbax part per input shard (+ one of computed values, the rotary inv_freq): the
    # host never held more than one shard's variables.
    assert r["input_shards"] == 10 and r["parts"] == [f"part-{k:05d}" for k in range(1, 12)]
    assert "Orbax checkpoint in 11 parts" in r["output"]
    assert r["host_vs_torch"] < 1e-4
    # Layerwise parity with the candidate blocks sharded on the --mesh, stated in the report.
    assert r["parity"] is True, r["output"]
    assert "candidate blocks ran sharded on mesh data=2 x model=4" in r["output"]
    pm = r["parity_mesh"]
    assert pm["shape"] == {"data": 2, "model": 4}
    split = {n: s for n, s in pm["params"].items() if "'data', 'model'" in s}
    # fsdp: every projection and the embedding split over all 8 devices; norms whole.
    assert len(split) >= 40 and "model.embed_tokens.weight" in split, pm["params"]
    assert pm["params"]["model.norm.weight"] == "(None,)"
    for mesh, shape in (("2x4", {"data": 2, "model": 4}), ("1x8", {"data": 1, "model": 8})):
        m = r[mesh]
        assert m["mesh"] == shape
        assert m["vs_host"] < 1e-5  # sharding moves only the reduction order
        # fsdp: every kernel and the embedding split over all 8 devices; norms whole.
        assert m["embed_shards"] == 8 and m["split"] >= 40 and m["n"] > m["split"]


def test_meta_route_streams_into_orbax_parts_that_load_onto_any_mesh(default_run):
    """``torch-to-flax --module LlamaForCausalLM --config --weights 'model-*.safetensors'
    --partitioning fsdp --mesh 2x4``: written part by part, restored onto 2x4 and 1x8."""
    _check_meta_route(default_run["meta_route"])
