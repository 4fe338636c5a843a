"""Writing a weight-quantized model as a compressed-tensors ``pack-quantized`` checkpoint.

The format is the one llm-compressor 0.14 writes (through compressed-tensors 0.19) and that
``transformers`` (with the ``compressed-tensors`` package installed) and vLLM load; this module
writes it itself (no compressed-tensors import). Each quantized linear layer ``<name>`` is
stored as:

* ``<name>.weight_packed``: int32 ``[out, ceil(in * bits / 32)]``, the integers ``q`` of each
  row offset by ``2^(bits-1)`` (to ``[0, 2^bits)``) and packed densely along the row, element
  ``i`` at bit ``i * bits`` of the row's little-endian bit stream (8 values per word for 4 bits,
  4 for 8 bits; the last word of a row zero-padded);
* ``<name>.weight_scale``: ``[out, groups]`` in the saved model's dtype (``groups = in /
  group_size``, or 1 per output channel);
* ``<name>.weight_zero_point`` (asymmetric only): the zero points ``[out, groups]``, offset and
  packed the same way but along the output dimension (int32 ``[ceil(out * bits / 32),
  groups]``);
* ``<name>.weight_shape``: int64 ``[out, in]``.

The weight a runtime computes is ``(q - zero_point[g]) * scale[g]`` with ``g`` the column's group,
in the scale's dtype: with a bfloat16 save the scales are rounded to bfloat16, so the loaded
weights are ``(q - zero_point) * bf16(scale)`` rounded to bfloat16 (a float32 save keeps the
solver's float32 scales). Every other tensor (embeddings, norms, ``lm_head``) is saved in the
model's save dtype, and ``config.json`` gets the ``quantization_config``
(:func:`quantization_config`): one config group targeting ``Linear`` with the weights' bits,
type, symmetry, strategy (``group`` or ``channel``), group size, activation order and observer,
and every linear layer left unquantized (``lm_head``) in ``ignore``.

How ``transformers`` 5.23 (with compressed-tensors 0.20) runs it on the CPU: it loads the packed
integers and decompresses each layer at its first forward, then keeps the dense weight (dense
speed and memory); ``CompressedTensorsConfig(dequantize=True)`` decompresses on load. It refuses
an asymmetric checkpoint unless told to decompress on load (it expects the zero points unpacked;
llm-compressor 0.14's own asymmetric output fails the same way, and loads with transformers 5.17
and compressed-tensors 0.19).

Activation ordering by group (``actorder="group"``, a permuted ``g_idx``) is refused: it was
removed from compressed-tensors in 0.19 (its config no longer parses, and no ``weight_g_idx`` is
read), so nothing that loads this format would apply it. Static activation ordering changes the
order in which GPTQ quantizes columns but not the format: its groups are the weight's own
column ranges, and it is written like no ordering (``actorder: static``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedcompress.models.common import parse_dtype
from fedcompress.models.saving import SavedModel, save_model
from fedcompress.quant.config import QuantConfig

logger = logging.getLogger(__name__)

#: The compressed-tensors version whose format this writes (llm-compressor 0.14.0.1's).
FORMAT_VERSION = "0.19.0"
#: The compressed-tensors name of each of our scale observers: ``minmax`` takes a group's
#: scale from its dense weights' minimum and maximum, which llm-compressor calls
#: ``memoryless_minmax`` (it writes that name for weights).
OBSERVER_NAMES = {"minmax": "memoryless_minmax"}
#: Our activation orders as compressed-tensors writes them (``group`` is not writable).
ACTORDER_NAMES = {"none": None, "static": "static"}


@dataclass
class PackedLinear:
    """One linear layer's quantized weight, as a solver (GPTQ, RTN) gives it.

    ``q``: integers ``[out, in]`` in ``[-2^(bits-1), 2^(bits-1) - 1]`` (any integer dtype);
    ``scale``: floats ``[out, groups]``; ``zero_point``: integers ``[out, groups]`` in the same
    range as ``q`` (``None`` or all zeros when symmetric); ``g_idx``: the group of each input
    column (int ``[in]``) or ``None``: only the weight's own grouping
    (``arange(in) // group_size``) can be written. The weight is
    ``(q - zero_point[:, g]) * scale[:, g]`` with ``g = g_idx`` of each column.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    def dequantize(self, group_size: int) -> torch.Tensor:
        """The float32 weight ``(q - zero_point) * scale``, group by group."""
        out, width = self.q.shape
        groups = torch.arange(width) // group_size if group_size else torch.zeros(
            width, dtype=torch.long)
        scale = self.scale.float()[:, groups]
        zero = 0.0 if self.zero_point is None else self.zero_point.float()[:, groups]
        return (self.q.float() - zero) * scale


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed ``bits``-bit integers (a 2-D tensor) into int32 words along ``dim`` the way
    compressed-tensors does: offset by ``2^(bits-1)``, element ``i`` of a row at bit
    ``i * bits`` (``bits`` divides 32 here: 4 or 8), the last word zero-padded."""
    if bits not in (4, 8):
        raise ValueError(f"packing {bits}-bit integers: expected 4 or 8 bits")
    if values.dim() != 2:
        raise ValueError(f"packing a tensor of shape {tuple(values.shape)}: expected 2-D")
    array = values.detach().cpu().numpy().astype(np.int64)
    if dim == 0:
        array = array.T
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if array.size and (array.min() < low or array.max() > high):
        raise ValueError(f"{bits}-bit integers out of range [{low}, {high}]: found "
                         f"[{array.min()}, {array.max()}]")
    per_word = 32 // bits
    rows, cols = array.shape
    words = -(-cols // per_word)
    unsigned = np.zeros((rows, words * per_word), dtype=np.uint32)
    unsigned[:, :cols] = (array + (1 << (bits - 1))).astype(np.uint32)
    unsigned = unsigned.reshape(rows, words, per_word)
    packed = np.zeros((rows, words), dtype=np.uint32)
    for slot in range(per_word):
        packed |= unsigned[:, :, slot] << np.uint32(slot * bits)
    result = torch.from_numpy(packed.view(np.int32).copy())
    return (result.T if dim == 0 else result).contiguous()


def quantization_config(config: QuantConfig, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for weights quantized by ``config`` (the
    keys and values llm-compressor 0.14 writes for a W4A16/W8A16 ``pack-quantized`` model)."""
    _check_writable(config)
    weights = {
        "actorder": ACTORDER_NAMES[config.actorder],
        "block_structure": None,
        "dynamic": False,
        "group_size": config.group_size or None,
        "num_bits": config.bits,
        "observer": OBSERVER_NAMES[config.observer],
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "group" if config.group_size else "channel",
        "symmetric": config.symmetric,
        "type": "int",
        "zp_dtype": None if config.symmetric else "torch.int8",
    }
    return {
        "config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"],
                                      "weights": weights}},
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": FORMAT_VERSION,
    }


