"""The zoo's keras.applications rows (``benchmarks/zoo.py``).

* The zoo lists every model ``keras.applications`` offers (default suite): a model added by a
  Keras release shows up here until the zoo takes it.
* One model per keras.applications family through the zoo's own row (``keras_row``: batch 1 at
  the smallest size it takes, to JAX, Flax and torch against Keras) under ``slow``: each is
  1-4 min on two shared cores. The default suite's fast checks of the same layer patterns
  (captured constants, grouped convs on small maps, squeeze-and-excite) are in
  ``tests/converters/tf/test_keras_applications.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
pytest.importorskip("torch")
pytest.importorskip("flax")

from benchmarks import zoo  # noqa: E402

#: One model per family (the smallest of each).
FAMILY_SAMPLE = (
    "ConvNeXtTiny", "DenseNet121", "EfficientNetB0", "EfficientNetV2B0", "InceptionResNetV2",
    "InceptionV3", "MobileNet", "MobileNetV2", "MobileNetV3Small", "NASNetMobile", "ResNet50",
    "ResNet50V2", "VGG16", "Xception",
)  # fmt: skip


def test_zoo_lists_every_keras_application():
    offered = {n for n in dir(keras.applications) if n[:1].isupper()}
    offered = {n for n in offered if callable(getattr(keras.applications, n))}
    assert set(zoo.KERAS_APPS) == offered
    assert set(FAMILY_SAMPLE) <= set(zoo.KERAS_APPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SAMPLE)
def test_keras_family_sample(name, tmp_path):
    cells, _ = zoo.keras_row(name, tmp_path)
    for direction, cell in zip(zoo.KERAS_DIRECTIONS, cells, strict=True):
        assert cell.verdict == "pass", (direction, cell)


def test_keras_row_past_its_time_reads_not_run():
    """A row past ``--keras-timeout`` reads "not run" with the reason (this machine's limit),
    not an error of the converters; its rows are still handed to ``on_row`` to be stored."""
    seen = []
    out = zoo.keras_rows(["MobileNet"], None, seen.append, timeout=0.5)
    assert seen == out
    ((name, cells, _),) = out
    assert name == "MobileNet"
    assert [c.verdict for c in cells] == ["not run"] * len(zoo.KERAS_DIRECTIONS)
    assert "over 0.5 s on this machine" in cells[0].cause


def test_peer_column_is_beside_ours_and_not_counted_as_ours():
    """With ``--peers`` a row carries one more cell, the peer's: the table shows it in a column
    of its own ("-" on a row run without the peer), its failures are listed apart, and it does
    not change how many models pass in xconv's directions."""
    ok, bad = zoo.Cell("pass", 1e-6, 1.0), zoo.Cell("error", None, 1.0, "NotImplementedError: Gelu")
    rows_ = [
        ("A", zoo.KERAS_KIND, [ok, ok, ok, bad], 1.0),
        ("B", zoo.KERAS_KIND, [ok, ok, ok], 1.0),
        ("C", zoo.KERAS_KIND, [ok, ok, zoo.Cell("error", None, 1.0, "TypeError: t"), ok], 1.0),
    ]
    text = zoo.render(rows_)
    assert "2 of 3 models pass in every direction." in text
    assert "passes 1 of the 2 rows it ran on" in text
    head = next(ln for ln in text.splitlines() if ln.startswith("| keras.applications model"))
    assert head.endswith(f"| {zoo.PEER_TITLES[zoo.KERAS_KIND]} | import s |")
    row_b = next(ln for ln in text.splitlines() if ln.startswith("| B |"))
    assert row_b.count("|") == head.count("|") and "| - |" in row_b
    ours, _, peers = text.partition("Peer failures by cause")
    assert "- 1: `NotImplementedError: Gelu` (A)" in peers
    assert "- 1: `TypeError: t` (C)" in ours
    assert "Gelu" not in ours


def test_causes_group_without_addresses_or_arguments():
    """One missing function of a peer blocks many rows: the group is the function, not each
    row's object addresses."""
    ok = zoo.Cell("pass", 1e-6, 1.0)

    def unhandled(addr):
        cause = (
            f"NotImplementedError: Unhandled function call: torch.gather(*(<t.T object at {addr}>,"
        )
        return zoo.Cell("error", None, 0.0, cause)

    rows_ = [(n, "transformers", [ok, ok, ok, unhandled(a)], 1.0)
             for n, a in (("x", "0x7fad6518d350"), ("y", "0x7fad664a9590"))]  # fmt: skip
    text = zoo.render(rows_)
    assert "- 2: `NotImplementedError: Unhandled function call: torch.gather` (x, y)" in text


def _logits(rng, n=1000):
    return rng.standard_normal((1, n)) * 3.0


def test_keras_cells_are_judged_by_the_oracle_policy_not_a_fixed_tolerance():
    """A keras row is judged as the parity checker judges: against a float64 run, within k=4
    times the float32 reference's own error. A deep net whose float32 reference is itself
    ~1e-4 off (ResNet152) passes at 1.5e-4; a candidate 10 times worse than the reference
    fails, as does one off by a few float32 ulps where the reference is exact to them."""
    rng = np.random.default_rng(0)
    oracle = _logits(rng)
    scale = float(np.abs(oracle).max())
    noise = rng.standard_normal(oracle.shape)
    ref = (oracle + 1e-4 * scale * noise / np.abs(noise).max()).astype(np.float32)
    ok = (oracle + 1.5e-4 * scale * np.sign(noise) * (np.abs(noise) > 2)).astype(np.float32)
    verdict, err, cause, ref_err = zoo._compare([ok], [ref], [oracle])
    assert verdict == "pass", cause
    assert 1e-4 < err < 2e-4 and abs(ref_err - 1e-4) < 1e-5
    bad = (oracle + 10 * (ref.astype(np.float64) - oracle)).astype(np.float32)
    verdict, bad_err, cause, _ = zoo._compare([bad], [ref], [oracle])
    assert verdict == "FAIL" and "oracle" in cause and bad_err > 5e-4
    exact = oracle.astype(np.float32)
    off = exact + np.float32(3e-5 * scale) * (noise > 0)
    assert zoo._compare([exact], [exact], [oracle])[0] == "pass"
    assert zoo._compare([off], [exact], [oracle])[0] == "FAIL"
    cell = zoo.Cell(*zoo._compare([ok], [ref], [oracle])[:2], 1.0, None, ref_err)
    assert cell.text() == f"pass, {err:.1e} (ref {ref_err:.1e}), 1 s"


def test_float64_twin_runs_the_same_weights_in_float64():
    """The oracle of a keras row: the same architecture under the float64 dtype policy with
    the float32 model's weights (batch norm statistics included) gives float64 outputs close
    to the float32 model's, and the global dtype policy is restored."""

    def build():
        return keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(4, 3),
                keras.layers.BatchNormalization(),
                keras.layers.DepthwiseConv2D(3, depth_multiplier=2),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(5),
            ]
        )

    keras.utils.set_random_seed(0)
    net = build()
    bn = net.layers[1]
    bn.moving_mean.assign(np.linspace(-1, 1, 4))
    bn.moving_variance.assign(np.linspace(0.5, 2, 4))
    x = np.random.RandomState(0).rand(1, 8, 8, 3).astype(np.float32)
    (out,) = zoo.float64_twin(build, net, (x,))
    want = np.asarray(net(x, training=False))
    assert out.dtype == np.float64 and out.shape == want.shape
    assert np.abs(out - want).max() <= 1e-5 * np.abs(out).max()
    assert keras.config.dtype_policy().name == "float32" and keras.config.floatx() == "float32"


def test_rows_that_did_not_run_are_counted_apart_from_failures():
    """A row none of whose directions ran (the reference's own library code does not run,
    the row ran out of time or memory) is listed with its reason, not counted as a model
    that passes or as a failure of the converters; a failure still counts."""
    ok = zoo.Cell("pass", 1e-6, 1.0)
    idle = zoo.Cell("not run", None, None, "reference: transformers 4.46.3 on jax 0.10: x")
    bad = zoo.Cell("FAIL", 1e-2, 1.0, "output 0: 3 elements over the bound")
    rows_ = [
        ("A", zoo.KERAS_KIND, [ok, ok, ok], 1.0),
        ("B", zoo.KERAS_KIND, [idle, idle, idle], 0.0),
        ("C", zoo.KERAS_KIND, [ok, bad, ok], 1.0),
    ]
    text = zoo.render(rows_)
    assert "1 of 2 models pass in every direction. Not run, not counted: 1" in text
    fails, _, idle_part = text.partition("Not run, by reason (models):")
    assert "- 1: `output 0: 3 elements over the bound` (C)" in fails
    assert "- 1: `reference: transformers 4.46.3 on jax 0.10: x` (B)" in idle_part
    assert "(B)" not in fails
