"""The conversion pipeline's checks: parity against the source, and the generated source
against the IR's runtime (the differential check).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.ops.precision import resolve_dtype
from xconv.errors import ConversionError
from xconv.pipeline.options import LAYERWISE_BYTES, ConvertOptions, Progress, _Imported
from xconv.pipeline.source import (
    _as_input_tuple,
    _differential,
    bf16_differential_bound,
    jax_float64,
    torch_float64,
)

logger = logging.getLogger(__name__)


def _check(
    imported: _Imported,
    load_candidate: Callable[[], Any],
    options: ConvertOptions,
    say: Progress,
    ir_file: Path | None = None,
):
    """The parity check. With a layerwise oracle and ``ir_file`` (the IR written with its
    weights in ``model.onnx.data``), the reference is run ahead on every input set and then
    released, and the IR's weights are re-pointed at that file, before the candidate loads:
    the source's and the candidate's weights are never in memory together."""
    from xconv.parity.checker import check_parity
    from xconv.parity.policies import resolve_policy

    policy: Any = options.policy
    if options.dtype:
        from xconv.converters.ops.precision import rounding_depth
        from xconv.parity.policies import bf16_policy

        policy = bf16_policy(rounding_depth(imported.model), options.policy)
    layerwise: Any = False
    failed = None
    shapes = _shape_sets(imported, options)
    n_random = options.parity_random_inputs
    if options.generate:
        # The cached step's cache_position must hold distinct slots in order: random or
        # resized draws of it are no input the step takes. Its other sizes and the decode
        # steps are checked by the generation section against torch's full forward.
        from xconv.parity.shapes import ShapeSets

        shapes, n_random = ShapeSets(), 0
    if _layerwise(imported, options):
        # The block-by-block oracle runs before the candidate is loaded, so the two never
        # hold memory at the same time.
        from xconv.parity.adapters import to_numpy
        from xconv.parity.checker import input_sets
        from xconv.parity.layerwise import run_layerwise_sets
        from xconv.parity.precision import blocks_policy, jax_context

        arrays = [to_numpy(x) for x in imported.inputs]
        sets = input_sets(arrays, n_random=n_random)
        # A set at another shape the source rejects is dropped (with a note) before the
        # blocks run: it is no verdict on the conversion, and would stop every block.
        shapes, ran = _admissible_shapes(imported.reference, shapes)
        sets += shapes.sets
        names = ", ".join(name for name, _ in sets)
        try:
            # Every input set through each block at once: its weights are cast once.
            with jax_context(options.precision):
                block_policy = blocks_policy(resolve_policy(policy), imported.model)
                layerwise = run_layerwise_sets(
                    imported.program,
                    imported.model,
                    sets,
                    policy=block_policy,
                    progress=lambda msg: say(f"parity (float64 oracle, inputs {names}), {msg}"),
                )
        except Exception as e:  # a program the block splitter cannot cut: check it whole
            logger.debug("layerwise parity failed", exc_info=True)
            failed = f"layerwise parity could not run ({type(e).__name__}: {e}); checked whole"
        else:
            # A block that cannot run (its float64 twin or the candidate's cut fails) is no
            # verdict on the conversion: the whole model is checked instead, and says so.
            stuck = next((r.unrunnable for r in layerwise.values() if r.unrunnable), None)
            if stuck is not None:
                failed = (
                    f"layerwise parity could not run block {stuck.block.name} ({stuck.error}); "
                    "checked whole"
                )
                layerwise = False
        if failed is None and ir_file is not None:
            from xconv.parity.layerwise import recorded_reference

            say("parity (the source model on every input set)")
            imported.reference = recorded_reference(imported.reference, sets, ran)
            imported.program = None
            _weights_from_file(imported.model, ir_file)
        _release_memory()
    say("parity (the candidate against the source model)")
    report = check_parity(
        imported.reference,
        load_candidate(),
        imported.inputs,
        policy=policy,
        devices=options.devices,
        n_random=n_random,
        layerwise=layerwise,
        precision=options.precision,
        shapes=shapes,
        **({"mesh": options.mesh, "rules": options.partitioning} if options.mesh else {}),
    )
    if failed:
        report.notes.append(failed)
        report.downgrades.insert(0, {"kind": "checked_whole", "message": failed})
    return report


def _shape_sets(imported: _Imported, options: ConvertOptions):
    """The input sets at other shapes the check adds: the IR's symbolic input dims, within
    the limits of the torch program it came from (its ``range_constraints``, matched to the
    IR's inputs by position); none for a static model or without example inputs."""
    from xconv.parity.shapes import ShapeSets, from_model, shape_sets

    if imported.inputs is None or not isinstance(imported.inputs, list | tuple):
        return ShapeSets()
    from xconv.parity.adapters import to_numpy

    arrays = [to_numpy(x) for x in imported.inputs]
    return shape_sets(arrays, from_model(imported.model, imported.program))


def _admissible_shapes(reference: Any, shapes):
    """``shapes`` less the sets the reference cannot run (each dropped with a note), and the
    reference's outputs on those it ran, by input key (for ``recorded_reference``)."""
    from xconv.parity.adapters import wrap
    from xconv.parity.layerwise import _key
    from xconv.parity.shapes import ShapeSets, inadmissible_note

    if not shapes.sets:
        return shapes, {}
    ref = wrap(reference)
    dev = ref.devices()[0]
    ref.prepare(dev)
    kept, notes, ran = [], list(shapes.notes), {}
    for name, xs in shapes.sets:
        try:
            ran[_key(xs)] = ref.run(xs, dev)
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001 (the source rejects the shape: dropped)
            notes.append(inadmissible_note(name, xs, e))
            continue
        kept.append((name, xs))
    return ShapeSets(kept, notes), ran


def _differential_check(
    imported: _Imported,
    target: str,
    load_candidate: Callable[[], Any],
    options: ConvertOptions,
    say: Progress,
    big: bool,
) -> str | None:
    """The generated source against the IR's runtime (``to_jax`` for Flax, ``to_torch`` for
    torch) on the example inputs, as ``xconv.to_flax`` / ``xconv.to_torch_source`` check it.

    Raises ParityError on a disagreement (an emitter bug, named before the parity check
    blames the conversion); returns a note for the parity report when it could not run.
    """
    if imported.inputs is None:
        return "generated source not checked against the IR runtime: no example inputs"
    if big or _layerwise(imported, options):
        return (
            "generated source not checked against the IR runtime: the model's weights would "
            "be held a third time (the parity check still compares it with the source)"
        )
    say(f"checking the generated {target} source against the IR runtime")
    from xconv.errors import ParityError

    try:
        _run_differential(imported, target, load_candidate, options)
    except ParityError:
        raise
    except Exception as e:  # noqa: BLE001 (inputs the runtime cannot take: the parity check runs)
        return f"generated source not checked against the IR runtime ({type(e).__name__}: {e})"
    return None


def _run_differential(
    imported: _Imported, target: str, load_candidate: Callable[[], Any], options: ConvertOptions
) -> None:
    inputs = _as_input_tuple(imported.inputs)
    candidate = load_candidate()
    if target == "flax":
        from xconv.converters.jax.interpreter import to_jax

        if options.api == "linen":
            module, variables = candidate
            got = module.apply(variables, *inputs)
        else:
            got = candidate(*inputs)
        # The generated Flax computes in options.dtype: judged against to_jax at that dtype
        # within the bfloat16 bound, as to_flax(dtype=, example_inputs=) judges it.
        low = resolve_dtype(options.dtype)
        fn, params = to_jax(imported.model) if low is None else to_jax(imported.model, dtype=low)
        want = fn(params, *inputs)
        what, runtime = f"generated Flax ({options.api}{', bfloat16' if low else ''})", "to_jax"
        bound = None if low is None else bf16_differential_bound(imported.model)
        oracle = lambda: jax_float64(imported.model, inputs)  # noqa: E731
    else:
        import torch

        from xconv.converters.torch.emitter import to_torch

        runtime_module, _ = to_torch(imported.model)
        targs = tuple(torch.as_tensor(np.asarray(x)) for x in inputs)
        with torch.no_grad():
            got, want = candidate(*targs), runtime_module(*targs)
        what, runtime, bound = "generated torch source", "to_torch", None
        oracle = lambda: torch_float64(imported.model, inputs)  # noqa: E731
    del candidate
    _differential(imported.model, what, runtime, got, want, bound, oracle=oracle)


def _weights_from_file(model: ir.Model, path: Path) -> None:
    """Point the IR's initializers at the external data just written beside ``path``
    (memory-mapped when read), dropping the in-memory tensors they were (torch storage)."""
    written = ir.load(path)
    for name, value in model.graph.initializers.items():
        saved = written.graph.initializers.get(name)
        tensor = saved.const_value if saved is not None else None
        if isinstance(tensor, ir.ExternalTensor):
            value.const_value = tensor


def _release_memory() -> None:
    """Give the float64 blocks' freed memory back to the OS before the candidate is loaded.

    glibc keeps freed heap chunks (torch's and numpy's buffers below its mmap threshold) in
    the process, so the next allocations would land on top of them in the peak RSS.
    """
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _layerwise(imported: _Imported, options: ConvertOptions) -> bool:
    """Whether to run the float64 oracle block by block (see ``ConvertOptions.parity``)."""
    if options.parity == "whole":
        return False
    program = imported.program
    if program is None or not isinstance(imported.inputs, list | tuple):
        if options.parity == "layerwise":
            raise ConversionError(
                "--parity layerwise needs a torch source (a .pt2 or an nn.Module); "
                f"{imported.description} is checked whole (--parity whole)"
            )
        return False
    if options.parity == "layerwise":
        return True
    total = 0
    for t in (*program.state_dict.values(), *program.constants.values()):
        if hasattr(t, "is_floating_point") and t.is_floating_point():
            total += t.numel() * t.element_size()
    return total > LAYERWISE_BYTES
