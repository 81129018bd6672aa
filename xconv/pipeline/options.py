"""The conversion pipeline's options and results: what ``convert`` takes and gives back.

:class:`ConvertOptions` is frozen and validated on construction, so a bad option fails before
any work. :mod:`xconv.pipeline` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from xconv.errors import ConversionError

SOURCES = ("torch", "onnx", "flax", "jax", "tf")
TARGETS = ("flax", "jax", "onnx", "torch")
APIS = ("linen", "nnx")
PARITY_MODES = ("auto", "whole", "layerwise")
#: Float weight bytes above which ``parity="auto"`` checks a torch model block by block: a
#: whole-model float64 oracle would hold twice these bytes again.
LAYERWISE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ConvertOptions:
    """Everything a conversion can be told; passed down the call chain, never global.

    Attributes:
        api: Flax API of the generated module: ``"linen"`` or ``"nnx"``.
        check: Run the parity check against the source model.
        policy: Parity policy (``"oracle"``, ``"dtype"``).
        devices: Devices the parity check runs the candidate on (``"all"``, ``"cpu"``).
        dynamic_batch: Require a symbolic batch dimension (dim 0 of every input, one ``batch``
            symbol): a torch model that fixes it is refused.
        static: Torch sources: trace at the example shapes. By default every input dimension
            is symbolic unless the model fixes it (``xconv.fixed_dims`` lists those).
        module_factory: ``"pkg.mod:factory"`` building the module a state_dict loads into.
        trust_pickle: Allow unpickling a full torch module (runs code from the file).
        trust_code: Allow a ``save_pretrained`` folder whose ``config.json`` names model code
            inside the folder (``auto_map``): loading it runs that code.
        input_shapes: Example input shapes (``"2,3,224,224"``, optionally ``":int64"``).
        input_dtypes: Their dtypes (one for all, or one each).
        inputs_npz: Example inputs from an ``.npz`` file instead.
        parity_random_inputs: Random input sets the parity check draws within the example
            inputs' range (besides the example and edge inputs).
        parity: How the float64 oracle runs: ``"whole"`` (one float64 copy of the model),
            ``"layerwise"`` (one block at a time, per-block report; torch ``.pt2`` /
            ``nn.Module`` sources) or ``"auto"`` (layerwise once the model's float weights
            pass :data:`LAYERWISE_BYTES`, so the float64 copy stays within memory bounds).
        partitioning: Target ``flax``: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` or a rule table;
            written into ``model.py`` with each variable's logical axes (:mod:`xconv.sharding`).
        weights_format: Target ``flax``: ``"msgpack"`` (default) or ``"orbax"`` (implied by
            ``partitioning``), which the generated ``load(out_dir, mesh=)`` restores sharded.
        dtype: Targets ``flax`` / ``jax``: compute dtype, ``"float32"`` (default) or
            ``"bfloat16"`` (float32 params, bfloat16 matmuls / convolutions / attention, norms
            and softmax in float32; :mod:`xconv.converters.ops.precision`). A bfloat16 model
            is checked with :func:`xconv.parity.policies.bf16_policy`, its bound in the report.
        mesh: Targets ``flax`` and ``jax``: the parity check runs the candidate sharded over
            this ``"DATAxMODEL"`` mesh of the visible devices (the flax output restored onto
            it by its ``load(out_dir, mesh=)``; parameters placed by ``partitioning``, default
            ``"fsdp+tp"``); the report states the mesh and each parameter's sharding.
        generate: Torch causal LMs, target ``flax`` or ``jax``: convert the model as one
            cached decoding step (``from_torch(generate=True)``); model.py gains ``init_cache``, ``decode``
            and ``generate``, and parity.json a ``generation`` section (greedy tokens and
            each cached step's logits against torch).
        precision: The parity check's matmul precision: ``"default"`` (each device's own,
            judged at the precision its dots ran at) or ``"highest"`` (full float32 dots,
            judged at float32); see :func:`xconv.check_parity`.
    """

    api: str = "linen"
    check: bool = True
    policy: str = "oracle"
    devices: str = "all"
    dynamic_batch: bool = False
    static: bool = False
    module_factory: str | None = None
    trust_pickle: bool = False
    trust_code: bool = False
    input_shapes: tuple[str, ...] = ()
    input_dtypes: tuple[str, ...] = ("float32",)
    inputs_npz: str | None = None
    parity_random_inputs: int = 2
    parity: str = "auto"
    partitioning: Any = None
    weights_format: str | None = None
    dtype: str | None = None
    mesh: Any = None
    precision: str = "default"
    generate: bool = False

    def __post_init__(self) -> None:
        from xconv.converters.ops.precision import resolve_dtype

        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if self.parity not in PARITY_MODES:
            raise ConversionError(
                f"unknown parity mode {self.parity!r}; choose one of {list(PARITY_MODES)}"
            )
        if self.api not in APIS:
            raise ConversionError(f"unknown Flax api {self.api!r}; choose one of {list(APIS)}")


@dataclass
class ConversionResult:
    """What a conversion wrote, and its parity report (None with ``check=False``)."""

    out_dir: Path
    model: ir.Model
    files: list[Path] = field(default_factory=list)
    parity: Any = None
    #: Wall seconds per stage (``load``, ``import``, ``emit``, ``model.onnx``, ``parity``).
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.parity is None or bool(self.parity.passed)


@dataclass
class _Imported:
    model: ir.Model
    reference: Any  # what the parity check runs as ground truth
    inputs: Sequence[Any] | None
    description: str
    timings: dict[str, float] = field(default_factory=dict)
    #: The torch ``ExportedProgram`` the IR came from (a ``.pt2`` or an ``nn.Module``
    #: exported), which the layerwise parity check cuts into blocks.
    program: Any = None
    #: The model as loaded (a torch causal LM with ``generate``: the generation check runs
    #: its ``generate`` and full forward; the reference is then its cached step).
    source: Any = None


Progress = Callable[[str], None]
