"""Read PyTorch model files and example inputs, never executing untrusted code by default.

Supported model files (:func:`load_torch_model`), and what each records of its inputs:

* ``.pt2``: a ``torch.export`` archive (``torch.export.load``); carries its example inputs.
* TorchScript archives (``torch.jit.save``), any suffix: detected by their ``code/`` entries;
  only with ``trust_pickle=True``: ``torch.jit.load`` runs the TorchScript code and pickle data
  the archive holds (PyTorch's own warning: only load archives you trust). A traced archive
  records the shapes and dtypes of its example inputs (``traced_inputs.pkl``); a scripted one
  records none.
* state_dicts: ``.pt`` / ``.pth`` / ``.bin`` read with ``torch.load(weights_only=True)``,
  ``.safetensors`` with safetensors; a ``module_factory`` (``"pkg.mod:factory"``) builds the
  module the weights are loaded into (and may return its example inputs).
* a fully pickled ``nn.Module`` (``torch.save(module)``), only with ``trust_pickle=True``:
  unpickling runs arbitrary code from the file.

A module (pickled or built by the factory) with an ``example_input_array`` attribute (the
Lightning convention) gives its example inputs. Otherwise they come from shape specs
(``"2,3,224,224"`` plus a dtype, or ``"2,16:int64"``) or from an ``.npz`` file
(:func:`example_inputs`). A file that needs a flag the call lacks raises one
:class:`~xconv.errors.UsageError` naming every missing flag (``--trust-pickle``, ``--module``,
``--input-shape``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xconv.converters.torch.importer.shapes import quiet_logger as _quiet
from xconv.errors import ConversionError, InvalidModelError, UsageError, WeightsError
from xconv.factories import Factory, resolve_factory
from xconv.inputs import SEED as SPEC_SEED
from xconv.inputs import parse_spec, parse_specs

#: Suffixes read as a state_dict by ``torch.load(weights_only=True)``.
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

#: The flags a file may need, each with why (``UsageError.missing`` entries).
TRUST_FLAG = "--trust-pickle"
MODULE_FLAG = "--module"
INPUTS_FLAG = "--input-shape"
INPUTS_WHY = (
    "the file records no example inputs: give each input's shape, e.g. --input-shape "
    "1,3,224,224 (repeat for each input; 2,16:int64 for token ids), or --inputs FILE.npz"
)
#: The attribute a module names its example inputs with (PyTorch Lightning's convention).
EXAMPLE_ATTR = "example_input_array"


def load_torch_model(
    path: str | os.PathLike,
    *,
    module_factory: Factory | None = None,
    trust_pickle: bool = False,
    need_inputs: bool = False,
) -> tuple[nn.Module | torch.export.ExportedProgram | torch.jit.ScriptModule, tuple | None]:
    """Load a PyTorch model file.

    Args:
        path: A ``.pt2``, TorchScript, state_dict (``.pt``/``.pth``/``.bin``/
            ``.safetensors``) or pickled-module file.
        module_factory: For state_dict files: ``"pkg.mod:factory"`` or a callable returning
            the ``nn.Module`` (or ``(module, example_inputs)``) to load the weights into.
        trust_pickle: Allow unpickling a full module or loading a TorchScript archive (both
            run code from the file).
        need_inputs: The caller has no example inputs: a refusal for a missing flag also
            names ``--input-shape`` when the file records none, so one message lists all.

    Returns:
        ``(module_or_exported_program, example_inputs_or_None)``; the module is in eval mode.
        The inputs are the ``.pt2``'s, random tensors of a traced TorchScript archive's
        recorded shapes and dtypes, the module's ``example_input_array`` or the factory's.

    Raises:
        InvalidModelError: The file is missing, corrupt or of no known kind.
        WeightsError: The state_dict does not fit the module the factory builds.
        UsageError: A state_dict without a factory, or a pickled module or TorchScript
            archive without ``trust_pickle`` (every missing flag named).
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidModelError(f"no such model file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".pt2":
        return _load_pt2(path, trust_pickle)
    if suffix == ".safetensors":
        return _with_factory(path, _read_safetensors(path), module_factory, need_inputs)
    if _is_torchscript(path):
        return _load_torchscript(path, trust_pickle, need_inputs)
    if zipfile.is_zipfile(path) and _is_export_archive(path):
        return _load_pt2(path, trust_pickle)
    return _load_torch_pickle(path, module_factory, trust_pickle, need_inputs)


def _refuse(message: str, missing: list[tuple[str, str]], need_inputs: bool, records: bool):
    """One UsageError naming every flag missing: ``missing`` plus ``--input-shape`` when
    the caller has no inputs and the file records none."""
    if need_inputs and not records:
        missing = [*missing, (INPUTS_FLAG, INPUTS_WHY)]
    return UsageError(message, missing=missing)


def _load_torchscript(path: Path, trust_pickle: bool, need_inputs: bool):
    _check_zip(path, "TorchScript archive")
    traced = _records_traced_inputs(path)
    if not trust_pickle:
        raise _refuse(
            f"{path} is a TorchScript archive: loading it runs the TorchScript code and "
            "pickle data it holds, so xconv loads it only when told the file is trusted "
            "(or export the model with torch.export.save and convert the .pt2)",
            [(TRUST_FLAG, "only if you trust the file's source")],
            need_inputs,
            traced,
        )
    try:
        try:
            # Restores the traced example inputs' shapes and dtypes onto the graph inputs.
            module = torch.jit.load(str(path), map_location="cpu", _restore_shapes=traced)
        except TypeError:  # a torch without _restore_shapes
            module = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:
        raise InvalidModelError(f"{path} is a corrupt TorchScript archive: {_line(e)}") from e
    return module.eval(), _traced_inputs(module)


def _records_traced_inputs(path: Path) -> bool:
    """Whether a TorchScript archive records traced example inputs: its
    ``traced_inputs.pkl`` names a tensor. The pickle's opcodes are read, never run."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n.endswith("/traced_inputs.pkl")), None)
            data = zf.read(name) if name else b""
        return any(
            isinstance(arg, str) and "_rebuild_tensor" in arg
            for _op, arg, _pos in pickletools.genops(data)
        )
    except Exception:  # noqa: BLE001 (an unreadable entry records nothing)
        return False


def _traced_inputs(module: torch.jit.ScriptModule) -> tuple[torch.Tensor, ...] | None:
    """Example inputs of a traced archive: the graph inputs' restored tensor types (complete
    sizes and a dtype each) as deterministic tensors; None when any input lacks one."""
    try:
        values = list(module.graph.inputs())[1:]  # the first is ``self``
    except Exception:  # noqa: BLE001 (a ScriptFunction or a module without forward)
        return None
    inputs = []
    for i, value in enumerate(values):
        t = value.type()
        if not isinstance(t, torch._C.TensorType):
            return None
        sizes, dtype = t.sizes(), t.dtype()
        if sizes is None or dtype is None or any(d is None for d in sizes):
            return None
        inputs.append(_tensor(tuple(sizes), dtype, seed=SPEC_SEED + i))
    return tuple(inputs) or None


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    except Exception:  # noqa: BLE001 (a corrupt directory raises UnicodeDecodeError, struct.error, ...)
        return []


def _is_torchscript(path: Path) -> bool:
    names = _zip_names(path)
    return any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names)


def _is_export_archive(path: Path) -> bool:
    return any("/models/" in n or n.endswith("archive_format") for n in _zip_names(path))


#: A pytree node type recorded in a .pt2 archive's input/output specs.
_PYTREE_TYPE = re.compile(r'type\\*"\s*:\s*\\*"((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)\\*"')


def _pytree_types(path: Path) -> set[str]:
    """The pytree node types (``transformers.modeling_outputs.BaseModelOutput``) an archive's
    input/output specs name."""
    names: set[str] = set()
    try:
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                if member.endswith(".json") and "/models/" in member:
                    names.update(_PYTREE_TYPE.findall(z.read(member).decode("utf-8", "ignore")))
    except Exception:  # noqa: BLE001 (corrupt archives are reported by the loader)
        return set()
    return names


#: Packages whose modules may be imported to register the pytree types an archive names.
_PYTREE_PACKAGES = ("transformers", "diffusers", "timm", "torchvision", "peft")


def _register_pytree_types(names: set[str]) -> list[str]:
    """Import the installed modules that define the archive's pytree types (importing
    ``transformers.modeling_outputs`` registers its output classes), so the archive loads
    in a fresh process. Only modules of installed packages are imported, never code from the
    archive. Returns the names still unknown."""
    from torch.utils import _pytree

    known = _pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE
    missing = []
    for name in sorted(names):
        if name in known:
            continue
        module = name.rpartition(".")[0]
        top = module.partition(".")[0]
        # The archive names the modules: import only from packages known to register output
        # types, so a crafted file cannot pick which installed module's import code runs.
        if top in _PYTREE_PACKAGES and importlib.util.find_spec(top) is not None:
            with contextlib.suppress(Exception):
                importlib.import_module(module)
        if name not in known:
            missing.append(name)
    return missing


#: Archives below this size are CRC-checked entry by entry before loading.
_CRC_CHECK_BYTES = 64 * 2**20


def _check_zip(path: Path, what: str) -> None:
    """Refuse a truncated or corrupt zip archive before the framework reads it."""
    try:
        with zipfile.ZipFile(path) as zf:
            # CRC-check every entry of small archives; large ones only get their directory
            # checked (reading gigabytes twice is too slow), and torch's reader the rest.
            bad = zf.testzip() if path.stat().st_size < _CRC_CHECK_BYTES else None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise InvalidModelError(
            f"{path} is not a readable {what} (corrupt or truncated zip: {_line(e)})"
        ) from e
    except Exception as e:  # zlib.error, NotImplementedError (unknown compression), ...
        raise InvalidModelError(f"{path} is not a readable {what} (corrupt zip: {_line(e)})") from e
    if bad is not None:
        raise InvalidModelError(f"{path} is not a readable {what}: entry {bad!r} is corrupt")


def _pt2_pickles(path: Path) -> list[str]:
    """The entries of a ``.pt2`` that ``torch.export.load`` would unpickle with
    ``weights_only=False`` (running code the file names): payloads whose config says
    ``use_pickle``, opaque-object constants, and ``.pt`` entries (sample inputs, legacy
    constants) the weights-only unpickler refuses, on which torch falls back to a full
    unpickle. Reads the archive; runs nothing from it."""
    import io
    import json

    try:
        from torch.export.pt2_archive.constants import OPAQUE_OBJ_FILENAME_PREFIX as opaque
    except ImportError:  # an older torch: no opaque objects
        opaque = None
    found = []
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if name.endswith("_config.json"):
                config = json.loads(zf.read(name)).get("config") or {}
                for key, meta in config.items():
                    pickled = isinstance(meta, dict) and meta.get("use_pickle")
                    entry = str(meta.get("path_name", "")) if isinstance(meta, dict) else ""
                    if pickled or (opaque and entry.startswith(opaque)):
                        found.append(f"{name}: {key}")
            elif name.endswith(".pt"):
                try:
                    torch.load(io.BytesIO(zf.read(name)), weights_only=True)
                except Exception:  # noqa: BLE001 (refused or unreadable: torch would unpickle it)
                    found.append(name)
    return found


def _load_pt2(path: Path, trust_pickle: bool = False):
    _check_zip(path, "torch.export archive")
    if not trust_pickle:
        try:
            pickles = _pt2_pickles(path)
        except Exception as e:  # noqa: BLE001 (a corrupt entry: the loader reports it)
            raise InvalidModelError(
                f"{path} is not a readable torch.export archive: {_line(e)}"
            ) from e
        if pickles:
            more = f" (+{len(pickles) - 3} more)" if len(pickles) > 3 else ""
            raise UsageError(
                f"{path} holds pickled objects that torch.export.load unpickles with "
                f"weights_only=False, running code the file names: {pickles[:3]}{more}; xconv "
                "loads it only when told the file is trusted",
                missing=[(TRUST_FLAG, "only if you trust the file's source")],
            )
    missing = _register_pytree_types(_pytree_types(path))
    try:
        with _quiet("torch.export"):
            program = torch.export.load(str(path))
    except Exception as e:
        hint = (
            f" (its outputs use {', '.join(missing)}, which no installed package defines; "
            "install the package or export with return_dict=False)"
            if missing
            else ""
        )
        raise InvalidModelError(
            f"{path} is not a readable torch.export archive: {_line(e)}{hint}"
        ) from e
    inputs = None
    if program.example_inputs is not None:
        args, kwargs = program.example_inputs
        if kwargs:
            raise ConversionError(
                f"{path}: example inputs with keyword arguments ({sorted(kwargs)}) are not "
                "supported; export the program with positional inputs"
            )
        inputs = tuple(args)
    return program, inputs


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ConversionError(
            "reading .safetensors needs the safetensors package: pip install 'xconv[safetensors]'"
        ) from e
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable safetensors file: {_line(e)}") from e


def _load_torch_pickle(
    path: Path, module_factory: Factory | None, trust_pickle: bool, need_inputs: bool
):
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses any class but tensors and plain containers: a pickled module.
        if "Unsupported global" not in str(e):
            raise InvalidModelError(
                f"{path} is corrupt or not a PyTorch file (refused by the weights-only "
                f"unpickler: {_line(e)})"
            ) from e
        if not trust_pickle:
            raise _refuse(
                f"{path} holds a pickled Python object (likely a whole nn.Module, from "
                "torch.save(model)), not a state_dict: loading it runs code from the file, "
                "so xconv loads it only when told the file is trusted (or save a state_dict "
                "and convert it with --module, or a .pt2)",
                [(TRUST_FLAG, "only if you trust the file's source")],
                need_inputs,
                _pickle_names(path, EXAMPLE_ATTR),
            ) from e
        obj = _unpickle(path)
    except Exception as e:
        raise InvalidModelError(f"{path} is not a readable PyTorch file: {_line(e)}") from e
    if isinstance(obj, nn.Module):
        return obj.eval(), _attribute_inputs(obj)
    state = _find_state_dict(obj)
    if state is None:
        raise InvalidModelError(
            f"{path} holds a {type(obj).__name__}, neither a state_dict nor an nn.Module"
        )
    return _with_factory(path, state, module_factory, need_inputs)


def _pickle_names(path: Path, name: str) -> bool:
    """Whether the pickle of a ``torch.save`` zip archive holds the string ``name`` (an
    attribute name): its opcodes are read, never run."""
    try:
        with zipfile.ZipFile(path) as zf:
            member = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
            data = zf.read(member) if member else b""
        return any(arg == name for _op, arg, _pos in pickletools.genops(data))
    except Exception:  # noqa: BLE001 (an unreadable pickle names nothing)
        return False


def _attribute_inputs(module: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The module's ``example_input_array`` (a tensor, or a tuple / list of the forward's
    positional tensors) as a tuple; None without one."""
    value = getattr(module, EXAMPLE_ATTR, None)
    if isinstance(value, torch.Tensor):
        return (value,)
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return tuple(value)
    return None