def _check_writable(config: QuantConfig) -> None:
    if config.actorder not in ACTORDER_NAMES:
        raise ValueError(
            f"activation ordering {config.actorder!r} cannot be saved: compressed-tensors "
            "removed activation ordering by group (g_idx) in 0.19, so transformers and vLLM "
            f"would not load it; expected one of {', '.join(ACTORDER_NAMES)} (static keeps "
            "most of its accuracy and the plain format)")
    if config.observer not in OBSERVER_NAMES:
        raise ValueError(f"scale observer {config.observer!r}: expected one of "
                         f"{', '.join(OBSERVER_NAMES)}")


def packed_tensors(name: str, weight_shape: tuple[int, int], layer: PackedLinear,
                   config: QuantConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that replace linear layer ``name``'s weight (``weight_packed``,
    ``weight_scale``, ``weight_shape``, and ``weight_zero_point`` when asymmetric), checked
    against its shape and ``config``: an error names the layer, the tensor and what was
    expected."""
    bits = config.bits
    out, width = weight_shape
    config.check_width(name, width)
    groups = width // config.group_size if config.group_size else 1
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def integers(label: str, value: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name}: {label} of dtype {value.dtype}: expected integers")
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: {label} of shape {tuple(value.shape)}: expected {shape}")
        if value.numel() and (int(value.min()) < low or int(value.max()) > high):
            raise ValueError(f"{name}: {label} in [{int(value.min())}, {int(value.max())}]: "
                             f"expected {bits}-bit integers in [{low}, {high}]")
        return value.to(torch.int8)

    q = integers("q", layer.q, (out, width))
    scale = layer.scale
    if not scale.dtype.is_floating_point or tuple(scale.shape) != (out, groups):
        raise ValueError(f"{name}: scale of dtype {scale.dtype} and shape {tuple(scale.shape)}: "
                         f"expected floats of shape {(out, groups)}")
    saved_scale = scale.detach().to(dtype)
    if not torch.isfinite(saved_scale).all() or bool((saved_scale[scale != 0] == 0).any()):
        raise ValueError(f"{name}: scales in [{float(scale.min()):g}, {float(scale.max()):g}] "
                         f"are not all finite and nonzero in {dtype}: expected scales that "
                         f"{dtype} represents")
    tensors = {"weight_packed": pack_int32(q, bits),
               "weight_scale": saved_scale.cpu().contiguous(),
               "weight_shape": torch.tensor([out, width], dtype=torch.int64)}
    zero = layer.zero_point
    if config.symmetric:
        if zero is not None and bool(zero.any()):
            raise ValueError(f"{name}: nonzero zero points with symmetric quantization: "
                             "expected none (or zeros), or symmetric=false")
    else:
        if zero is None:
            raise ValueError(f"{name}: no zero points with asymmetric quantization: expected "
                             f"integers of shape {(out, groups)}")
        tensors["weight_zero_point"] = pack_int32(
            integers("zero_point", zero, (out, groups)), bits, dim=0)
    if layer.g_idx is not None:
        own = torch.arange(width) // (config.group_size or width)
        if tuple(layer.g_idx.shape) != (width,) or not torch.equal(
                layer.g_idx.to(torch.long).cpu(), own):
            raise ValueError(
                f"{name}: a g_idx that permutes the groups (activation ordering by group): "
                "expected none, or the weight's own grouping arange(in) // group_size; "
                "compressed-tensors removed g_idx in 0.19, so no runtime would apply it")
    return tensors


def save_quantized(model: nn.Module, path: str | Path, layers: Mapping[str, PackedLinear],
                   config: QuantConfig, tokenizer: Any = None,
                   dtype: str | torch.dtype = torch.bfloat16) -> SavedModel:
    """Save ``model`` with the linear layers named in ``layers`` (module names, as
    ``model.named_modules()`` gives them) stored as ``config``'s packed integers and scales,
    everything else in ``dtype``, as a compressed-tensors ``pack-quantized`` folder that
    ``AutoModelForCausalLM.from_pretrained`` loads (with the ``compressed-tensors`` package).
    The model's own weights of those layers are not read (the integers and scales are the
    quantized layer), and the model is not changed.

    Every other linear layer (``lm_head``) is listed in the config's ``ignore``.
    """
    _check_writable(config)
    target = parse_dtype(dtype)
    modules = dict(model.named_modules())
    linear = {name for name, module in modules.items() if isinstance(module, nn.Linear)}
    unknown = sorted(set(layers) - linear)
    if unknown:
        raise ValueError(f"quantized layers {unknown[:4]} are not linear layers of the model: "
                         f"expected names among {sorted(linear)[:4]}...")
    if not layers:
        raise ValueError("no quantized layer given: expected the packed integers of at least "
                         "one linear layer (a dense model is saved with save_model)")
    replace = {name: packed_tensors(name, tuple(modules[name].weight.shape), layer, config,
                                    target)
               for name, layer in layers.items()}
    ignore = sorted(linear - set(layers))
    return save_model(model, path, tokenizer, target, replace=replace,
                      config={"quantization_config": quantization_config(config, ignore)})


def packed_layers(model: nn.Module, quantized: Mapping[int, Mapping[str, Any]]
                  ) -> dict[str, PackedLinear]:
    """The :class:`PackedLinear` of every quantized linear layer, keyed by its module name in
    ``model``, from a run's per-decoder-layer :class:`~fedcompress.quant.solver.QuantResult`
    (``quantized[layer][linear name]``, as :attr:`~fedcompress.pruning.walker.WalkResult.quant`
    and the statistics-mode strategy keep them)."""
    from fedcompress.models import ModelAdapter

    prefix = ModelAdapter(model).layers_path
    return {f"{prefix}.{layer}.{name}": PackedLinear(
                result.q, result.scale, None if result.symmetric else result.zero_point,
                result.g_idx)
            for layer, results in sorted(quantized.items()) for name, result in results.items()}
