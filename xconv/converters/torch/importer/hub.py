"""``save_pretrained`` / hub-style folders: ``config.json`` + safetensors weights.

A folder written by ``model.save_pretrained(folder)`` (or downloaded from a model hub) holds
``config.json``, whose ``architectures`` names the model class (``"BertModel"``,
``"LlamaForCausalLM"``), and the weights as ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. :func:`load_folder` builds that class from the installed
``transformers`` package (code the user installed, not code from the folder), loads the
weights strictly (a missing, unexpected or mis-shaped tensor is a ``WeightsError``, never a
random initialisation) and makes the example inputs from the config:

* text models: ``input_ids`` of shape ``(2, min(8, max_position_embeddings))``, token ids
  drawn from a fixed seed below ``vocab_size``; no ``attention_mask`` (all tokens attend);
* vision models: ``pixel_values`` of shape ``(2, num_channels, image_size, image_size)``.

A config with ``auto_map`` names classes defined by Python files in the folder (remote code):
it is refused unless ``trust_code=True`` (``--trust-code``), since loading it runs that code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xconv.errors import InvalidModelError, MissingFrameworkError, UsageError, WeightsError

#: Example batch and sequence length of the default text inputs.
BATCH = 2
SEQUENCE = 8
#: Seed of the default token ids and pixel values.
SEED = 0
CONFIG_NAME = "config.json"
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class HubFolder:
    """What a folder holds, read from its file names and ``config.json`` alone (no framework).

    Attributes:
        path: The folder.
        config: ``config.json`` as a dict.
        architecture: The class ``architectures`` names (its first entry).
        remote_code: The config's ``auto_map`` names classes from the folder's own code.
    """

    path: Path
    config: dict
    architecture: str
    remote_code: bool


def is_hub_folder(path: str | os.PathLike) -> bool:
    """A folder with a ``config.json``."""
    return (Path(path) / CONFIG_NAME).is_file()


def read_folder(path: str | os.PathLike, *, trust_code: bool = False) -> HubFolder:
    """Read and check the folder's ``config.json`` without importing a framework.

    Raises:
        InvalidModelError: An unreadable ``config.json``, or no safetensors weights.
        UsageError: No ``config.json`` (not a save_pretrained folder); the config names remote
            code (``auto_map``) and ``trust_code`` is off, or it names no architecture.
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise UsageError(
            f"{path} is a folder without {CONFIG_NAME}, not a save_pretrained folder; give a "
            "model file (.pt2, TorchScript, a state_dict with --module) or a folder written by "
            "model.save_pretrained(folder)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise InvalidModelError(f"{config_file} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise InvalidModelError(f"{config_file} holds a {type(config).__name__}, not an object")
    remote = bool(config.get("auto_map"))
    if remote and not trust_code:
        raise UsageError(
            f"{config_file} names model code inside the folder (auto_map: "
            f"{sorted(config['auto_map'])}); loading it runs that code",
            missing=[("--trust-code", "allow importing the folder's Python files")],
        )
    architectures = config.get("architectures") or []
    if not architectures and not remote:
        raise UsageError(
            f"{config_file} names no model class (no 'architectures' entry)",
            missing=[
                (
                    "--module",
                    "with --config and --weights: the class to build, e.g. transformers:BertModel",
                )
            ],
        )
    if not any((path / name).is_file() for name in WEIGHT_NAMES):
        raise InvalidModelError(
            f"{path} has no {' or '.join(WEIGHT_NAMES)}; save the model with "
            "save_pretrained(folder) (safetensors is its default)"
        )
    architecture = architectures[0] if architectures else ""
    return HubFolder(path, config, architecture, remote)


def load_folder(path: str | os.PathLike, *, trust_code: bool = False) -> tuple[Any, tuple, str]:
    """Build the folder's model with its weights, and its example inputs.

    Returns:
        ``(module in eval mode, example inputs, description)``; the description names the
        class and the inputs made from the config.

    Raises:
        InvalidModelError, UsageError: see :func:`read_folder`; also a class ``transformers``
            does not define.
        WeightsError: The weights do not fit the class (every problem listed).
    """
    folder = read_folder(path, trust_code=trust_code)
    try:
        import transformers
    except ImportError as e:
        raise MissingFrameworkError(
            f"{folder.path} is a {folder.architecture or 'transformers'} folder and "
            "transformers is not installed: pip install transformers"
        ) from e
    kwargs: dict[str, Any] = {"local_files_only": True, "output_loading_info": True}
    if folder.remote_code:
        cls: Any = transformers.AutoModel
        kwargs["trust_remote_code"] = True
    else:
        cls = getattr(transformers, folder.architecture, None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise InvalidModelError(
                f"{folder.path / CONFIG_NAME} names {folder.architecture!r}, which transformers "
                f"{transformers.__version__} does not define; upgrade transformers or convert "
                "with --module pkg.mod:Class --config --weights"
            )
    config = _config(transformers, folder, trust_code=folder.remote_code)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # the CLI prints its own progress
    try:
        model, info = cls.from_pretrained(str(folder.path), config=config, **kwargs)
    except (OSError, ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise WeightsError(
            f"{folder.path}: the weights do not load into {cls.__name__}: {first}"
        ) from e
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    _check_loading_info(folder, info)
    model.eval()
    inputs, described = example_inputs(folder.config)
    name = type(model).__name__
    return model, inputs, f"{folder.path} ({name}; inputs from config.json: {described})"


def _config(transformers: Any, folder: HubFolder, *, trust_code: bool) -> Any:
    config = transformers.AutoConfig.from_pretrained(
        str(folder.path), local_files_only=True, trust_remote_code=trust_code
    )
    # The traced forward returns plain tensors: no KV cache object, no attention maps.
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _check_loading_info(folder: HubFolder, info: dict) -> None:
    """transformers fills a missing tensor with random values and only warns: refuse it."""
    parts = []
    for label, key in (
        ("missing", "missing_keys"),
        ("unexpected", "unexpected_keys"),
        ("mis-shaped", "mismatched_keys"),
    ):
        keys = sorted(str(k) for k in info.get(key) or ())
        if keys:
            more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
            parts.append(f"{label}: {keys[:5]}{more}")
    if parts:
        raise WeightsError(
            f"{folder.path}: the weights do not fit {folder.architecture or 'the model'}: "
            + "; ".join(parts)
        )


def example_inputs(config: dict) -> tuple[tuple | None, str]:
    """``(inputs, description)`` made from a config dict: ``input_ids`` for a model with a
    vocabulary, ``pixel_values`` for one with an ``image_size``; ``(None, why)`` when the
    config says neither (``--input-shape`` must supply them)."""
    import torch

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vision = (
        config.get("vision_config") if isinstance(config.get("vision_config"), dict) else config
    )
    generator = torch.Generator().manual_seed(SEED)
    if text.get("vocab_size") and not config.get("image_size"):
        limit = _max_positions(text)
        length = min(SEQUENCE, limit) if limit else SEQUENCE
        ids = torch.randint(0, int(text["vocab_size"]), (BATCH, length), generator=generator)
        return (ids,), f"input_ids {BATCH}x{length} int64"
    if vision.get("image_size"):
        size = vision["image_size"]
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        channels = int(vision.get("num_channels", 3))
        pixels = torch.randn((BATCH, channels, h, w), generator=generator)
        return (pixels,), f"pixel_values {BATCH}x{channels}x{h}x{w} float32"
    return None, "none: config.json has no vocab_size or image_size"


def _max_positions(config: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


__all__ = ["HubFolder", "example_inputs", "is_hub_folder", "load_folder", "read_folder"]
