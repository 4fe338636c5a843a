"""Sequential onloading: one decoder layer in memory at a time. A model's skeleton is built on
the meta device, the tensors outside its decoder layers read from its safetensors files, and
each decoder layer read when the calibration walker reaches it and dropped after it
(:class:`LayerOnloader`, :func:`onload_model`, :func:`onload_skeleton`)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
from torch import nn

from fedcompress.models.adapter import (
    _ONLOADER_ATTR,
    ModelAdapter,
    _text_config,
    num_layers,
    onloader_of,
)
from fedcompress.models.common import ModelError, default_device, parse_dtype
from fedcompress.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from fedcompress.models.spec import ENCODER_TYPES, LoadedModel, resolve_model_spec

logger = logging.getLogger(__name__)

#: torch dtype -> its name in a safetensors header.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8"}


class OnloadError(ModelError):
    """A model cannot be onloaded (not a local folder of safetensors, missing tensors)."""


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
