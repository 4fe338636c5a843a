"""The layer adapter and the layer onloader: uniform access to the decoder (or encoder) layers
of every supported architecture (:class:`~fedcompress.models.adapter.ModelAdapter`) and to the
linear layers inside each of them, layer removal that keeps the model generating with a KV cache
and round-tripping through ``save_pretrained``/``from_pretrained``, and, for an onloaded skeleton,
its decoder layers read from the safetensors files one at a time for the duration of a block
(:class:`~fedcompress.models.adapter.LayerOnloader`, used by
:meth:`~fedcompress.models.adapter.ModelAdapter.onloaded`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from fedcompress.models.common import (
    OnloadError,
    UnsupportedArchitectureError,
    release_free_memory,
)

logger = logging.getLogger(__name__)

_ONLOADER_ATTR = "_fedcompress_onloader"
#: torch dtype -> its name in a safetensors header.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8"}


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
    """The :class:`~fedcompress.models.adapter.LayerOnloader` of an onloaded skeleton, or None
    for a whole model."""
    return getattr(model, _ONLOADER_ATTR, None)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors weight files of a model folder (sharded or not); an error naming the
    folder and what is expected if there are none."""
    folder = Path(path)
    if not folder.is_dir():
        raise OnloadError(f"onloading reads decoder layers from a local model folder: {path!r} "
                          "is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise OnloadError(
            f"onloading needs the model's weights as safetensors files: {folder} holds none "
            f"(found {sorted(p.name for p in folder.iterdir())[:8]}); expected model.safetensors "
            "or model-0000x-of-0000y.safetensors (save_pretrained writes them)")
    return files


