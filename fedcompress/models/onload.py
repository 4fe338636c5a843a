"""Onloading a model: its skeleton built on the meta device with the tensors outside its
decoder layers read from its safetensors files, the decoder layers left for the calibration
walker to read one at a time (:func:`~fedcompress.models.onload.onload_model`,
:func:`~fedcompress.models.onload.onload_skeleton`; the reading itself:
:class:`~fedcompress.models.adapter.LayerOnloader`)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
from torch import nn

from fedcompress.models.adapter import (
    _ONLOADER_ATTR,
    LayerOnloader,
    num_layers,
    onloader_of,
    safetensors_files,
)
from fedcompress.models.common import OnloadError, default_device, parse_dtype
from fedcompress.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from fedcompress.models.spec import ENCODER_TYPES, LoadedModel, resolve_model_spec

logger = logging.getLogger(__name__)


def _hub_snapshot(spec: str) -> str:
    """The local snapshot folder of hub model ``spec`` if it is in the Hugging Face cache, else
    an error naming it and what onloading expects."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(spec, local_files_only=True,
                                   allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                   "*.jinja"])
    except Exception as err:  # noqa: BLE001 - any failure means: not usable offline
        raise OnloadError(
            f"cannot onload {spec!r}: it is a Hugging Face hub id that is not in the local hub "
            f"cache ({type(err).__name__}). Onloading reads decoder layers one at a time from a "
            "local folder of safetensors files: expected an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}), a .gguf file (converted once), a local model "
            "directory with *.safetensors, or a hub id downloaded beforehand") from err
    safetensors_files(folder)
    return folder


def onload_source(spec: str) -> tuple[str, str, bool]:
    """(source kind, local safetensors folder, converted-now flag) of a spec to onload:
    :func:`~fedcompress.models.spec.resolve_model_spec`, with hub ids taken from the local hub
    cache only."""
    source, path, converted = resolve_model_spec(spec)
    if source == "hub":
        path = _hub_snapshot(spec)
    safetensors_files(path)
    return source, path, converted


def onload_model(spec: str = DEFAULT_MODEL, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None) -> LoadedModel:
    """An onloaded skeleton of ``spec`` and its tokenizer: the model built on the meta device,
    every tensor outside the decoder layers read from its safetensors files, the decoder
    layers left empty for the calibration walker to read one at a time
    (:meth:`~fedcompress.models.adapter.ModelAdapter.onloaded`). Embedded models and ``.gguf``
    files are converted once as for :func:`~fedcompress.models.loading.load_model`; hub ids
    only from the local hub cache.

    Raises:
        OnloadError: the spec is not a local folder of safetensors (it says what is expected).
    """
    from transformers import AutoConfig, AutoTokenizer

    start = time.perf_counter()
    source, path, converted = onload_source(spec)
    config = AutoConfig.from_pretrained(path)
    model = skeleton_from_config(config, path, device or default_device(), dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seconds = time.perf_counter() - start
    logger.info("onloaded the skeleton of %s (%s) from %s in %.1fs", spec, source, path, seconds)
    return LoadedModel(model, tokenizer, spec, source, path, converted, seconds,
                       info={"model_type": config.model_type, "onload": True,
                             "num_layers": num_layers(model),
                             "parameters": sum(p.numel() for p in model.parameters())})


def skeleton_from_config(config, folder: str | Path, device: str | torch.device = "cpu",
                         dtype: str | torch.dtype | None = None) -> nn.Module:
    """The meta-device skeleton of the model ``config`` describes, with its onloader attached
    and the tensors outside the decoder layers read from ``folder``."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    if config.model_type in ENCODER_TYPES:
        raise OnloadError(f"onloading prunes decoder models; {config.model_type!r} is an "
                          "encoder")
    safetensors_files(folder)
    # Parameters on the meta device; buffers computed as usual (rotary frequencies, scales).
    with init_empty_weights(include_buffers=False):
        auto = AutoModel if config.model_type in ENCODER_TYPES else AutoModelForCausalLM
        model = auto.from_config(config, dtype=parse_dtype(dtype))
    model.eval()
    model.name_or_path = str(folder)
    onloader = LayerOnloader(model, folder, device)
    for buffer_owner in model.modules():  # computed buffers follow the device
        for attr, buf in buffer_owner._buffers.items():
            if buf is not None and buf.device.type != "meta":
                buffer_owner._buffers[attr] = buf.to(onloader.device)
    onloader.materialize_rest()
    object.__setattr__(model, _ONLOADER_ATTR, onloader)
    return model


def onload_skeleton(model: nn.Module) -> nn.Module:
    """``model`` if it is an onloaded skeleton, else a skeleton of the same weights read from
    the safetensors folder ``model`` was loaded from (same dtype and device)."""
    if onloader_of(model) is not None:
        return model
    folder = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        raise OnloadError(
            f"onloading reads decoder layers from the safetensors folder the model was loaded "
            f"from; this model's name_or_path is {folder!r}, not a local folder. Load it with "
            "load_model(spec, onload=True) or save it with save_pretrained first")
    param = next(model.parameters())
    return _cached_skeleton(str(Path(folder).resolve()), str(param.device), param.dtype)


@functools.lru_cache(maxsize=2)
def _cached_skeleton(folder: str, device: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig

    return skeleton_from_config(AutoConfig.from_pretrained(folder), folder, device, dtype)
