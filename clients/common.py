"""What every fedcompress ClientApp shares: the base model, loaded once per process."""

from __future__ import annotations

import functools

import transformers

from fedcompress.models import load_model

# Many clients share a terminal: no per-client weight-loading bars.
transformers.utils.logging.disable_progress_bar()


@functools.lru_cache(maxsize=2)
def cached_model(spec: str, dtype: str):
    """``(model, tokenizer)`` of ``spec``, loaded once per process; callers never mutate it."""
    loaded = load_model(spec, device=None, dtype=dtype)
    return loaded.model, loaded.tokenizer
