"""Saving a compressed model in its smallest faithful form: one writer for every command.

:func:`save_model` writes a model folder that ``transformers`` loads with ``from_pretrained``
(``config.json``, ``generation_config.json``, safetensors weights, sharded as
``save_pretrained`` shards them, and the tokenizer beside them when given), in the dtype it is
told, without touching the model in memory (each tensor is cast on its own; tied tensors stay
tied). A quantized model goes through the same writer: the caller gives the tensors that replace
a linear layer's ``weight`` (the compressed-tensors writer,
:mod:`fedcompress.quant.compressed_tensors`, gives the packed integers and scales) and the
``config.json`` entries to add (its ``quantization_config``).

Which dtype (:func:`save_dtype`): the input model's (:func:`source_dtype`: ``bfloat16`` for the
embedded models, whose published checkpoints are bfloat16; a local folder's ``config.json``), or
the run's ``--dtype`` when that is a 16-bit one, unless the run's ``save_dtype`` setting names
one. A float32 save of a bfloat16 model is twice the size and holds nothing more, with two
exceptions, where the rounding to 16 bits changes weights the run computed in float32:

* weights the run *updated* (SparseGPT's error compensation, a merged LoRA adapter): the saved
  weights are those updates rounded to bfloat16 (relative error at most 2^-9 per weight; on the
  tiny test model the perplexity moves by less than 0.1%, ``tests/test_save_model.py``);
* the embedded models' weights themselves: they ship as GGUF files (4-bit blocks with float16
  scales) that are dequantized once to float32, and those values are not all bfloat16 numbers.

Pruning by a mask (magnitude, Wanda, SparseGPT's mask) keeps the zeros exactly in any dtype, and
a weight the run did not change is saved exactly when it was a number of the saved dtype.

An unstructured mask keeps the file size (and, in today's runtimes, the inference cost) of the
dense model: the zeros are stored. What shrinks a model is a smaller dtype, weight quantization
(packed 4- or 8-bit integers with a scale per group) and layer removal. The report says so with
numbers: :func:`model_size`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedcompress.models.common import DTYPES, parse_dtype
from fedcompress.models.embedded import EMBEDDED_MODELS
from fedcompress.models.spec import LoadedModel

logger = logging.getLogger(__name__)

#: Choices of the ``save_dtype`` setting: ``auto`` (:func:`save_dtype`) or a dtype.
SAVE_DTYPES = ("auto", *DTYPES)
#: The dtype of a model known only as a GGUF file (the embedded ones declare theirs): the dtype
#: its source checkpoints are published in, as for every embedded model.
GGUF_SOURCE_DTYPE = "bfloat16"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of ``config.json`` and ``--dtype``)."""
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype a model folder is stored in: its ``config.json``'s ``dtype`` (or the older
    ``torch_dtype``), else the first floating tensor of its safetensors files, else float32
    (what ``transformers`` assumes)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("dtype", "torch_dtype"):
            if config.get(key) in DTYPES:
                return DTYPES[config[key]]
    for weights in sorted(folder.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as handle:
            for name in handle.keys():
                dtype = handle.get_slice(name).get_dtype()
                found = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
                if dtype in found:
                    return found[dtype]
    return torch.float32


def source_dtype(loaded: LoadedModel) -> torch.dtype:
    """The dtype the input model comes in: an embedded model's declared dtype (its published
    checkpoint's; the GGUF it ships as is dequantized to a float32 cache, which is not its
    dtype), ``bfloat16`` for a user's ``.gguf`` file (:data:`GGUF_SOURCE_DTYPE`), else the
    checkpoint's (:func:`checkpoint_dtype`; a hub model's from its cached snapshot, float32
    when none is cached)."""
    if loaded.source == "embedded" and EMBEDDED_MODELS[loaded.spec].layout == "gguf":
        return parse_dtype(EMBEDDED_MODELS[loaded.spec].dtype)
    if loaded.source == "gguf":
        return parse_dtype(GGUF_SOURCE_DTYPE)
    if Path(loaded.path).is_dir():
        return checkpoint_dtype(loaded.path)
    from huggingface_hub import try_to_load_from_cache

    config_file = try_to_load_from_cache(loaded.path, "config.json")  # a hub id, downloaded
    if isinstance(config_file, str):
        return checkpoint_dtype(Path(config_file).parent)
    return torch.float32


def save_dtype(setting: str, run_dtype: str | torch.dtype | None,
               loaded: LoadedModel) -> torch.dtype:
    """The dtype a run saves its model in: ``setting`` when it names one, else (``auto``) the
    run's dtype when that is a 16-bit one (the weights are already numbers of it), else the
    input model's (:func:`source_dtype`)."""
    if setting not in SAVE_DTYPES:
        raise ValueError(f"save_dtype {setting!r}: expected one of {', '.join(SAVE_DTYPES)}")
    if setting != "auto":
        return DTYPES[setting]
    run = parse_dtype(run_dtype)
    return run if run != torch.float32 else source_dtype(loaded)


@dataclass
class SavedModel:
    """What :func:`save_model` wrote: the folder, its files and their sizes in bytes, the dtype
    of its floating tensors and its format (``dense`` or the ``quantization_config``'s)."""

    path: Path
    dtype: str
    format: str = "dense"
    files: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Bytes of every file written (weights, config, tokenizer)."""
        return sum(self.files.values())

    @property
    def weights_bytes(self) -> int:
        """Bytes of the safetensors files."""
        return sum(size for name, size in self.files.items() if name.endswith(".safetensors"))


def parameter_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``model``'s saved tensors (its ``state_dict``, tied tensors once) with every
    floating tensor counted in ``dtype`` (default: its own): what its safetensors files hold,
    their small headers aside."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen and tensor.device.type != "meta":
            continue
        seen.add(key)
        size = (dtype.itemsize if dtype is not None and tensor.is_floating_point()
                else tensor.element_size())
        total += tensor.numel() * size
    return total


def model_size(saved: SavedModel, dense: nn.Module, dense_dtype: torch.dtype) -> dict[str, Any]:
    """The report's ``model_size``: the saved folder's bytes (``saved_bytes``: every file;
    ``weights_bytes``: the safetensors files) next to the dense input model's
    (``dense_bytes``: its parameter bytes in its own dtype, :func:`parameter_bytes`, so the
    comparison does not depend on how the input was stored, e.g. a GGUF), their ratio, and the
    dtypes and format."""
    dense_bytes = parameter_bytes(dense, dense_dtype)
    return {"saved_bytes": saved.bytes, "weights_bytes": saved.weights_bytes,
            "dense_bytes": dense_bytes, "ratio": saved.weights_bytes / max(dense_bytes, 1),
            "dtype": saved.dtype, "dense_dtype": dtype_name(dense_dtype),
            "format": saved.format, "path": str(saved.path)}


def _cast_state_dict(model: nn.Module, dtype: torch.dtype,
                     replaced: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``model``'s state dict with floating tensors cast to ``dtype`` (tied tensors cast once,
    so they stay one storage and ``save_pretrained`` writes them once), the ``weight`` of each
    module in ``replaced`` swapped for that module's given tensors."""
    state = model.state_dict()
    weights = {f"{name}.weight" for name in replaced}
    missing = sorted(w for w in weights if w not in state)
    if missing:
        raise ValueError(f"tensors given for {missing[:4]}{'...' if len(missing) > 4 else ''}: "
                         "expected names of modules with a weight in the model's state_dict")
    cast: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in weights:
            module = key[: -len(".weight")]
            for suffix, value in replaced[module].items():
                out[f"{module}.{suffix}"] = value.detach().cpu().contiguous()
            continue
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype)
        if storage not in cast:
            value = tensor.detach()
            if value.is_floating_point():
                value = value.to(dtype)
            cast[storage] = value.cpu().contiguous()
        out[key] = cast[storage]
    return out


