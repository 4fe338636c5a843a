"""The layer adapter: uniform access to the decoder (or encoder) layers of every supported
architecture and to the linear layers inside each of them, layer removal that keeps the model
generating with a KV cache and round-tripping through ``save_pretrained``/``from_pretrained``,
and how an onloaded skeleton's decoder layers are read for the duration of a block
(:meth:`ModelAdapter.onloaded`)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedcompress.models.common import UnsupportedArchitectureError, release_free_memory

if TYPE_CHECKING:  # annotations only: the onloader builds on the adapter
    from fedcompress.models.onload import LayerOnloader

logger = logging.getLogger(__name__)

_ONLOADER_ATTR = "_fedcompress_onloader"


#: model_type -> attribute paths (tried in order) of the ModuleList of decoder/encoder layers.
LAYER_PATHS: dict[str, tuple[str, ...]] = {
    "llama": ("model.layers",),
    "qwen2": ("model.layers",),
    "mistral": ("model.layers",),
    "gemma3_text": ("model.layers",),
    "gemma3": ("model.language_model.layers", "language_model.layers"),
    "opt": ("model.decoder.layers", "decoder.layers"),
    "gpt2": ("transformer.h", "h"),
    "bert": ("bert.encoder.layer", "encoder.layer"),
}
SUPPORTED_ARCHITECTURES = tuple(LAYER_PATHS)


def _get_attr_path(obj: object, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _text_config(model: nn.Module):
    config = model.config
    return getattr(config, "text_config", None) if config.model_type == "gemma3" else config


class ModelAdapter:
    """Uniform access to the layers of a supported model."""

    def __init__(self, model: nn.Module):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in LAYER_PATHS:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {model_type!r}: supported model types are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for path in LAYER_PATHS[model_type]:
            layers = _get_attr_path(model, path)
            if isinstance(layers, nn.ModuleList):
                break
        else:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} ({model_type}) has none of the layer lists "
                f"{LAYER_PATHS[model_type]}"
            )
        self.model = model
        self.model_type = model_type
        self.layers_path = path
        self.layers: nn.ModuleList = layers

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def onloader(self) -> LayerOnloader | None:
        """The source of the decoder layers of an onloaded skeleton (None: a whole model)."""
        return onloader_of(self.model)

    @contextlib.contextmanager
    def onloaded(self, index: int):
        """Decoder layer ``index`` with real weights for the duration of the block: the layer
        itself for a whole model; for an onloaded skeleton, read from the safetensors files and
        put back on the meta device (its memory freed) when the block ends. The layer's weights
        may be changed in place inside the block only if :attr:`onloader` is set (they are a
        private copy then)."""
        onloader = self.onloader
        if onloader is None:
            yield self.layers[index]
            return
        layer = self.layers[index]
        onloader.materialize_layer(index)
        try:
            yield layer
        finally:
            onloader.release_layer(index)
            release_free_memory()

    @staticmethod
    def linear_layers(layer: nn.Module) -> dict[str, nn.Module]:
        """The linear layers of one decoder layer, by name relative to the layer, in module order.

        ``nn.Linear`` and GPT-2's ``Conv1D`` (whose weight is stored transposed; use
        :func:`weight_matrix` for an ``[out, in]`` view).
        """
        from transformers.pytorch_utils import Conv1D

        return {name: module for name, module in layer.named_modules()
                if isinstance(module, (nn.Linear, Conv1D))}


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The weight of a linear layer as an ``[out_features, in_features]`` view (writes through)."""
    from transformers.pytorch_utils import Conv1D

    return module.weight.T if isinstance(module, Conv1D) else module.weight


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder (or encoder) layers of a supported model."""
    return ModelAdapter(model).layers


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def remove_layers(model: nn.Module, indices: list[int] | tuple[int, ...]) -> nn.Module:
    """Remove the layers at ``indices`` in place and return the model.

    Renumbers every ``layer_idx`` (attention modules use it to address the KV cache), updates
    ``num_hidden_layers`` and the per-layer config lists (``layer_types``; Qwen2's
    ``max_window_layers``), so the model generates with a cache and survives
    ``save_pretrained``/``from_pretrained``.
    """
    adapter = ModelAdapter(model)
    n = len(adapter)
    drop = sorted(set(int(i) for i in indices))
    if len(drop) != len(indices):
        raise ValueError(f"duplicate layer indices in {list(indices)}")
    bad = [i for i in drop if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {n} layers (0..{n - 1})")
    if len(drop) >= n:
        raise ValueError(f"cannot remove all {n} layers")
    keep = [i for i in range(n) if i not in drop]
    kept = nn.ModuleList(adapter.layers[i] for i in keep)
    parent_path, _, attr = adapter.layers_path.rpartition(".")
    parent = _get_attr_path(model, parent_path) if parent_path else model
    setattr(parent, attr, kept)
    for new_idx, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    config = _text_config(model)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in keep]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = sum(1 for i in keep if i < config.max_window_layers)
    logger.info("removed layers %s: %d -> %d layers", drop, n, len(keep))
    return model


def model_context_length(model: nn.Module) -> int | None:
    """The longest sequence the model accepts, or None if its config does not say.

    Looks at ``config.text_config`` first (multimodal configs such as Gemma 3 nest the text model
    there), then the top-level config, for ``n_positions``, ``max_position_embeddings``, ``n_ctx``.
    """
    config = getattr(model, "config", model)
    for cfg in (getattr(config, "text_config", None), config):
        if cfg is None:
            continue
        for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def onloader_of(model: nn.Module) -> LayerOnloader | None:
    """The :class:`~fedcompress.models.onload.LayerOnloader` of an onloaded skeleton, or None
    for a whole model."""
    return getattr(model, _ONLOADER_ATTR, None)