def _unpickle(path: Path) -> Any:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=False)
    except (ModuleNotFoundError, AttributeError) as e:
        # The pickle names the model's class by module path; the user's code defines it.
        raise InvalidModelError(
            f"{path} could not be unpickled: {_line(e)}. The file refers to the model's class "
            "by its module path: run xconv from the folder holding that module (or add it to "
            "PYTHONPATH)"
        ) from e
    except Exception as e:
        raise InvalidModelError(f"{path} could not be unpickled: {_line(e)}") from e


def _find_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    """A flat ``{name: tensor}``; checkpoints often nest it under ``state_dict``/``model``."""
    if isinstance(obj, Mapping):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return dict(obj)
        for key in ("state_dict", "model_state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                found = _find_state_dict(inner)
                if found is not None:
                    return found
    return None


def _with_factory(
    path: Path, state: dict[str, torch.Tensor], factory: Factory | None, need_inputs: bool = False
):
    if factory is None:
        raise _refuse(
            f"{path} is a state_dict (weights only): xconv needs the code that builds the "
            "module to load them into",
            [
                (
                    f"{MODULE_FLAG} pkg.mod:factory",
                    "a function (or class) of your code returning the nn.Module, or "
                    "(module, example_inputs); run from the folder holding pkg",
                )
            ],
            need_inputs,
            False,
        )
    built = resolve_factory(factory)()
    inputs = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        built, inputs = built
        inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    if not isinstance(built, nn.Module):
        raise ConversionError(
            f"module factory {factory!r} returned {type(built).__name__}, not an nn.Module"
        )
    expected = built.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    common = set(expected) & set(state)
    mis_shaped = sorted(k for k in common if tuple(expected[k].shape) != tuple(state[k].shape))
    # Float precisions convert (a float16 checkpoint into a float32 module); a tensor of
    # another kind (integers or booleans for float weights, complex numbers) does not fit.
    mis_typed = sorted(k for k in common if _kind(expected[k]) != _kind(state[k]))
    if missing or unexpected or mis_shaped or mis_typed:
        parts = []
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", mis_shaped),
            ("mis-typed", mis_typed),
        ):
            if keys:
                more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
                parts.append(f"{label}: {keys[:5]}{more}")
        raise WeightsError(f"{path} does not fit the module from the factory: {'; '.join(parts)}")
    built.load_state_dict(state, strict=True)
    return built.eval(), inputs if inputs is not None else _attribute_inputs(built)


