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
   private key into ``n`` Shamir shares of threshold ``t`` (:func:`create_shares`), and sends
   site ``j``'s pair of shares encrypted under the ECDH key of ``c_i`` and ``c_j``
   (:func:`agree`, Fernet); the server forwards them (it cannot read them).
3. *masked input*: ``y_i = x_i + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)``
   mod 2^64 per word, with ``s_ij`` the ECDH key of ``s_i`` and ``s_j``.
4. *unmask*: the server names the sites whose ``y`` arrived (survivors, at least ``t``) and the
   others (dropped); each survivor returns its share of ``b_j`` for every survivor ``j`` and of
   ``s_j``'s private key for every dropped ``j`` (never both for one site: checked); from ``t``
   shares the server rebuilds the seeds, removes ``PRG(b_j)`` of the survivors and the dropped
   sites' pairwise masks, and has the sum of the survivors' vectors.

**Primitives.** The same constructions as Flower's secure-aggregation primitives
(``flwr.common.secure_aggregation``), called on the libraries those wrap, since the library
imports no Flower (tests check the interoperability: keys, shares): ECDH on P-384 then
HKDF-SHA256 to 32 bytes; Fernet for the channel; Shamir's scheme over GF(2^128) on 16-byte chunks
of the padded secret (``pycryptodome``), a share being its 4-byte index and the chunks' shares.
**PRG**: AES-256 in counter mode keyed by the 32-byte seed or derived key, NOT Flower's
``pseudo_rand_gen``, whose numpy generator is seeded with 32 bits folded from the key (2^32
candidate masks: searchable by the server).

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


def _check_bits(bits: int) -> None:
    if not (1 <= bits <= 32 or bits == 64):
        raise SecAggError(f"bits={bits}: expected 1..32 (lanes of a 64-bit word) or 64")


def pack_lanes(values: np.ndarray, bits: int) -> np.ndarray:
    """Non-negative integers ``< 2^bits`` -> uint64 words of ``64 // bits`` lanes each (lane
    ``l`` of word ``w`` is coordinate ``w * lanes + l``; zero-padded). ``bits=64``: one
    coordinate per word, given as uint64 (a signed value in two's complement,
    :func:`~fedcompress.methods.fedprllm.stats.encode_fixed`)."""
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


