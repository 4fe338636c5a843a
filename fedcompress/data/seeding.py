"""Derived, order-independent random generators.

Several places need one independent stream per named thing (per source corpus, per bundled
file). Deriving the stream from ``(seed, name)`` rather than from the position in a loop keeps a
stream identical when other names are added or reordered. Python's ``hash()`` is salted per
process, so names are turned into integers with CRC-32 instead.
"""

from __future__ import annotations

import zlib

import numpy as np

from fedcompress.data.errors import check_seed


def name_key(name: str) -> int:
    """A stable 32-bit integer for ``name`` (CRC-32 of its UTF-8 bytes)."""
    return zlib.crc32(name.encode("utf-8"))


def derived_rng(seed: int, *names: str) -> np.random.Generator:
    """A NumPy generator determined only by ``seed`` and the sequence of ``names``.

    ``derived_rng(s)`` with no names equals ``np.random.default_rng(s)``.
    """
    seed = check_seed(seed)
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=tuple(name_key(n) for n in names))
    return np.random.default_rng(sequence)