def _kind(t: Any) -> str:
    """float, complex, bool or int: the dtype family a checkpoint tensor must keep."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.dtype.is_floating_point:
        return "float"
    if t.dtype.is_complex:
        return "complex"
    return "bool" if t.dtype == torch.bool else "int"


def input_from_spec(spec: str, dtype: str = "float32", *, seed: int = SPEC_SEED) -> torch.Tensor:
    """``"2,3,224,224"`` (optionally ``"2x16:int64"``) -> a deterministic example tensor (the
    grammar of :mod:`xconv.inputs`).

    Floating inputs are standard normal from a fixed seed; integer inputs are zeros (valid
    token ids for any vocabulary); booleans are all True.
    """
    parsed = parse_spec(spec, dtype)
    return _tensor(parsed.shape, getattr(torch, parsed.dtype), seed=seed)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, *, seed: int) -> torch.Tensor:
    if dtype.is_floating_point:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.zeros(shape, dtype=dtype)


def inputs_from_npz(path: str | os.PathLike) -> tuple[torch.Tensor, ...]:
    """The arrays of an ``.npz`` file, in file order, as tensors (positional inputs)."""
    from xconv.weights.io import read_npz_inputs

    arrays = read_npz_inputs(path)
    try:
        return tuple(torch.from_numpy(a) for a in arrays)
    except TypeError as e:  # a dtype torch lacks (uint32 before 2.3, strings, ...)
        raise InvalidModelError(f"{path} holds an array torch cannot take: {_line(e)}") from e


def example_inputs(
    specs: Sequence[str] | None = None,
    dtypes: str | Sequence[str] = "float32",
    *,
    npz: str | os.PathLike | None = None,
) -> tuple[torch.Tensor, ...] | None:
    """Example inputs from shape specs (one per input, with a dtype each or one for all) or
    from an ``.npz`` file; None when neither is given."""
    if npz is not None:
        if specs:
            raise ConversionError("give example inputs either as shapes or as an .npz, not both")
        return inputs_from_npz(npz)
    if not specs:
        return None
    return tuple(
        _tensor(parsed.shape, getattr(torch, parsed.dtype), seed=SPEC_SEED + i)
        for i, parsed in enumerate(parse_specs(specs, dtypes or "float32"))
    )


__all__ = [
    "example_inputs",
    "input_from_spec",
    "inputs_from_npz",
    "load_torch_model",
    "resolve_factory",
]