def save_model(model: nn.Module, path: str | Path, tokenizer: Any = None,
               dtype: str | torch.dtype | None = None, *,
               replace: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
               config: Mapping[str, Any] | None = None) -> SavedModel:
    """Save ``model`` (a ``transformers`` model) to the folder ``path`` in ``dtype``.

    Args:
        model: the model; it is not changed (each tensor is cast to ``dtype`` on its own).
        path: the output folder (created; a previous save's weights files are replaced).
        tokenizer: saved beside the model when given.
        dtype: of every floating tensor and of ``config.json``'s ``dtype`` (what
            ``from_pretrained`` loads it in); default: the model's own.
        replace: module name -> the tensors written instead of its ``weight`` (named
            ``<module>.<key>``, written as given: a quantized layer's packed integers and
            scales).
        config: entries added to ``config.json`` (a ``quantization_config``).

    Returns:
        :class:`SavedModel`: the files written and their sizes.
    """
    target = parse_dtype(dtype) if dtype is not None else _model_dtype(model)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = _cast_state_dict(model, target, replace or {})
    model.save_pretrained(folder, state_dict=state)
    config_file = folder / "config.json"
    written = json.loads(config_file.read_text())
    written["dtype"] = dtype_name(target)
    written.update(config or {})
    config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    quant = (config or {}).get("quantization_config") or {}
    saved = SavedModel(folder, dtype_name(target), str(quant.get("format", "dense")), files)
    logger.info("saved %s (%s, %s): %d bytes, %d of them weights", folder, saved.format,
                saved.dtype, saved.bytes, saved.weights_bytes)
    return saved


def _model_dtype(model: nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
