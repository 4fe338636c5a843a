"""Secure aggregation of vote counts (SecAgg+, Bell et al. 2020, on the complete graph): the
server learns the SUM of the sites' integer vectors and nothing else, also when sites drop out
(up to ``n - threshold``). Plain functions and per-party state, no Flower: the Flower layer
carries the four stages' messages.

**What is summed.** Each site's vector is small non-negative integers (a prune mask: 0/1 per
weight). The sum of ``n`` sites fits in ``b = bit_length(n)`` bits per coordinate, so ``64 // b``
coordinates are packed as lanes of one uint64 word (:func:`pack_lanes`) and every word is masked
and summed mod 2^64: the masks cancel exactly and, since no lane's true sum reaches 2^b, no
carry crosses lanes (:func:`unpack_lanes`). A site uploads ``b`` bits per weight, against 1 bit
for the plain bit-packed mask: ``log2(n + 1)`` bits per coordinate is the least any masking
scheme can send, since a masked value must be uniform over a group that holds the sum.

**Stages** (``i``, ``j``: sites by node id; ``t``: threshold):

1. *advertise keys*: each site makes two P-384 key pairs, ``c`` (channel) and ``s`` (masks), and
   sends both public keys; the server broadcasts them all.
2. *share keys*: each site draws a 32-byte self-mask seed ``b_i``, splits ``b_i`` and its ``s``
   private key into ``n`` Shamir shares of threshold ``t`` (Flower's
   :func:`~flwr.common.secure_aggregation.crypto.shamir.create_shares`), and sends site ``j``'s
   pair of shares encrypted under the ECDH key of ``c_i`` and ``c_j``
   (:func:`~flwr.common.secure_aggregation.crypto.symmetric_encryption.generate_shared_key`,
   Fernet); the server forwards them (it cannot read them).
3. *masked input*: ``y_i = x_i + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)``
   mod 2^64 per word, with ``s_ij`` the ECDH key of ``s_i`` and ``s_j``.
4. *unmask*: the server names the sites whose ``y`` arrived (survivors, at least ``t``) and the
   others (dropped); each survivor returns its share of ``b_j`` for every survivor ``j`` and of
   ``s_j``'s private key for every dropped ``j`` (never both for one site: checked); from ``t``
   shares the server rebuilds the seeds, removes ``PRG(b_j)`` of the survivors and the dropped
   sites' pairwise masks, and has the sum of the survivors' vectors.

**PRG.** AES-256 in counter mode keyed by the 32-byte seed or derived key (``cryptography``),
not Flower's ``pseudo_rand_gen``, whose numpy generator is seeded with 32 bits folded from the
key (2^32 candidate masks: searchable by the server).

**Protects against** an honest-but-curious server, and up to ``t - 1`` colluding sites with
it: no coalition below the threshold learns a site's vector beyond what the sum reveals. **Does
not protect against** a malicious server that lies about who dropped in a way sites cannot
check (the SecAgg+ paper's consistency round is not implemented), sites that send a wrong
vector (the sum is exact, but of whatever was sent: sparsity or range proofs are out of scope,
so the Hamming defence of :mod:`fedcompress.masks.robust` is impossible here), or what the sum
itself reveals (with two sites, each learns the other's mask from the sum and its own).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

CURVE = ec.SECP384R1()
SEED_BYTES = 32


class SecAggError(ValueError):
    """A SecAgg message or step is invalid (named)."""


# -- lanes ----------------------------------------------------------------------------------------
def lane_bits(n_sites: int) -> int:
    """Bits per coordinate that hold a sum of ``n_sites`` 0/1 votes: ``bit_length(n)``."""
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise SecAggError(f"n_sites={n_sites!r}: expected an int >= 1")
    return int(n_sites).bit_length()


def pack_lanes(values: np.ndarray, bits: int) -> np.ndarray:
    """Non-negative integers ``< 2^bits`` -> uint64 words of ``64 // bits`` lanes each (lane
    ``l`` of word ``w`` is coordinate ``w * lanes + l``; zero-padded)."""
    if not 1 <= bits <= 32:
        raise SecAggError(f"bits={bits}: expected 1..32")
    v = np.asarray(values)
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
    """Inverse of :func:`pack_lanes`: the first ``numel`` coordinates (int64)."""
    lanes = 64 // bits
    if words.dtype != np.uint64 or words.ndim != 1 or words.size != -(-numel // lanes):
        raise SecAggError(f"{words.size} words of {words.dtype} for {numel} coordinates in "
                          f"{bits}-bit lanes: expected {-(-numel // lanes)} uint64 words")
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((words.size, lanes), dtype=np.int64)
    for lane in range(lanes):
        out[:, lane] = (words >> np.uint64(bits * lane)) & mask
    return out.reshape(-1)[:numel]


def words_for(numel: int, bits: int) -> int:
    return -(-numel // (64 // bits))


# -- primitives -----------------------------------------------------------------------------------
def prg(seed: bytes, n_words: int) -> np.ndarray:
    """``n_words`` pseudo-random uint64 from a 32-byte seed: AES-256-CTR of zeros."""
    if len(seed) != SEED_BYTES:
        raise SecAggError(f"a PRG seed of {len(seed)} bytes: expected {SEED_BYTES}")
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(stream.update(bytes(8 * n_words)), dtype="<u8").astype(np.uint64)


def _public_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.X962,
                                         serialization.PublicFormat.UncompressedPoint)


def _load_public(data: bytes, what: str) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(CURVE, bytes(data))
    except (ValueError, TypeError) as err:
        raise SecAggError(f"{what}: not a P-384 public key ({err})") from None


def _private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_private(data: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise SecAggError(f"{what}: not a private key ({err})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SecAggError(f"{what}: not an elliptic-curve private key")
    return key


def _agree(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey) -> bytes:
    """32-byte key of an ECDH exchange (Flower's HKDF-SHA256 derivation)."""
    import base64

    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    return base64.urlsafe_b64decode(generate_shared_key(private, public))


def _channel(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey) -> bytes:
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    return generate_shared_key(private, public)  # url-safe base64, Fernet's key format


def _pack_shares(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    return share_keys_plaintext_concat(src, dst, seed_share, key_share)


# -- the parties ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecAggConfig:
    """One aggregation: the sites (node ids), the threshold ``t``, the vector length and the
    lane width (default: enough for the sum of the sites' 0/1 votes)."""

    nodes: tuple[int, ...]
    threshold: int
    numel: int
    bits: int = 0

    def __post_init__(self) -> None:
        nodes = tuple(int(n) for n in self.nodes)
        if len(set(nodes)) != len(nodes) or len(nodes) < 2 or min(nodes) < 0:
            raise SecAggError(f"nodes {list(nodes)[:5]}: expected >= 2 distinct ids >= 0")
        object.__setattr__(self, "nodes", tuple(sorted(nodes)))
        if not 2 <= self.threshold <= len(nodes):
            raise SecAggError(f"threshold={self.threshold}: expected 2 <= t <= {len(nodes)} "
                              "sites")
        if self.numel < 1:
            raise SecAggError(f"numel={self.numel}: expected >= 1")
        if self.bits == 0:
            object.__setattr__(self, "bits", lane_bits(len(nodes)))
        if not lane_bits(len(nodes)) <= self.bits <= 32:
            raise SecAggError(f"bits={self.bits}: the sum of {len(nodes)} sites' votes needs "
                              f"{lane_bits(len(nodes))}..32")

    @property
    def n_words(self) -> int:
        return words_for(self.numel, self.bits)

    @property
    def upload_bytes(self) -> int:
        """Bytes of one site's masked vector."""
        return 8 * self.n_words


@dataclass
class SecAggSite:
    """One site's side of the protocol (its secrets never leave it except as shares)."""

    node: int
    config: SecAggConfig
    _c: ec.EllipticCurvePrivateKey = field(init=False, repr=False)
    _s: ec.EllipticCurvePrivateKey = field(init=False, repr=False)
    _seed: bytes = field(init=False, repr=False)
    _public: dict[int, tuple[bytes, bytes]] = field(init=False, default_factory=dict)
    _received: dict[int, tuple[bytes, bytes]] = field(init=False, default_factory=dict)
    _sent_masked: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.node not in self.config.nodes:
            raise SecAggError(f"node {self.node} is not one of the aggregation's sites")
        self._c = ec.generate_private_key(CURVE)
        self._s = ec.generate_private_key(CURVE)
        self._seed = secrets.token_bytes(SEED_BYTES)

    def advertise(self) -> tuple[bytes, bytes]:
        """Stage 1: the channel and mask public keys."""
        return _public_bytes(self._c), _public_bytes(self._s)

    def share(self, public: Mapping[int, tuple[bytes, bytes]]) -> dict[int, bytes]:
        """Stage 2: every other site's encrypted pair of shares (of ``b_i`` and of ``s_i``)."""
        from flwr.common.secure_aggregation.crypto.shamir import create_shares
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt

        if set(public) - set(self.config.nodes) or self.node not in public:
            raise SecAggError(f"public keys of nodes {sorted(public)[:5]}: expected this site "
                              "and only the aggregation's sites")
        if len(public) < self.config.threshold:
            raise SecAggError(f"{len(public)} sites advertised keys, below the threshold "
                              f"{self.config.threshold}")
        if tuple(public[self.node]) != self.advertise():
            raise SecAggError("the server relayed another public key for this site")
        for node, (c, s) in public.items():
            _load_public(c, f"node {node}'s channel key")
            _load_public(s, f"node {node}'s mask key")
        self._public = {n: (bytes(c), bytes(s)) for n, (c, s) in public.items()}
        order = sorted(self._public)
        seed_shares = create_shares(self._seed, self.config.threshold, len(order))
        key_shares = create_shares(_private_bytes(self._s), self.config.threshold, len(order))
        out: dict[int, bytes] = {}
        for k, node in enumerate(order):
            plain = _pack_shares(self.node, node, seed_shares[k], key_shares[k])
            if node == self.node:
                self._received[node] = (seed_shares[k], key_shares[k])
                continue
            key = _channel(self._c, _load_public(self._public[node][0], f"node {node}"))
            out[node] = encrypt(key, plain)
        return out

    def masked(self, values: np.ndarray, ciphertexts: Mapping[int, bytes]) -> np.ndarray:
        """Stage 3: decrypt the shares addressed to this site, then the masked vector."""
        from cryptography.fernet import InvalidToken
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
        from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

        if not self._public:
            raise SecAggError("masked input before the key shares (stage 2)")
        for src, blob in ciphertexts.items():
            if src not in self._public or src == self.node:
                raise SecAggError(f"shares from node {src}, which shared no keys")
            key = _channel(self._c, _load_public(self._public[src][0], f"node {src}"))
            try:
                s, d, seed_share, key_share = share_keys_plaintext_separate(
                    decrypt(key, bytes(blob)))
            except (InvalidToken, ValueError, TypeError) as err:
                raise SecAggError(f"shares from node {src} do not decrypt: {err!r}") from None
            if (s, d) != (src, self.node):
                raise SecAggError(f"shares from node {src} name ({s} -> {d}): relayed wrongly")
            self._received[src] = (seed_share, key_share)
        words = pack_lanes(np.asarray(values), self.config.bits)
        if words.size != self.config.n_words:
            raise SecAggError(f"a vector of {np.asarray(values).size} coordinates: expected "
                              f"{self.config.numel}")
        with np.errstate(over="ignore"):
            words = words + prg(self._seed, words.size)
            for node, (_, s_pub) in self._public.items():
                if node == self.node:
                    continue
                mask = prg(_agree(self._s, _load_public(s_pub, f"node {node}")), words.size)
                words = words + mask if self.node < node else words - mask
        self._sent_masked = True
        return words

    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]) -> dict[int, bytes]:
        """Stage 4: this site's share of ``b_j`` for every survivor and of ``s_j`` for every
        dropped site (a site named in both is refused: its vector would be exposed)."""
        survivors, dropped = set(survivors), set(dropped)
        if not self._sent_masked:
            raise SecAggError("unmask before this site sent its masked vector")
        if survivors & dropped:
            raise SecAggError(f"nodes {sorted(survivors & dropped)} named both survivor and "
                              "dropped: refused (their vector would be exposed)")
        if self.node not in survivors or len(survivors) < self.config.threshold:
            raise SecAggError(f"{len(survivors)} survivors (this site "
                              f"{'in' if self.node in survivors else 'not in'} them): expected "
                              f"at least the threshold {self.config.threshold}")
        if (survivors | dropped) - set(self._public):
            raise SecAggError(f"nodes {sorted((survivors | dropped) - set(self._public))} "
                              "shared no keys")
        out = {}
        for node in survivors | dropped:
            if node not in self._received:
                continue  # its shares never reached this site
            seed_share, key_share = self._received[node]
            out[node] = seed_share if node in survivors else key_share
        return out


