"""The ONNX backend conformance suite as tests.

Checks the corpus and the harness, then runs the full sweep of every backend against the
floor it must keep: roundtrip and torch in the default run (about a minute on two cores), jax
on every fourth case there (every case but the named misses must pass) and in full under
``-m slow``. ``python -m tests.conformance.run`` prints per-case results and regenerates
docs/coverage.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conformance import harness
from tests.conformance.backends import BACKENDS

#: Cases a full sweep may lose to machine noise (a case timing out on a loaded machine).
NOISE = 5
#: Passed cases measured by ``python -m tests.conformance.run`` (docs/coverage.md), less NOISE.
MEASURED = {"roundtrip": 1720, "jax": 2014, "torch": 2012}
FLOORS = {backend: n - NOISE for backend, n in MEASURED.items()}
COVERAGE = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"
SAMPLE_EVERY = 9


@pytest.fixture(scope="module")
def cases() -> list[harness.Case]:
    return harness.load_cases()


def _doc_passed(backend: str) -> int:
    """The passed count docs/coverage.md records for ``backend``."""
    row = re.search(rf"^\| {re.escape(backend)} \| (\d+) \|", COVERAGE.read_text(), re.M)
    assert row, f"docs/coverage.md has no row for {backend}"
    return int(row.group(1))


def test_floors_are_the_committed_coverage_table():
    """The floors follow the generated table: a sweep that passes more cases must be written
    to docs/coverage.md and raise the floor with it."""
    for backend, measured in MEASURED.items():
        assert measured == _doc_passed(backend), (
            f"{backend}: MEASURED says {measured}, docs/coverage.md {_doc_passed(backend)}"
        )


def _sample(cases):
    return cases[::SAMPLE_EVERY]


def test_corpus_is_complete(cases):
    kinds = {k: sum(c.kind == k for c in cases) for k in harness.KINDS}
    assert kinds["node"] >= 1884 and len(cases) >= 2024, kinds


def test_harness_refuses_a_short_corpus(monkeypatch):
    import onnx.backend.test.loader as loader

    real = loader.load_model_tests
    monkeypatch.setattr(loader, "load_model_tests", lambda kind: real(kind=kind)[:10])
    with pytest.raises(RuntimeError, match="short corpus"):
        harness.load_cases(["node"])


def test_harness_records_every_status(cases):
    by_name = {c.name: c for c in cases}

    def prepare(model):
        if model.graph.name == "test_abs":
            raise harness.SkipCase("declined")
        return lambda inputs: [i * 0 + 1 for i in inputs]

    picks = [by_name["test_abs"], by_name["test_relu"], by_name["test_add"]]
    report = harness.run_backend("fake", prepare, picks)
    statuses = {r.case: r.status for r in report.results}
    assert statuses["test_abs"] == "skip"
    assert statuses["test_relu"] == "fail"  # wrong numbers
    assert statuses["test_add"] == "fail"  # one output for two inputs, wrong numbers
    report = harness.run_backend("boom", lambda m: 1 / 0, picks[:1])
    assert report.results[0].status == "error" and "ZeroDivisionError" in report.results[0].message


def test_roundtrip_loses_nothing_on_a_sample(cases):
    sample = _sample(cases)
    ort = harness.run_backend("onnxruntime", BACKENDS["onnxruntime"](), sample).by_case()
    rt = harness.run_backend("roundtrip", BACKENDS["roundtrip"](), sample).by_case()
    lost = [
        f"{name}: {rt[name].message}"
        for name, r in ort.items()
        if r.status == "pass" and rt[name].status != "pass"
    ]
    assert not lost, lost
    assert sum(r.status == "pass" for r in rt.values()) >= 0.8 * len(sample)


#: The cases ``to_jax`` does not pass (docs/coverage.md's jax row): Bernoulli and
#: training-mode Dropout, whose random draws cannot match the reference's.
JAX_MISSES = frozenset(
    {
        *(f"test_bernoulli{s}" for s in ("", "_double", "_double_expanded", "_expanded")),
        *("test_bernoulli_seed", "test_bernoulli_seed_expanded"),
        *(f"test_training_dropout{s}" for s in ("", "_default", "_default_mask", "_mask")),
    }
)
#: Every n-th case for the default run's jax sweep (the full one, ~8 min on two cores, is
#: ``-m slow``).
JAX_SAMPLE_EVERY = 4


def test_jax_misses_are_the_committed_coverage_table(cases):
    assert len(JAX_MISSES) == len(cases) - MEASURED["jax"]
    assert not JAX_MISSES - {c.name for c in cases}


def _lost(report: harness.Report, misses: frozenset[str]) -> list[str]:
    """Cases outside ``misses`` that did not pass; up to NOISE timeouts are forgiven."""
    lost = [r for r in report.results if r.status != "pass" and r.case not in misses]
    timeouts = [r for r in lost if "timed out" in r.message]
    if len(timeouts) <= NOISE:
        lost = [r for r in lost if r not in timeouts]
    return [f"{r.case}: {r.status}: {r.message[:200]}" for r in lost]


def test_jax_sweep_on_a_sample_passes_every_case_but_the_known_misses(cases):
    pytest.importorskip("jax")
    report = harness.run_backend("jax", BACKENDS["jax"](), cases[::JAX_SAMPLE_EVERY])
    assert not _lost(report, JAX_MISSES), report.summary()


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=pytest.mark.slow) if b == "jax" else b for b in FLOORS]
)
def test_full_sweep_meets_floor(cases, backend):
    if backend in ("jax", "torch"):
        pytest.importorskip(backend)
    report = harness.run_backend(backend, BACKENDS[backend](), cases)
    print(report.summary())
    assert report.passed >= FLOORS[backend], report.summary()
    if backend == "jax":
        assert not _lost(report, JAX_MISSES), report.summary()
    # More passes than the committed table (beyond noise): the table and floor are stale.
    assert report.passed <= MEASURED[backend] + NOISE, (
        f"{report.summary()}; docs/coverage.md says {MEASURED[backend]}: regenerate it with "
        "`python -m tests.conformance.run --write-docs` and raise MEASURED"
    )


#: Every n-th case of the corpus for the default run of the differential check.
DIFFERENTIAL_EVERY = 250


def test_generated_source_agrees_with_the_runtime_on_a_sample(cases, tmp_path):
    """The generated Flax (linen, nnx) and torch source against to_jax / to_torch on a
    sample of the corpus (``python -m tests.conformance.differential`` runs every case and
    writes the counts into docs/coverage.md): no disagreement, no crash."""
    pytest.importorskip("torch")
    pytest.importorskip("flax")
    from tests.conformance import differential

    sample = cases[::DIFFERENTIAL_EVERY]
    outcomes = [o for case in sample for o in differential.run_case(case, tmp_path)]
    wrong = [f"{o.emitter} {o.case}: {o.status}: {o.message}" for o in outcomes
             if o.status in ("disagree", "crash")]  # fmt: skip
    assert not wrong, wrong
    agreed = {o.emitter for o in outcomes if o.status == "agree"}
    assert agreed == set(differential.EMITTERS), differential.counts(outcomes)


#: Cases whose generated source crashed or disagreed in the full sweep (each emitter now
#: agrees, or refuses by name): PRelu's opset < 7 per-channel slope, a runtime Reshape's 0
#: (copy, or with allowzero a size), Flatten at the last axis, pooling pads wider than torch's
#: padding argument, a graph-output MaxPool Indices, a sequence output; an integer base's Pow
#: with a float exponent (the emitters returned float, ONNX the base's type), values of
#: another head size than the queries' (jax.nn.dot_product_attention raised).
FIXED_CASES = (
    "test_PReLU_1d_multiparam", "test_PReLU_2d_multiparam", "test_reshape_zero_dim",
    "test_reshape_zero_and_negative_dim", "test_reshape_allowzero_reordered",
    "test_operator_view", "test_averagepool_2d_pads", "test_averagepool_2d_pads_count_include_pad",
    "test_maxpool_2d_pads", "test_maxpool_with_argmax_2d_precomputed_pads",
    "test_split_to_sequence_nokeepdims", "test_pow_types_int64_float32",
    "test_pow_types_int32_float32", "test_attention_4d_diff_heads_sizes_causal",
)  # fmt: skip


def test_generated_source_of_once_broken_cases(cases, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("flax")
    from tests.conformance import differential

    chosen = [c for c in cases if c.name in FIXED_CASES]
    assert {c.name for c in chosen} == set(FIXED_CASES)
    outcomes = [o for case in chosen for o in differential.run_case(case, tmp_path)]
    wrong = [f"{o.emitter} {o.case}: {o.status}: {o.message}" for o in outcomes
             if o.status in ("disagree", "crash")]  # fmt: skip
    assert not wrong, wrong
    agreed = {(o.case, o.emitter) for o in outcomes if o.status == "agree"}
    assert len(agreed) >= 39, differential.counts(outcomes)  # all but the 3 Indices refusals


#: Cases of ops both emitters write since the full sweep listed them as not emitted: the
#: losses (weights, ignore_index, reductions, log_prob, 4-D), BitShift (uint64 right,
#: signed shifts of the width or more, negative shifts), LayerNormalization's Mean and
#: InvStdDev outputs, Attention's key/value cache (past inputs, present outputs; 3-D, GQA,
#: causal aligned to the last query, float16) and, in the torch source, 3-D Attention;
#: ArgMax / ArgMin's select_last_index, ScatterElements (negative indices, reductions),
#: ScatterND, Hardmax, LpNormalization, RotaryEmbedding, Trilu's k computed at run time,
#: QuantizeLinear / DequantizeLinear of 8- and 16-bit integers (per axis, blocked), LpPool
#: (pads, auto_pad SAME), an inference Dropout node with its mask; the inverse hyperbolic
#: functions, Celu, Shrink, ThresholdedRelu, Swish, the bitwise ops (uint64 too), IsInf,
#: EyeLike (off the diagonal), Det, DepthToSpace / SpaceToDepth (both orders),
#: InstanceNormalization, LRN and MeanVarianceNormalization; axes, axis, depth, pads and
#: bounds the graph computes at run time (reductions, CumSum's exclusive / reverse, OneHot,
#: Pad, Slice with a negative step), read eagerly; GridSample (the Flax source's
#: _grid_sample, torch's F.grid_sample); Resize with scales or sizes computed at run time
#: (cubic, antialias, keep_aspect_ratio_policy; in the torch source a generated _resize where
#: F.interpolate computes another function: pytorch_half_pixel onto one element,
#: align_corners with a fractional size); DynamicQuantizeLinear,
#: MatMulInteger, QLinearMatMul, ConvInteger and QLinearConv; dilated MaxPool / AveragePool
#: (with ceil_mode and count_include_pad), pooling's auto_pad SAME_*; Attention's softcap,
#: qk_matmul output, nonpad_kv_seqlen, softmax_precision and sliding windows (the generated
#: _attention_steps); float8 casts and DequantizeLinear of float8; BitCast; the cosine
#: windows (a size computed at run time); CenterCropPad; AffineGrid; SwiGLU; Compress and
#: NonZero (shapes from values: read eagerly in Flax); ReduceProd over run-time axes; the
#: sub-byte integers (int4 ... : casts, QuantizeLinear / DequantizeLinear) and quantizing to
#: float8; DFT (its axis computed at run time, or opset 19's attribute), STFT and
#: MelWeightMatrix (sizes and inputs read at run time); LinearAttention (its recurrence) and
#: CausalConvWithState; If, Scan (opsets 8 and 9+) and Loop, their subgraphs nested functions;
#: FlexAttention, its score_mod / prob_mod subgraphs nested functions too; Unique and
#: NonMaxSuppression (numpy text applied eagerly);
#: RoiAlign, MaxRoiPool and DeformConv (generated _roi_align / _max_roi_pool / _deform_conv);
#: ConvTranspose grouped, sized by output_shape or auto_pad SAME_* (both sources); the
#: sequence and optional ops as Python lists and None;
#: TensorScatter (linear, circular), Col2Im and MaxUnpool (generated scatters).
EMITTED_CASES = (
    "test_nllloss_NCd1d2_with_weight_reduction_sum_ii", "test_nllloss_NCd1_mean_weight_negative_ii",
    "test_nllloss_NCd1d2d3d4d5_none_no_weight", "test_sce_mean_weight_ii_4d_log_prob",
    "test_sce_NCd1d2d3_none_no_weight_negative_ii", "test_sce_sum_log_prob", "test_sce_mean_3d",
    "test_bitshift_right_uint64", "test_bitshift_left_uint8",
    "test_bitshift_right_int8_shift_ge_width", "test_bitshift_left_int32_negative_shift",
    "test_layer_normalization_4d_axis_negative_3", "test_layer_normalization_2d_axis0",
    "test_attention_4d_with_past_and_present", "test_attention_3d_gqa_with_past_and_present",
    "test_attention_4d_causal_with_past_and_present", "test_attention_3d_causal",
    "test_attention_4d_diff_heads_with_past_and_present_mask4d",
    "test_attention_4d_gqa_with_past_and_present_fp16",
    "test_argmax_negative_axis_keepdims_random_select_last_index",
    "test_argmin_no_keepdims_example_select_last_index",
    "test_scatter_elements_with_negative_indices", "test_scatter_elements_with_reduction_max",
    "test_scatternd", "test_scatternd_add", "test_hardmax_axis_1", "test_hardmax_one_hot",
    "test_l1normalization_axis_0", "test_l2normalization_axis_1",
    "test_rotary_embedding_3d_input", "test_rotary_embedding_with_interleaved_rotary_dim",
    "test_rotary_embedding_no_position_ids", "test_tril_out_neg", "test_triu_square_neg",
    "test_quantizelinear_axis", "test_quantizelinear_blocked_asymmetric",
    "test_dequantizelinear_blocked", "test_dequantizelinear_int16", "test_lppool_2d_pads",
    "test_lppool_2d_same_lower", "test_lppool_3d_default", "test_dropout_default_mask",
    "test_acosh", "test_atanh", "test_celu", "test_shrink_hard", "test_shrink_soft",
    "test_thresholdedrelu", "test_swish", "test_bitwise_and_ui64_bcast_3v1d",
    "test_bitwise_xor_ui8_bcast_4v3d", "test_bitwise_not_3d", "test_isinf_negative",
    "test_eyelike_populate_off_main_diagonal", "test_eyelike_with_dtype", "test_det_nd",
    "test_depthtospace_example", "test_depthtospace_crd_mode_example",
    "test_spacetodepth_example", "test_spacetodepth_crd_mode_example",
    "test_instancenorm_epsilon", "test_lrn", "test_mvn",
    "test_reduce_sum_keepdims_random", "test_reduce_sum_empty_axes_input_noop_example",
    "test_cumsum_1d_reverse_exclusive", "test_cumsum_1d_int32_exclusive",
    "test_onehot_negative_indices", "test_onehot_out_of_range_indices",
    "test_onehot_with_negative_axis", "test_reflect_pad", "test_constant_pad_negative_axes",
    "test_slice_neg_steps", "test_slice_end_out_of_bounds",
    "test_gridsample_reflection_padding", "test_gridsample_bicubic_align_corners_1_additional_1",
    "test_gridsample_volumetric_nearest_align_corners_0",
    "test_resize_downsample_scales_linear", "test_resize_upsample_scales_cubic_align_corners",
    "test_resize_downsample_sizes_cubic", "test_resize_downsample_scales_cubic_antialias",
    "test_resize_upsample_sizes_nearest_not_larger", "test_resize_downsample_scales_linear_align_corners",
    "test_resize_downsample_sizes_linear_pytorch_half_pixel", "test_dynamicquantizelinear_min_adjusted",
    "test_matmulinteger", "test_qlinearmatmul_3D_int8_float16", "test_convinteger_with_padding",
    "test_qlinearconv", "test_averagepool_2d_dilations",
    "test_averagepool_3d_dilations_large_count_include_pad_is_1_ceil_mode_is_True",
    "test_averagepool_3d_dilations_large_count_include_pad_is_0_ceil_mode_is_True",
    "test_averagepool_2d_same_lower", "test_maxpool_2d_same_upper", "test_maxpool_3d_dilations",
    "test_attention_4d_softcap_neginf_mask", "test_attention_3d_gqa_softcap",
    "test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask_causal",
    "test_attention_3d_with_past_and_present_qk_matmul_softmax",
    "test_attention_4d_gqa_causal_nonpad_decode", "test_attention_4d_causal_nonpad_continued_prefill",
    "test_attention_24_qk_matmul_output_mode3_softmax_precision",
    "test_attention_23_fullymasked_qk_matmul_output_mode3_zero",
    "test_attention_local_window_with_past", "test_attention_bidirectional_window",
    "test_attention_3d_local_window", "test_cast_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_FLOAT8E5M2FNUZ_to_FLOAT16", "test_dequantizelinear_e4m3fn_zero_point",
    "test_dequantizelinear_e5m2", "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN",
    "test_bitcast_uint32_to_int32", "test_bitcast_2d_float32_to_int32", "test_bitcast_bool_to_uint8",
    "test_hannwindow", "test_hammingwindow_symmetric", "test_blackmanwindow",
    "test_center_crop_pad_crop_and_pad", "test_center_crop_pad_crop_negative_axes_hwc",
    "test_affine_grid_2d_align_corners", "test_affine_grid_3d", "test_swiglu_alpha",
    "test_compress_default_axis", "test_compress_negative_axis", "test_nonzero_example",
    "test_reduce_prod_negative_axes_keepdims_random", "test_reduce_prod_empty_set",
    "test_cast_FLOAT_to_INT4", "test_cast_INT4_to_FLOAT", "test_cast_FLOAT16_to_UINT2",
    "test_castlike_UINT4_to_FLOAT16", "test_quantizelinear_int4", "test_quantizelinear_uint2",
    "test_dequantizelinear_uint4", "test_dequantizelinear_int2", "test_quantizelinear_e4m3fn",
    "test_quantizelinear_e5m2",
    "test_dft_rfft", "test_dft_axis_opset19", "test_stft_with_window", "test_melweightmatrix",
    "test_linear_attention_gated_delta_gqa", "test_causal_conv_with_state_silu_with_past_state",
    "test_if", "test_scan_sum", "test_scan9_multi_state", "test_loop11",
    "test_flexattention_gqa", "test_flexattention_causal_mask", "test_flexattention_prob_mod",
    "test_unique_not_sorted_without_axis", "test_nonmaxsuppression_center_point_box_format",
    "test_roialign_aligned_false", "test_roialign_mode_max", "test_deform_conv_with_mask_bias",
    "test_deform_conv_with_multiple_offset_groups",
    "test_convtranspose_group_2", "test_convtranspose_output_shape", "test_convtranspose_autopad_same",
    "test_sequence_model5", "test_sequence_model7", "test_optional_get_element_optional_tensor",
    "test_tensorscatter_circular", "test_col2im_pads", "test_maxunpool_export_with_output_shape",
    "test_maxpool_with_argmax_2d_precomputed_pads", "test_maxpool_with_argmax_2d_precomputed_strides",
    "test_conv_with_autopad_same", "test_reduce_max_empty_set", "test_scatternd_max", "test_scatternd_min",
    "test_scatternd_multiply", "test_scatternd_max_with_element_indices",
    "test_scatternd_min_with_element_indices", "test_reduce_max_empty_set_bool",
    "test_reduce_min_empty_set",
    "test_string_concat_broadcasting", "test_string_split_maxsplit", "test_string_split_no_delimiter",
    "test_regex_full_match_email_domain", "test_strnormalizer_export_monday_casesensintive_upper",
    "test_strnormalizer_export_monday_empty_output",
    "test_cast_FLOAT_to_FLOAT4E2M1", "test_cast_FLOAT4E2M1_to_FLOAT16", "test_quantizelinear_float4e2m1",
    "test_dequantizelinear_float4e2m1", "test_castlike_FLOAT16_to_FLOAT4E2M1_expanded",
    "test_cast_e8m0_FLOAT_to_FLOAT8E8M0", "test_cast_e8m0_FLOAT16_to_FLOAT8E8M0",
    "test_ai_onnx_ml_array_feature_extractor", "test_ai_onnx_ml_binarizer",
    "test_ai_onnx_ml_label_encoder_string_int", "test_ai_onnx_ml_label_encoder_tensor_mapping",
    "test_ai_onnx_ml_tree_ensemble_set_membership", "test_tfidfvectorizer_tf_batch_uniandbigrams_skip5",
)  # fmt: skip


def test_generated_source_of_newly_emitted_ops(cases, tmp_path):
    """Each case of EMITTED_CASES agrees with its runtime in every emitter (Flax linen and
    nnx, torch source)."""
    pytest.importorskip("torch")
    pytest.importorskip("flax")
    from tests.conformance import differential

    chosen = [c for c in cases if c.name in EMITTED_CASES]
    assert {c.name for c in chosen} == set(EMITTED_CASES)
    outcomes = [o for case in chosen for o in differential.run_case(case, tmp_path)]
    compared = {(o.case, o.emitter) for o in outcomes}
    assert {(c, e) for c in EMITTED_CASES for e in differential.EMITTERS} <= compared
    wrong = [
        f"{o.emitter} {o.case}: {o.status}: {o.message}" for o in outcomes if o.status != "agree"
    ]
    assert not wrong, wrong


@pytest.mark.slow
def test_generated_source_agrees_with_the_runtime_on_every_case(cases):
    from tests.conformance import differential

    outcomes = differential.sweep(cases)
    print(differential.render(outcomes, len(cases)))
    wrong = [o for o in outcomes if o.status == "disagree"]
    assert not wrong, [f"{o.emitter} {o.case}: {o.message}" for o in wrong]


def test_write_coverage_keeps_the_differential_section(tmp_path):
    doc = tmp_path / "coverage.md"
    section = "## Generated source against the runtime\n\n<!-- block -->\n3 cases\n"
    doc.write_text("# old tables\n\n" + section)
    report = harness.Report("jax", [harness.Result("test_add", "node", "pass", op_types=("Add",))])
    harness.write_coverage([report], doc)
    text = doc.read_text()
    assert "# old tables" not in text and "| Add | 1/1 |" in text
    assert text.endswith("\n\n" + section)
    harness.write_coverage([report], tmp_path / "fresh.md")  # no section to keep
    assert "Generated source" not in (tmp_path / "fresh.md").read_text()