def agree(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey) -> bytes:
    """32 bytes from an ECDH exchange: HKDF-SHA256 (no salt, no info) of the shared secret."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=None).derive(private.exchange(ec.ECDH(), public))


def _fernet(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey):
    import base64

    from cryptography.fernet import Fernet

    return Fernet(base64.urlsafe_b64encode(agree(private, public)))


def create_shares(secret: bytes, threshold: int, num: int) -> list[bytes]:
    """``num`` Shamir shares of ``secret``, any ``threshold`` of which rebuild it: the secret
    padded to 16-byte chunks (PKCS#7), each chunk split over GF(2^128); share ``k`` is its index
    ``k`` (4 bytes, from 1) followed by its share of every chunk."""
    from Crypto.Protocol.SecretSharing import Shamir
    from Crypto.Util.Padding import pad

    padded = pad(secret, 16)
    shares = [bytearray(k.to_bytes(4, "little")) for k in range(1, num + 1)]
    for start in range(0, len(padded), 16):
        for index, part in Shamir.split(threshold, num, padded[start:start + 16], False):
            shares[index - 1] += part
    return [bytes(s) for s in shares]


def combine_shares(shares: Sequence[bytes]) -> bytes:
    """The secret of :func:`create_shares` from at least its threshold of shares."""
    from Crypto.Protocol.SecretSharing import Shamir
    from Crypto.Util.Padding import unpad

    if not shares or len({len(s) for s in shares}) != 1 or (len(shares[0]) - 4) % 16:
        raise SecAggError("shares of different or invalid lengths")
    indices = [int.from_bytes(s[:4], "little") for s in shares]
    if len(set(indices)) != len(indices):
        raise SecAggError("two shares with one index")
    out = bytearray()
    for start in range(4, len(shares[0]), 16):
        out += Shamir.combine([(i, s[start:start + 16]) for i, s in zip(indices, shares)], False)
    try:
        return unpad(bytes(out), 16)
    except ValueError as err:
        raise SecAggError(f"shares do not combine to a padded secret: {err}") from None


def _pack_shares(src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """The plaintext of a pair of shares: source and destination (8 bytes each), the seed
    share's length (4 bytes), the seed share, the key share."""
    return (src.to_bytes(8, "little") + dst.to_bytes(8, "little")
            + len(seed_share).to_bytes(4, "little") + seed_share + key_share)


def _unpack_shares(plain: bytes) -> tuple[int, int, bytes, bytes]:
    if len(plain) < 20:
        raise SecAggError("a share plaintext of fewer than 20 bytes")
    n = int.from_bytes(plain[16:20], "little")
    if 20 + n > len(plain):
        raise SecAggError("a share plaintext shorter than its seed share")
    return (int.from_bytes(plain[:8], "little"), int.from_bytes(plain[8:16], "little"),
            plain[20:20 + n], plain[20 + n:])


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
        if not (lane_bits(len(nodes)) <= self.bits <= 32 or self.bits == 64):
            raise SecAggError(f"bits={self.bits}: the sum of {len(nodes)} sites' votes needs "
                              f"{lane_bits(len(nodes))}..32 (or 64: fixed-point sums)")

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

    def to_state(self) -> dict[str, bytes | int | bool | list[int] | list[bytes]]:
        """Everything this site holds between stages (its private keys included), as a flat
        record of bytes and ints: kept in the site's own state store between messages (a
        deployed site may run each message in a new process); never sent."""
        nodes = sorted(self._public)
        received = sorted(self._received)
        return {"node": self.node, "nodes": list(self.config.nodes),
                "threshold": self.config.threshold, "numel": self.config.numel,
                "bits": self.config.bits, "c": _private_bytes(self._c),
                "s": _private_bytes(self._s), "seed": self._seed,
                "public_nodes": nodes, "public_c": [self._public[n][0] for n in nodes],
                "public_s": [self._public[n][1] for n in nodes], "received_nodes": received,
                "received_seed": [self._received[n][0] for n in received],
                "received_key": [self._received[n][1] for n in received],
                "sent_masked": self._sent_masked}

    @classmethod
    def from_state(cls, state: Mapping) -> SecAggSite:
        """Inverse of :meth:`to_state`."""
        try:
            config = SecAggConfig(tuple(int(n) for n in state["nodes"]), int(state["threshold"]),
                                  int(state["numel"]), int(state["bits"]))
            site = cls.__new__(cls)
            site.node, site.config = int(state["node"]), config
            site._c = _load_private(bytes(state["c"]), "stored channel key")
            site._s = _load_private(bytes(state["s"]), "stored mask key")
            site._seed = bytes(state["seed"])
            site._public = {int(n): (bytes(c), bytes(s)) for n, c, s in zip(
                state["public_nodes"], state["public_c"], state["public_s"], strict=True)}
            site._received = {int(n): (bytes(a), bytes(b)) for n, a, b in zip(
                state["received_nodes"], state["received_seed"], state["received_key"],
                strict=True)}
            site._sent_masked = bool(state["sent_masked"])
        except (KeyError, TypeError, ValueError) as err:
            raise SecAggError(f"stored SecAgg state unusable: {err}") from None
        return site

    def advertise(self) -> tuple[bytes, bytes]:
        """Stage 1: the channel and mask public keys."""
        return _public_bytes(self._c), _public_bytes(self._s)

    def share(self, public: Mapping[int, tuple[bytes, bytes]]) -> dict[int, bytes]:
        """Stage 2: every other site's encrypted pair of shares (of ``b_i`` and of ``s_i``)."""
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
            out[node] = _fernet(self._c, _load_public(self._public[node][0],
                                                      f"node {node}")).encrypt(plain)
        return out

    def masked(self, values: np.ndarray, ciphertexts: Mapping[int, bytes]) -> np.ndarray:
        """Stage 3: decrypt the shares addressed to this site, then the masked vector."""
        from cryptography.fernet import InvalidToken

        if not self._public:
            raise SecAggError("masked input before the key shares (stage 2)")
        for src, blob in ciphertexts.items():
            if src not in self._public or src == self.node:
                raise SecAggError(f"shares from node {src}, which shared no keys")
            channel = _fernet(self._c, _load_public(self._public[src][0], f"node {src}"))
            try:
                s, d, seed_share, key_share = _unpack_shares(channel.decrypt(bytes(blob)))
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
                mask = prg(agree(self._s, _load_public(s_pub, f"node {node}")), words.size)
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
                except (ValueError, TypeError) as err:  # SecAggError is a ValueError
                    raise SecAggError(f"node {node}'s shares do not combine: {err}") from None
                if node in masked:
                    total -= prg(secret, cfg.n_words)
                    continue
                key = _load_private(secret, f"node {node}'s rebuilt key")
                if _public_bytes(key) != self.public[node][1]:
                    raise SecAggError(f"node {node}'s rebuilt key does not match its public key")
                for other in survivors:  # undo the dropped site's pairwise masks
                    mask = prg(agree(key, _load_public(self.public[other][1], f"node {other}")),
                               cfg.n_words)
                    total = total + mask if node < other else total - mask
        return unpack_lanes(total, cfg.bits, cfg.numel)
