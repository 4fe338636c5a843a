"""Shamir's secret sharing over the prime field GF(2^521 - 1), for SecAgg+'s seeds and mask keys
(:mod:`fedcompress.privacy.secagg`). Plain Python integers, no Flower.

A secret of up to 65 bytes (a 32-byte self-mask seed, a 48-byte P-384 private scalar) is ONE
field element, so a share is one evaluation of a random polynomial of degree ``t - 1`` whose
constant term is the secret and whose other coefficients come from OS entropy
(:func:`secrets.randbelow`): any ``t - 1`` shares are uniformly distributed whatever the secret
(information-theoretic secrecy), any ``t`` rebuild it by Lagrange interpolation at 0. A share is
its index (4 bytes, little-endian, from 1), the secret's length (1 byte) and its value
(66 bytes, big-endian).

Flower's shares (``flwr.common.secure_aggregation.crypto.shamir``, pycryptodome's
``Shamir`` over GF(2^128) on 16-byte chunks) are the same construction in another field; this
one costs a few big-integer products per share instead of hundreds of bitwise GF(2^128)
multiplications per chunk: the sites of
one vote all run this code, so nothing needs Flower's encoding.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fedcompress.privacy.secagg_lanes import SecAggError

#: The field's modulus: the Mersenne prime 2^521 - 1
PRIME = (1 << 521) - 1
#: Bytes of a share's value
VALUE_BYTES = 66
#: The longest secret: its integer stays below the prime
MAX_SECRET_BYTES = 65


class ShareError(SecAggError):
    """Shares that cannot be made or combined (named)."""


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` shares of ``secret`` (at most 65 bytes), any ``threshold`` of which rebuild it."""
    if not 1 <= len(secret) <= MAX_SECRET_BYTES:
        raise ShareError(f"a secret of {len(secret)} bytes: expected 1..{MAX_SECRET_BYTES}")
    if not 1 <= threshold <= num < 1 << 32:
        raise ShareError(f"threshold={threshold}, num={num}: expected 1 <= threshold <= num")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    head = len(secret).to_bytes(1, "big")
    out = []
    for x in range(1, num + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        out.append(x.to_bytes(4, "little") + head + y.to_bytes(VALUE_BYTES, "big"))
    return out


def _lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """The weights of the shares at ``xs`` in the interpolation at 0."""
    weights = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        weights.append(num * pow(den, -1, PRIME) % PRIME)
    return weights


def combine_shares(shares: Sequence[bytes]) -> bytes:
    """The secret of :func:`create_shares` from its shares (at least its threshold of them:
    fewer give a wrong value, which the caller's check of what it rebuilt refuses)."""
    if not shares:
        raise ShareError("no shares")
    xs, ys, lengths = [], [], set()
    for share in shares:
        share = bytes(share)
        if len(share) != 5 + VALUE_BYTES:
            raise ShareError(f"a share of {len(share)} bytes: expected {5 + VALUE_BYTES}")
        xs.append(int.from_bytes(share[:4], "little"))
        lengths.add(share[4])
        ys.append(int.from_bytes(share[5:], "big"))
    if len(set(xs)) != len(xs):
        raise ShareError("two shares with one index")
    if len(lengths) != 1 or not 1 <= min(lengths) <= MAX_SECRET_BYTES or 0 in xs \
            or max(ys) >= PRIME:
        raise ShareError("shares of different or invalid secrets")
    secret = sum(w * y for w, y in zip(_lagrange_at_zero(xs), ys)) % PRIME
    length = lengths.pop()
    if secret >= 1 << (8 * length):
        raise ShareError("the shares do not combine to a secret of their length")
    return secret.to_bytes(length, "big")