class LayerOnloader:
    """Reads a skeleton's tensors from its safetensors files, one decoder layer at a time.

    The skeleton is built on the meta device (no storage); every tensor outside the decoder
    layers (embeddings, rotary and norm modules; not an untied output head, which the walker
    never reaches) is taken at once: on the CPU in the file's dtype, as a private
    (copy-on-write) mapping of the file, resident only where read, else copied; a decoder
    layer's tensors are read when the walker reaches it (:meth:`materialize_layer`, files
    memory-mapped by ``safe_open``, copied into one storage in the model's dtype and device)
    and dropped back to the meta device after it (:meth:`release_layer`). Names in the files
    must be the model's own ``state_dict`` names (what ``save_pretrained`` writes).
    """

    def __init__(self, model: nn.Module, folder: str | Path,
                 device: str | torch.device = "cpu"):
        from safetensors import safe_open

        self.model = model
        self.folder = Path(folder)
        self.device = torch.device(device)
        self.adapter = ModelAdapter(model)
        self.prefix = self.adapter.layers_path + "."
        self.file_of: dict[str, Path] = {}
        for file in safetensors_files(self.folder):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    self.file_of[key] = file

    #: Tensors larger than this are copied from the files in blocks of about this size.
    CHUNK_BYTES = 64 * 2 ** 20

    def _slots(self, module: nn.Module, prefix: str) -> dict[str, tuple[nn.Module, str, bool]]:
        """Every parameter and persistent buffer under ``module``: full name -> (owner, attr,
        is_parameter)."""
        slots: dict[str, tuple[nn.Module, str, bool]] = {}
        for name, owner in module.named_modules(remove_duplicate=False):
            for attr in owner._parameters:
                if owner._parameters[attr] is not None:
                    slots[f"{prefix}{name + '.' if name else ''}{attr}"] = (owner, attr, True)
            for attr in owner._buffers:
                if owner._buffers[attr] is not None and \
                        attr not in owner._non_persistent_buffers_set:
                    slots[f"{prefix}{name + '.' if name else ''}{attr}"] = (owner, attr, False)
        return slots

    def _read(self, slots: dict[str, tuple[nn.Module, str, bool]], required: bool,
              flat: bool = False) -> None:
        """Read the tensors of ``slots`` into the model. ``flat``: into ONE new storage per
        dtype (views of it), so that a layer's memory is one allocation, returned to the system
        as a whole when the layer is released (tensors allocated one by one leave the C
        allocator's heap fragmented: the process kept growing by about a layer per layer)."""
        from safetensors import safe_open

        missing = [key for key in slots if key not in self.file_of]
        if missing and required:
            raise OnloadError(f"{self.folder}: no tensor {missing[0]!r} in its safetensors files "
                              f"({len(missing)} missing); expected the names of the model's "
                              "state_dict, as save_pretrained writes them")
        current = {key: (owner._parameters[attr] if is_param else owner._buffers[attr])
                   for key, (owner, attr, is_param) in slots.items()}
        dests: dict[str, torch.Tensor] = {}
        if flat:
            sizes: dict[torch.dtype, int] = {}
            for old in current.values():
                assert old is not None
                sizes[old.dtype] = sizes.get(old.dtype, 0) + old.numel()
            storage = {dtype: torch.empty(n, dtype=dtype, device=self.device)
                       for dtype, n in sizes.items()}
            offset = dict.fromkeys(sizes, 0)
            for key, old in current.items():
                assert old is not None
                start, offset[old.dtype] = offset[old.dtype], offset[old.dtype] + old.numel()
                dests[key] = storage[old.dtype][start:offset[old.dtype]].view(old.shape)
            del storage
        by_file: dict[Path, list[str]] = {}
        for key in slots:
            if key in self.file_of:
                by_file.setdefault(self.file_of[key], []).append(key)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in keys:
                    owner, attr, is_param = slots[key]
                    old = current[key]
                    assert old is not None
                    shape = tuple(handle.get_slice(key).get_shape())
                    if shape != tuple(old.shape):
                        raise OnloadError(f"{file}: tensor {key!r} has shape {shape}, the "
                                          f"model expects {tuple(old.shape)}")
                    out = dests.pop(key, None)
                    if out is None and self.device.type == "cpu" and \
                            handle.get_slice(key).get_dtype() == _SAFETENSORS_DTYPES.get(old.dtype):
                        # Kept mapped (private, copy-on-write): resident only where read (the
                        # embeddings' rows of the calibration tokens), as transformers maps them.
                        out = handle.get_tensor(key)
                    else:
                        if out is None:
                            out = torch.empty(old.shape, dtype=old.dtype, device=self.device)
                        self._copy(handle, file, key, out)
                    if is_param:
                        owner._parameters[attr] = nn.Parameter(out,
                                                               requires_grad=old.requires_grad)
                    else:
                        owner._buffers[attr] = out

    def _copy(self, handle, file: Path, key: str, out: torch.Tensor) -> None:
        """Copy tensor ``key`` into ``out`` (cast to its dtype). The file is mapped read-only
        and its touched pages count as resident while the mapping lives, so a tensor larger
        than :attr:`CHUNK_BYTES` (the embeddings) is copied by row blocks, each from a mapping
        opened and released for it: the copy adds one block, not a second tensor."""
        from safetensors import safe_open

        tensor = handle.get_tensor(key)  # a view of the mapping: nothing is read yet
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.CHUNK_BYTES or tensor.dim() == 0:
            out.copy_(tensor)
            return
        del tensor
        rows = max(1, out.shape[0] * self.CHUNK_BYTES // nbytes)
        for start in range(0, out.shape[0], rows):
            with safe_open(str(file), framework="pt", device="cpu") as block:
                out[start:start + rows].copy_(block.get_slice(key)[start:start + rows])

    def materialize_rest(self) -> None:
        """Read every tensor outside the decoder layers but the output head: the walker
        stops before the head, so an untied head stays on the meta device; a tied one is the
        input embeddings' weight."""
        get_out = getattr(self.model, "get_output_embeddings", None)
        head = get_out() if callable(get_out) else None
        tie = bool(getattr(_text_config(self.model), "tie_word_embeddings", False))
        slots = {k: v for k, v in self._slots(self.model, "").items()
                 if not k.startswith(self.prefix) and (head is None or v[0] is not head)}
        self._read(slots, required=True)
        if head is not None and tie:
            head._parameters["weight"] = self.model.get_input_embeddings().weight

    def materialize_layer(self, index: int) -> nn.Module:
        """Read decoder layer ``index``'s tensors into it (their own storage)."""
        if not 0 <= index < len(self.adapter):
            raise IndexError(f"layer {index} out of range: the model has {len(self.adapter)}")
        layer = self.adapter.layers[index]
        self._read(self._slots(layer, f"{self.prefix}{index}."), required=True, flat=True)
        return layer

    def release_layer(self, index: int) -> None:
        """Put decoder layer ``index``'s parameters and persistent buffers back on the meta
        device (their memory is freed once nothing else holds them)."""
        layer = self.adapter.layers[index]
        for owner, attr, is_param in self._slots(layer, "").values():
            old = owner._parameters[attr] if is_param else owner._buffers[attr]
            assert old is not None
            empty = torch.empty(old.shape, dtype=old.dtype, device="meta")
            if is_param:
                owner._parameters[attr] = nn.Parameter(empty, requires_grad=old.requires_grad)
            else:
                owner._buffers[attr] = empty

    def materialized_layers(self) -> list[int]:
        """Indices of the decoder layers that hold real storage now (checked, not assumed)."""
        return [i for i, layer in enumerate(self.adapter.layers)
                if any(t.device.type != "meta" for t in
                       (*layer.parameters(), *layer.buffers()))]
