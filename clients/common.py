"""What every fedcompress ClientApp shares: the base model, loaded once per process."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from clients import startup


@functools.lru_cache(maxsize=2)
def cached_model(spec: str, dtype: str, onload: bool = False):
    """``(model, tokenizer)`` of ``spec``, loaded once per process; callers never mutate it.
    ``onload``: a skeleton whose decoder layers the calibration walker reads one at a time
    (sequential onloading: the site never holds the whole model). Timed into this process's
    start-up (:mod:`clients.startup`): transformers and the architecture's code as imports, the
    model (memory-mapped from the site's safetensors cache) and its tokenizer as loading."""
    with startup.timed(startup.IMPORT):
        import transformers

        from fedcompress.models import import_model_code, load_model

        # Many clients share a terminal: no per-client weight-loading bars.
        transformers.utils.logging.disable_progress_bar()
        import_model_code(spec)
    with startup.timed(startup.LOAD):
        loaded = load_model(spec, device=None, dtype=dtype, onload=onload)
    return loaded.model, loaded.tokenizer


T = TypeVar("T")
logger = logging.getLogger(__name__)


def site_partition(context: Any, clients: int) -> int:
    """This node's ``partition-id`` (its SuperNode ``--node-config``), checked against the
    run's number of sites."""
    partition = int(context.node_config.get("partition-id", -1))
    if not 0 <= partition < clients:
        raise ValueError(f"node partition-id {partition} is outside [0, {clients})")
    return partition


def with_data_path(context: Any, load: Callable[[str | None], T]) -> T:
    """``load(data_path)`` with this node's ``data-path`` (None: the run's corpora); a path
    that cannot be used is a :class:`~fedcompress.privacy.site.SiteError` naming the key and
    whether the path exists (the path itself and the loader's message, which may quote a
    record, go to the site's log only)."""
    from fedcompress.privacy.site import SiteError

    data_path = context.node_config.get("data-path")
    try:
        return load(data_path)
    except (OSError, ValueError) as err:
        missing = isinstance(err, FileNotFoundError) or "does not exist" in str(err)
        logger.error("this site's data-path %r cannot be used: %s", data_path, err)
        raise SiteError("this site's data-path (SuperNode --node-config data-path) cannot be "
                        f"used: {'it does not exist' if missing else type(err).__name__}; the "
                        "site's log names the file") from err
