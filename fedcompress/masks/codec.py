"""Wire format of prune masks: bit-packing (1 bit per weight), with validation on decode.

``encode_mask`` -> a flat ``uint8`` array (numpy, as Flower's ArrayRecord carries) of
``ceil(numel / 8)`` bytes, most significant bit first (``numpy.packbits``), zero-padded.
``decode_mask`` checks the dtype, the exact byte length and that the padding bits are zero, so a
truncated or corrupted payload is refused with a clear error instead of being mis-read.
"""

from __future__ import annotations

import numpy as np
import torch


class MaskDecodeError(ValueError):
    """A payload is not a valid bit-packed mask of the expected shape."""


def mask_key(layer: int, name: str) -> str:
    """Wire name of the mask of linear layer ``name`` in decoder layer ``layer``."""
    return f"layers.{layer}.{name}"


def key_mismatch(expected, got) -> str | None:
    """``None`` when the two sets of mask names are equal, else a message naming the
    differences (the first three of each)."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if not missing and not extra:
        return None
    return (f"mask names do not match the model: missing {missing[:3]}"
            f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
            f"{'...' if len(extra) > 3 else ''}")


def packed_nbytes(shape: tuple[int, ...]) -> int:
    return (int(np.prod(shape)) + 7) // 8


def encode_mask(mask: torch.Tensor) -> np.ndarray:
    if mask.dtype != torch.bool:
        raise TypeError(f"a prune mask must be bool, got {mask.dtype}")
    return np.packbits(mask.detach().cpu().numpy().reshape(-1))


def check_packed(payload: np.ndarray, shape: tuple[int, ...], name: str = "mask") -> int:
    """Validate a bit-packed payload for ``shape`` without unpacking it (dtype, exact length,
    zero padding bits); returns the number of set bits (pruned weights)."""
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8:
        kind = payload.dtype if isinstance(payload, np.ndarray) else type(payload).__name__
        raise MaskDecodeError(f"{name}: expected a uint8 bit-packed array, got {kind}")
    numel = int(np.prod(shape))
    expected = packed_nbytes(shape)
    if payload.ndim != 1 or payload.size != expected:
        raise MaskDecodeError(f"{name}: payload of {payload.size} bytes (shape "
                              f"{payload.shape}), expected {expected} bytes for shape "
                              f"{tuple(shape)}")
    pad = 8 * expected - numel
    if pad and int(payload[-1]) & ((1 << pad) - 1):
        raise MaskDecodeError(f"{name}: non-zero padding bits: payload corrupted")
    return int(np.bitwise_count(payload).sum(dtype=np.int64))


def decode_mask(payload: np.ndarray, shape: tuple[int, ...], name: str = "mask") -> torch.Tensor:
    check_packed(payload, shape, name)
    numel = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(payload, count=numel).astype(bool).reshape(shape))
