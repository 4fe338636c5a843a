"""What every module of :mod:`fedcompress.models` shares: the precision of the arithmetic on
model weights (and torch's thread count, :func:`torch_threads`), the errors raised while
resolving, loading or onloading a model, the cache root, the device and dtype choices, and
giving freed heap memory back to the system."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

#: Precision of every score, statistic and similarity computed on model weights/activations.
CALC_DTYPE = torch.float32
#: Precision of SparseGPT's Hessian: its accumulation over tokens, its sums over sites (on the
#: wire too) and its dampened inverse. float64 so that the Hessian of the same tokens summed in
#: any grouping (one centralized pass, or 16 sites' sums) agrees to ~1e-16 relative: the
#: ill-conditioned inverse would otherwise amplify float32's summation-order rounding into
#: different greedy choices (measured: 1.8% of the mask bits on SmolLM2 with float32).
HESSIAN_DTYPE = torch.float64


class ModelError(ValueError):
    """Base class of the errors raised while resolving or loading a model."""


class UnknownModelError(ModelError):
    """The spec names no embedded model, existing path or hub id."""


class MissingModelPackageError(ModelError):
    """An embedded model's PyPI package is not installed."""


class UnsupportedArchitectureError(ModelError):
    """The model's architecture is not one the layer adapter knows."""


class OnloadError(ModelError):
    """A model cannot be onloaded (not a local folder of safetensors, missing tensors)."""


def cache_dir() -> Path:
    """Root of fedcompress's cache: ``$FEDCOMPRESS_CACHE`` or ``~/.cache/fedcompress``."""
    return Path(os.environ.get("FEDCOMPRESS_CACHE", Path.home() / ".cache" / "fedcompress"))


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"float32"``/``"float16"``/``"bfloat16"`` (or a torch dtype) to a torch dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_free_memory() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). The walker frees a layer's tensors, scores and sort buffers after each layer,
    but the kept masks interleave with them in the heap, and without a trim the process grew by
    tens of MiB per layer though nothing was alive (measured on Qwen2.5-0.5B)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` inside the block (None: unchanged). A
    float sum split over threads adds in another order: a Ray actor of the Simulation Engine
    computes with one thread per CPU it is given (1 by default), so code that stands for a site
    in another process sets the actor's count to compute its floats bit for bit."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