@dataclass
class SecAggServer:
    """The server's side: relays, and rebuilds the sum from the masked vectors and shares."""

    config: SecAggConfig
    public: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)

    def relay(self, shares: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Stage 2 -> 3: ``shares[src][dst]`` regrouped per destination."""
        out: dict[int, dict[int, bytes]] = {}
        for src, per_dst in shares.items():
            for dst, blob in per_dst.items():
                out.setdefault(dst, {})[src] = blob
        return out

    def aggregate(self, masked: Mapping[int, np.ndarray], shares: Mapping[int, Mapping[int, bytes]]
                  ) -> np.ndarray:
        """Stage 4: the sum of the survivors' vectors (int64, ``numel``) from their masked
        vectors (``masked[node]``) and the survivors' shares (``shares[holder][node]``)."""
        from flwr.common.secure_aggregation.crypto.shamir import combine_shares

        cfg = self.config
        survivors = sorted(masked)
        keyed = sorted(self.public)
        dropped = [n for n in keyed if n not in masked]
        if len(survivors) < cfg.threshold:
            raise SecAggError(f"{len(survivors)} masked vectors: below the threshold "
                              f"{cfg.threshold}")
        if set(survivors) - set(keyed):
            raise SecAggError(f"masked vectors from nodes {sorted(set(survivors) - set(keyed))} "
                              "that shared no keys")
        for node, words in masked.items():
            if not isinstance(words, np.ndarray) or words.dtype != np.uint64 \
                    or words.shape != (cfg.n_words,):
                raise SecAggError(f"node {node}'s masked vector: expected {cfg.n_words} uint64 "
                                  "words")
        total = np.zeros(cfg.n_words, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for node in survivors:
                total += masked[node]
            for node in survivors + dropped:
                got = [h[node] for h in shares.values() if node in h]
                if len(got) < cfg.threshold:
                    raise SecAggError(f"{len(got)} shares of node {node}'s "
                                      f"{'seed' if node in masked else 'key'}: below the "
                                      f"threshold {cfg.threshold}")
                try:
                    secret = combine_shares(list(got[:cfg.threshold]))
                except (ValueError, TypeError) as err:
                    raise SecAggError(f"node {node}'s shares do not combine: {err}") from None
                if node in masked:
                    total -= prg(secret, cfg.n_words)
                    continue
                key = _load_private(secret, f"node {node}'s rebuilt key")
                if _public_bytes(key) != self.public[node][1]:
                    raise SecAggError(f"node {node}'s rebuilt key does not match its public key")
                for other in survivors:  # undo the dropped site's pairwise masks
                    mask = prg(_agree(key, _load_public(self.public[other][1], f"node {other}")),
                               cfg.n_words)
                    total = total + mask if node < other else total - mask
        return unpack_lanes(total, cfg.bits, cfg.numel)
