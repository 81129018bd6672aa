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


def test_keras_row_past_its_time_reads_not_run(monkeypatch):
    """A row past ``--keras-timeout`` reads "not run" with the reason (this machine's limit),
    not an error of the converters; its rows are still handed to ``on_row`` to be stored."""
    seen = []
    out = zoo.keras_rows(["MobileNet"], None, seen.append, timeout=0.5)
    assert seen == out
    ((name, cells, _),) = out
    assert name == "MobileNet"
    assert [c.verdict for c in cells] == ["not run"] * len(zoo.KERAS_DIRECTIONS)
    assert "over 0.5 s on this machine" in cells[0].cause
