"""Memory of the sampling tables: an LRU cache with a byte budget and pooled rows."""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fedcompress.data.embeddings import DTYPE


class _LRU:
    """Least-recently-used cache with a byte budget; ``on_drop(value)`` is called for every
    value evicted, cleared or refused (larger than the budget)."""

    def __init__(self, max_bytes: int, on_drop: Callable[[Any], None]) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.on_drop = on_drop

    def get(self, key: Any) -> Any:
        item = self.data.get(key)
        if item is None:
            return None
        self.data.move_to_end(key)
        return item[0]

    def put(self, key: Any, value: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            self.on_drop(value)
            return
        self.data[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (dropped, freed) = self.data.popitem(last=False)
            self.bytes -= freed
            self.on_drop(dropped)

    def clear(self) -> None:
        for value, _ in self.data.values():
            self.on_drop(value)
        self.data.clear()
        self.bytes = 0


class _RowPool:
    """Fixed-length float32 rows carved from anonymous memory maps populated in one system call
    (``MAP_POPULATE``, Linux): writing a table into fresh memory otherwise page-faults 4 KiB at a
    time, which costs about as much as computing it. Rows given back are reused."""

    MAP_BYTES = 16 * 2**20

    def __init__(self, length: int) -> None:
        self.length = length
        self.free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        if not self.free:
            row_bytes = self.length * np.dtype(DTYPE).itemsize
            count = max(1, self.MAP_BYTES // row_bytes)
            size = count * row_bytes
            if hasattr(mmap, "MAP_POPULATE"):
                buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                   | mmap.MAP_POPULATE)
                rows = np.frombuffer(buffer, dtype=DTYPE).reshape(count, self.length)
            else:  # pragma: no cover - not Linux
                rows = np.empty((count, self.length), dtype=DTYPE)
            self.free.extend(rows)
        return self.free.pop()

    def give(self, rows: Iterable[np.ndarray]) -> None:
        self.free.extend(rows)
