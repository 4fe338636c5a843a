"""The arithmetic of SecAgg+ (:mod:`fedcompress.privacy.secagg`): a site's vector as lanes of
64-bit words (binary lanes of ``bits`` bits, or the digits of a radix: the narrowest packing the
sum's bound allows), lists as bytes for Flower's records, and the AES-CTR mask streams added in
place. Plain numpy and ``cryptography``, no Flower."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEED_BYTES = 32
#: The protocol's name and version, first in everything a site signs or derives
DOMAIN = b"fedcompress-secagg+/3"


class SecAggError(ValueError):
    """A SecAgg message or step is invalid (named)."""


# -- lanes ----------------------------------------------------------------------------------------
def lane_bits(n_sites: int) -> int:
    """Bits per coordinate that hold a sum of ``n_sites`` 0/1 votes: ``bit_length(n)``."""
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise SecAggError(f"n_sites={n_sites!r}: expected an int >= 1")
    return int(n_sites).bit_length()


def _check_bits(bits: int) -> None:
    if not (1 <= bits <= 32 or bits == 64):
        raise SecAggError(f"bits={bits}: expected 1..32 (lanes of a 64-bit word) or 64")


def pack_lanes(values: np.ndarray, bits: int) -> np.ndarray:
    """Non-negative integers ``< 2^bits`` -> uint64 words of ``64 // bits`` lanes each (lane
    ``l`` of word ``w`` is coordinate ``w * lanes + l``; zero-padded). ``bits=64``: one
    coordinate per word, given as uint64 (a signed value in two's complement,
    :func:`~fedcompress.methods.fedprllm.stats_wire.encode_fixed`)."""
    _check_bits(bits)
    v = np.asarray(values)
    if bits == 64:
        if v.ndim != 1 or v.dtype != np.uint64:
            raise SecAggError(f"64-bit lanes take a flat uint64 vector, got {v.dtype} "
                              f"{v.shape}")
        return v.copy()
    if v.ndim != 1 or (v.size and (v.min() < 0 or int(v.max()) >= 1 << bits)):
        raise SecAggError(f"values must be a flat vector in [0, 2^{bits})")
    lanes = 64 // bits
    padded = np.zeros(-(-v.size // lanes) * lanes, dtype=np.uint64)
    padded[:v.size] = v
    grid = padded.reshape(-1, lanes)
    words = np.zeros(grid.shape[0], dtype=np.uint64)
    for lane in range(lanes):
        words |= grid[:, lane] << np.uint64(bits * lane)
    return words


def unpack_lanes(words: np.ndarray, bits: int, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_lanes`: the first ``numel`` coordinates (int64; ``bits=64``: the
    words read as two's complement int64)."""
    _check_bits(bits)
    lanes = 64 // bits
    if words.dtype != np.uint64 or words.ndim != 1 or words.size != -(-numel // lanes):
        raise SecAggError(f"{words.size} words of {words.dtype} for {numel} coordinates in "
                          f"{bits}-bit lanes: expected {-(-numel // lanes)} uint64 words")
    if bits == 64:
        return words.view(np.int64).copy()
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((words.size, lanes), dtype=np.int64)
    for lane in range(lanes):
        out[:, lane] = (words >> np.uint64(bits * lane)) & mask
    return out.reshape(-1)[:numel]


def words_for(numel: int, bits: int) -> int:
    return -(-numel // (64 // bits))


def radix_lanes(radix: int) -> int:
    """Digits of base ``radix`` that one 64-bit word holds: the largest ``L`` with
    ``radix^L <= 2^64`` (17, the sum of 16 sites' votes: 15 digits, 4.27 bits each, against 12
    lanes of 5 bits)."""
    if isinstance(radix, bool) or not isinstance(radix, int) or radix < 2:
        raise SecAggError(f"radix={radix!r}: expected an int >= 2")
    lanes = 1
    while radix ** (lanes + 1) <= 1 << 64:
        lanes += 1
    return lanes


def pack_radix(values: np.ndarray, radix: int, limit: int) -> np.ndarray:
    """Integers in ``[0, limit]`` -> uint64 words of :func:`radix_lanes` digits of base ``radix``
    each (coordinate ``w * lanes + l`` is digit ``l`` of word ``w``, ``sum_l d_l radix^l``;
    zero-padded). The sum of ``n`` such vectors adds digit by digit without a carry while
    ``n * limit < radix``: the caller's bound (one word's digits then never reach ``2^64``).
    One compiled pass over ``values`` (:func:`_pack_radix_words`) checks and packs them."""
    if not 0 <= limit < radix:
        raise SecAggError(f"limit={limit}: expected 0 <= limit < radix={radix}")
    v = np.asarray(values)
    if v.ndim != 1 or v.dtype.kind not in "biu":
        raise SecAggError(f"values of {v.dtype} {v.shape}: expected a flat vector of integers "
                          f"in [0, {limit}]")
    lanes = radix_lanes(radix)
    words = np.empty(-(-v.size // lanes), dtype=np.uint64)
    if _pack_radix_words(np.ascontiguousarray(v), radix, limit, lanes, words):
        raise SecAggError(f"values must be a flat vector in [0, {limit}]")
    return words


def unpack_radix(words: np.ndarray, radix: int, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_radix` (and of the sum of packed vectors): the first ``numel``
    digits, int64. One compiled pass (:func:`_unpack_radix_words`)."""
    lanes = radix_lanes(radix)
    if words.dtype != np.uint64 or words.ndim != 1 or words.size != -(-numel // lanes):
        raise SecAggError(f"{words.size} words of {words.dtype} for {numel} coordinates of "
                          f"{lanes} base-{radix} digits: expected {-(-numel // lanes)} uint64 "
                          "words")
    out = np.empty(words.size * lanes, dtype=np.int64)
    _unpack_radix_words(np.ascontiguousarray(words), radix, lanes, out)
    return out[:numel]


@numba.njit(nogil=True, cache=True)
def _pack_radix_words(values, radix, limit, lanes, words):  # pragma: no cover - compiled
    """Horner's rule per word, highest digit first (every partial value below ``radix^lanes``
    <= 2^64, so exact; the missing top digits of the last word are zeros). Returns how many
    values lie outside ``[0, limit]`` (the words are then not to be used)."""
    base = np.uint64(radix)
    n = values.shape[0]
    bad = 0
    for w in range(words.shape[0]):
        first = w * lanes
        acc = np.uint64(0)
        for i in range(min(first + lanes, n) - 1, first - 1, -1):
            value = values[i]
            bad += (value < 0) | (value > limit)
            acc = acc * base + np.uint64(value)
        words[w] = acc
    return bad


@numba.njit(nogil=True, cache=True)
def _unpack_radix_words(words, radix, lanes, out):  # pragma: no cover - compiled
    """Every word's ``lanes`` digits of base ``radix``, lowest first, into ``out``. Compiled
    for each ``(radix, lanes)`` as constants of the code (``numba.literally``; cached on disk
    per radix): the compiler turns the division by a constant into a multiplication and a
    shift, ten times faster than a division by a variable."""
    numba.literally(radix)
    numba.literally(lanes)
    base = np.uint64(radix)
    for w in range(words.shape[0]):
        rest = words[w]
        first = w * lanes
        for lane in range(lanes):
            quotient = rest // base
            out[first + lane] = np.int64(rest - quotient * base)
            rest = quotient


# -- wire: lists as bytes (a record of scalars and bytes only) ---------------------------------
#: First byte of a packed list: never an empty value (Flower's record size count refuses empty
#: bytes and empty lists).
_LIST_TAG = b"L"


def _untag(data: bytes, what: str) -> bytes:
    data = bytes(data)
    if data[:1] != _LIST_TAG:
        raise SecAggError(f"{what}: not a packed list")
    return data[1:]


def pack_ints(values: Sequence[int]) -> bytes:
    """Non-negative ints as little-endian uint64 bytes (tagged)."""
    return _LIST_TAG + np.asarray(list(values), dtype="<u8").tobytes()


def unpack_ints(data: bytes, what: str = "ints") -> list[int]:
    body = _untag(data, what)
    if len(body) % 8:
        raise SecAggError(f"{what}: {len(body)} bytes, expected a multiple of 8")
    return [int(x) for x in np.frombuffer(body, dtype="<u8")]


def pack_blobs(blobs: Sequence[bytes]) -> bytes:
    """Byte strings, each prefixed by its uint32 length (tagged)."""
    return _LIST_TAG + b"".join(len(b).to_bytes(4, "little") + bytes(b) for b in blobs)


def unpack_blobs(data: bytes, what: str = "blobs") -> list[bytes]:
    body, out, i = _untag(data, what), [], 0
    while i < len(body):
        if i + 4 > len(body):
            raise SecAggError(f"{what}: truncated length at byte {i}")
        n = int.from_bytes(body[i:i + 4], "little")
        if i + 4 + n > len(body):
            raise SecAggError(f"{what}: an item of {n} bytes runs past the end")
        out.append(body[i + 4:i + 4 + n])
        i += 4 + n
    return out


# -- primitives -----------------------------------------------------------------------------------
def prg(seed: bytes, n_words: int) -> np.ndarray:
    """``n_words`` pseudo-random uint64 from a 32-byte key: AES-256-CTR of zeros. Never called
    on a raw seed or pairwise key, only on the per-vote, per-purpose key of
    :func:`mask_stream` (so the zero nonce is never reused under one key)."""
    if len(seed) != SEED_BYTES:
        raise SecAggError(f"a PRG seed of {len(seed)} bytes: expected {SEED_BYTES}")
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(stream.update(bytes(8 * n_words)), dtype="<u8").astype(np.uint64)


def _mask_key(secret: bytes, vote_id: bytes, purpose: bytes) -> bytes:
    if len(secret) != SEED_BYTES or len(vote_id) != 32:
        raise SecAggError(f"a mask secret of {len(secret)} bytes and a vote id of "
                          f"{len(vote_id)}: expected {SEED_BYTES} and 32")
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None,
                info=DOMAIN + b"/mask/" + purpose + b"/" + vote_id).derive(secret)


def mask_stream(secret: bytes, vote_id: bytes, purpose: bytes, n_words: int) -> np.ndarray:
    """The mask words of one purpose (``b"self"``: a self-mask seed; ``b"pair"``: a pairwise
    key) in one vote: :func:`prg` keyed by HKDF-SHA256 of ``secret`` with the protocol, the
    purpose and the vote id as info. Another vote (or purpose) gives an independent stream,
    even from the same secret. (The protocol adds the stream in place, :func:`apply_mask`;
    this array is the same stream, for tests and references.)"""
    return prg(_mask_key(secret, vote_id, purpose), n_words)


#: Words of keystream generated per step of :func:`apply_mask` (256 KiB): the piece stays in the
#: CPU's cache between its generation and its add, and no vector-sized stream is allocated.
MASK_CHUNK_WORDS = 1 << 15
_ZERO_CHUNK = bytes(8 * MASK_CHUNK_WORDS)


def apply_mask(words: np.ndarray, secret: bytes, vote_id: bytes, purpose: bytes,
               subtract: bool = False, threads: int = 1) -> None:
    """``words`` (uint64, contiguous) plus (``subtract``: minus) :func:`mask_stream` of the same
    secret, vote and purpose, modulo 2^64, in place: the AES-CTR keystream is written into one
    preallocated piece of :data:`MASK_CHUNK_WORDS` words at a time and added to its slice of
    ``words`` without a temporary. With ``threads`` > 1 the words are cut into that many runs
    of whole pieces, each masked on its own thread from its own place in the stream (CTR's
    counter started at the run's first block; the cipher and numpy's add release the GIL):
    the same words as one thread's."""
    if words.dtype != np.uint64 or not words.flags.c_contiguous or not words.flags.writeable:
        raise SecAggError(f"apply_mask needs writable contiguous uint64 words, got "
                          f"{words.dtype} (contiguous {words.flags.c_contiguous})")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SecAggError(f"threads={threads!r}: expected an int >= 1")
    key = _mask_key(secret, vote_id, purpose)
    flat = words.reshape(-1)
    pieces = -(-flat.size // MASK_CHUNK_WORDS)
    runs = min(threads, pieces)
    if runs <= 1:
        _mask_run(flat, key, 0, flat.size, subtract)
        return
    bounds = [min(flat.size, MASK_CHUNK_WORDS * (pieces * i // runs)) for i in range(runs + 1)]
    with ThreadPoolExecutor(runs) as pool:
        for done in [pool.submit(_mask_run, flat, key, a, b, subtract)
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True)]:
            done.result()


def _mask_run(flat: np.ndarray, key: bytes, start: int, stop: int, subtract: bool) -> None:
    """:func:`apply_mask` on ``flat[start:stop]``, ``start`` a whole number of AES blocks (two
    words) into the stream: the counter starts at block ``start // 2``."""
    stream = Cipher(algorithms.AES(key), modes.CTR((start // 2).to_bytes(16, "big"))
                    ).encryptor()
    piece = bytearray(8 * MASK_CHUNK_WORDS + 15)  # update_into wants block size - 1 spare
    zeros = memoryview(_ZERO_CHUNK)
    op = np.subtract if subtract else np.add
    with np.errstate(over="ignore"):
        for first in range(start, stop, MASK_CHUNK_WORDS):
            n = min(MASK_CHUNK_WORDS, stop - first)
            stream.update_into(zeros[:8 * n], piece)
            target = flat[first:first + n]
            op(target, np.frombuffer(piece, dtype="<u8", count=n), out=target)


def mask_threads() -> int:
    """The threads a party masks with: as many as its torch computations use (a Simulation
    Engine actor of one CPU: one; a process of its own: its cores). Only speed depends on it;
    the words are the same."""
    import torch

    return max(1, torch.get_num_threads())
