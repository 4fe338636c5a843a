"""Secure aggregation of vote counts (SecAgg+, Bell et al. 2020, on a sparse masking graph
derived from the sites' fresh keys (:mod:`fedcompress.privacy.secagg_graph`), with the
authenticated key agreement and the consistency round of Bonawitz et al. CCS'17 §4): the server
learns the SUM of the sites' integer vectors and nothing else, also when sites drop out (up to
``n - threshold``), and also when it deviates from the protocol. Plain functions and per-party
state, no Flower: the Flower layer carries the five stages' messages.

**What is summed.** Each site's vector is small non-negative integers (a prune mask: 0/1 per
weight). The sum of ``n`` sites' votes is at most ``n``, so each coordinate is a digit of base
``n + 1`` and one uint64 word holds as many digits as ``(n + 1)^L <= 2^64`` allows
(:func:`~fedcompress.privacy.secagg_lanes.pack_radix`: 15 for 16 sites, 10 for 64); every word
is masked and summed mod 2^64: the masks cancel exactly and, since no digit's true sum reaches
``n + 1``, no carry crosses digits (:func:`~fedcompress.privacy.secagg_lanes.unpack_radix`).
A site uploads ``64 / L`` bits per weight (4.27 for 16 sites), against 1 bit for the plain
bit-packed mask: ``log2(n + 1)`` bits per coordinate (4.09) is the least any masking scheme
can send, since a masked value must be uniform over a group that holds the sum. Statistics
(``bits=64``) take one fixed-point value per word; binary lanes of ``bits`` bits
(:func:`pack_lanes`) remain for explicit widths.

**One vote** (:class:`SecAggConfig`): the run, round and layer, the sites' number ``n`` (indices
``0..n-1``), the threshold ``t``, the vector length and lane width; its digest
(:attr:`SecAggConfig.vote_id`) is in every signature, share plaintext and mask stream of the
vote. **Stages** (each once, in this order, at a site: :class:`SecAggSite` is a state machine
that refuses a repeated, out-of-order or other-vote stage; ``i``, ``j``: site indices):

1. *keys* (U1): each site checks ``t`` against its own minimum (its policy, from the size of
   the federation), makes two fresh P-384 key pairs, ``c`` (channel) and ``s`` (masks), and a
   fresh 32-byte self-mask seed ``b_i`` (OS entropy; never recorded, never sent), and sends
   ``c_pub, s_pub`` signed with its long-term identity key (ECDSA-SHA384 over the vote id, its
   index and both keys; :class:`Advert`).
2. *share* (U2): each site verifies every relayed advertisement against the federation's public
   keys that it holds itself (an unknown, unsigned, duplicated or swapped key refuses the
   vote; its own must come back unchanged), derives the masking graph from them (every site
   derives the same one from the same advertisements), splits ``b_i`` and its ``s`` private key
   into Shamir shares among itself and its ``k`` neighbours (threshold ``k / 2 + 1``; the
   vote's ``t`` on the complete graph; :func:`create_shares`) and sends neighbour ``j``'s pair
   encrypted under the ECDH key of ``c_i`` and ``c_j`` (Fernet; the plaintext names the graph's
   seed, which binds the vote and the advertisements, the source and the destination).
3. *masked input* (U3): the neighbours whose shares reached a site form its U2 (itself
   included, at least the share threshold; shares from a site that is not a neighbour, or made
   under another graph, are refused); ``y_i = x_i + PRG(b_i) + sum_{j in U2, j > i}
   PRG(s_ij) - sum_{j in U2, j < i} PRG(s_ij)`` mod 2^64 per word, every stream keyed by HKDF of
   its secret with the vote id and its purpose as info (:func:`mask_stream`), so no two
   uploads of any vote share a stream.
4. *confirm* (consistency round): the server announces the survivor set U3 (the sites whose
   ``y`` arrived); each survivor checks it (sites that advertised keys, its neighbours among
   them in its U2, at least ``t``, itself in it, and no ``secagg-max-colluders`` survivors
   whose removal cuts the survivors' masking graph: :func:`~.secagg_graph.cut_of`) and signs
   (graph seed, U3).
5. *unmask*: the server relays the signatures; a site reveals shares only after at least ``t``
   valid signatures on the SAME U3 from distinct authenticated survivors; it returns its share
   of ``b_j`` for every neighbour ``j`` in U3 and of ``s_j``'s private key for every ``j`` in
   U2 \\ U3 (it computes U2 \\ U3 itself, so never both for one site); from each
   neighbourhood's threshold of shares the server
   rebuilds the seeds, removes ``PRG(b_j)`` of the survivors and the dropped sites' pairwise
   masks, and has the sum of the survivors' vectors.

A site lost between *keys* and *share* is simply not in U2 (nobody masks with it); one lost
between *share* and *masked* is in U2 \\ U3 (its pairwise masks undone from the others'
shares); one lost after *masked* still counts (its seed rebuilt from its neighbours' shares).

**Primitives.** Flower's secure-aggregation key agreement and channel
(``flwr.common.secure_aggregation``), called on the library it wraps, since the library imports
no Flower (a test checks that the keys agree with Flower's): ECDH on P-384 then HKDF-SHA256 to
32 bytes (:func:`agree`); Fernet for the channel. **Shares**: Shamir's scheme over the prime
field GF(2^521 - 1), one field element per secret (:mod:`fedcompress.privacy.shamir`; the mask
key shared as its 48-byte scalar), NOT Flower's pycryptodome shares over GF(2^128) on 16-byte
chunks, whose pure-Python field arithmetic made rebuilding the seeds (one per survivor and
vote) most of the server's unmasking.
**PRG**: AES-256 in counter mode keyed by an HKDF-SHA256 expansion of the seed or pairwise key
with the vote id as info, NOT Flower's ``pseudo_rand_gen``, whose numpy generator is seeded
with 32 bits folded from the key (2^32 candidate masks: searchable).

**Protects against** a malicious server (it may drop, reorder, replay, forge or withhold any
message) when the sites are authenticated (a PKI of the sites' long-term P-384 keys, e.g. the
keys SuperNodes register for node authentication, reaching each site by its own node config),
together with up to ``t - 1`` colluding sites: the server learns at most one sum per vote, over
at least ``t`` sites that all confirmed the same survivor set. In particular: a second masked
request, a split view of the survivors, swapped or invented (Sybil) keys, a threshold below the
site's own minimum, a stage replayed from or addressed to another vote or layer, each refused.
A site takes nothing of this from the server: its threshold floor comes from its policy, its
peers' keys from its own folder, its secrets from OS entropy.

**Does not protect against**: sites that send a wrong vector (the sum is exact, but of whatever
was sent: no range or sparsity proofs, so the Hamming defence of :mod:`fedcompress.masks.robust`
is impossible here); what the sum itself reveals (with ``t`` sites of which ``t - 1`` collude,
the sum gives away the last one's vector; with two sites, each learns the other's); a server
that controls the distribution of the peers' public keys (then it can be every peer); more
than ``t - 1`` colluding sites; votes repeated over different runs on the same input (a site
refuses a second vote on a layer within a run, but a new run is a new vote: differencing sums
over different survivor sets across runs is a policy question of how many runs a site answers);
traffic analysis (who dropped). **In simulation** (no keys configured) the advertisements are
unsigned and there is no consistency round: then only an honest-but-curious server is
covered, and :attr:`SecAggSite.authenticated` says so for the report.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec

from fedcompress.privacy.secagg_graph import (
    check_neighbours,
    cut_of,
    default_neighbours,
    effective_neighbours,
    graph_seed,
    masking_graph,
    share_threshold,
)
from fedcompress.privacy.secagg_keys import (  # noqa: F401 (the protocol's public names)
    CURVE,
    Advert,
    _blob,
    _check_p384,
    _fernet,
    _key_from_scalar,
    _load_private,
    _load_public,
    _pack_shares,
    _private_bytes,
    _public_bytes,
    _scalar_bytes,
    _sign,
    _unpack_shares,
    _verifies,
    advert_payload,
    agree,
    identity_public,
    load_identity,
    load_peers,
    load_public_key,
    site_credentials,
    survivors_payload,
)
from fedcompress.privacy.secagg_lanes import (  # noqa: F401 (the protocol's public names)
    DOMAIN,
    MASK_CHUNK_WORDS,
    SEED_BYTES,
    SecAggError,
    apply_mask,
    lane_bits,
    mask_stream,
    mask_threads,
    pack_blobs,
    pack_ints,
    pack_lanes,
    pack_radix,
    prg,
    radix_lanes,
    unpack_blobs,
    unpack_ints,
    unpack_lanes,
    unpack_radix,
    words_for,
)
from fedcompress.privacy.shamir import combine_shares, create_shares  # noqa: F401

#: The stages of one vote at a site, in order
STAGES = ("keys", "share", "masked", "confirm", "unmask")

logger = logging.getLogger(__name__)


# -- the parties ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecAggConfig:
    """One vote: the sites (indices or node ids), the threshold ``t``, the vector length and
    the lane width (default: enough for the sum of the sites' 0/1 votes), the run, round
    and layer it belongs to (``layer=-1``: every layer at once), and the masking graph's degree
    ``neighbours`` (default :func:`~fedcompress.privacy.secagg_graph.default_neighbours`;
    ``>= n - 1``: the complete graph, stored as ``n - 1``)."""

    nodes: tuple[int, ...]
    threshold: int
    numel: int
    bits: int = 0
    run: int = 0
    round: int = 0
    layer: int = -1
    neighbours: int = 0

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
        if self.bits and not (lane_bits(len(nodes)) <= self.bits <= 32 or self.bits == 64):
            raise SecAggError(f"bits={self.bits}: the sum of {len(nodes)} sites' votes needs "
                              f"{lane_bits(len(nodes))}..32 bits (binary lanes), 0 (digits "
                              f"of base {len(nodes) + 1}) or 64 (fixed-point sums)")
        k = default_neighbours(len(nodes)) if self.neighbours == 0 else self.neighbours
        problem = check_neighbours(k, len(nodes))
        if problem:
            raise SecAggError(problem)
        object.__setattr__(self, "neighbours", effective_neighbours(k, len(nodes)))

    @property
    def radix(self) -> int:
        """``bits=0``: the base of the lanes' digits, ``n + 1`` (a sum of ``n`` 0/1 votes is at
        most ``n``); else 0 (binary lanes of ``bits``)."""
        return len(self.nodes) + 1 if self.bits == 0 else 0

    @property
    def lanes(self) -> int:
        """Coordinates per 64-bit word."""
        return radix_lanes(self.radix) if self.radix else 64 // self.bits

    @property
    def n_words(self) -> int:
        return -(-self.numel // self.lanes)

    def pack(self, values: np.ndarray) -> np.ndarray:
        """One site's vector as this vote's words: 0/1 votes as base-``n + 1`` digits
        (:func:`pack_radix`), else :func:`pack_lanes` of ``bits``."""
        if self.radix:
            return pack_radix(values, self.radix, 1)
        return pack_lanes(np.asarray(values), self.bits)

    def unpack(self, words: np.ndarray) -> np.ndarray:
        """The summed words' ``numel`` coordinates (int64)."""
        if self.radix:
            return unpack_radix(words, self.radix, self.numel)
        return unpack_lanes(words, self.bits, self.numel)

    @property
    def upload_bytes(self) -> int:
        """Bytes of one site's masked vector."""
        return 8 * self.n_words

    @property
    def vote_id(self) -> bytes:
        """32 bytes naming this vote (every field): in every signature, share and mask stream."""
        text = (f"{self.run}|{self.round}|{self.layer}|{','.join(map(str, self.nodes))}|"
                f"{self.threshold}|{self.numel}|{self.bits}|{self.neighbours}")
        return hashlib.sha256(DOMAIN + b"/vote/" + text.encode()).digest()

    @property
    def slot(self) -> bytes:
        """The input this vote sums: (run, layer). A site takes part in one vote per slot."""
        return hashlib.sha256(DOMAIN + b"/slot/" + f"{self.run}|{self.layer}".encode()
                              ).digest()[:16]

    def describe(self) -> str:
        return (f"vote of run {self.run}, round {self.round}, "
                f"{'every layer' if self.layer < 0 else f'layer {self.layer}'}")


def majority(sites: int) -> int:
    """The smallest threshold a site accepts by default: more than half the sites (>= 2)."""
    return max(2, sites // 2 + 1)


@dataclass
class SecAggSite:
    """One site's side of one vote: a state machine over :data:`STAGES` (each stage once, in
    order; the consistency round may be skipped only unauthenticated); a refused stage aborts
    the vote. Constructing it is the keys stage: fresh keys and seed from OS entropy.

    ``min_threshold``: the site's own floor (default :func:`majority` of the vote's sites);
    ``identity`` and ``peers`` (both or neither): its long-term P-384 key and the federation's
    public keys (:func:`load_identity`, :func:`load_peers`): the vote is then authenticated;
    ``history``: the slots of the votes this site already began in this run;
    ``min_neighbours``: the least degree of the masking graph it accepts (default
    :func:`~fedcompress.privacy.secagg_graph.default_neighbours` of the federation);
    ``max_colluders``: the sites it assumes may collude with the server (its neighbourhood's
    share threshold must exceed it, and no that many survivors may cut the survivors' graph)."""

    node: int
    config: SecAggConfig
    min_threshold: int | None = None
    identity: ec.EllipticCurvePrivateKey | None = field(default=None, repr=False)
    peers: Mapping[bytes, str] | None = field(default=None, repr=False)
    history: tuple[bytes, ...] = ()
    min_neighbours: int | None = None
    max_colluders: int = 1
    _c: ec.EllipticCurvePrivateKey | None = field(init=False, repr=False, default=None)
    _s: ec.EllipticCurvePrivateKey | None = field(init=False, repr=False, default=None)
    _seed: bytes = field(init=False, repr=False, default=b"")
    _advert: Advert = field(init=False, repr=False, default=Advert(b"", b""))
    _u1: dict[int, Advert] = field(init=False, repr=False, default_factory=dict)
    _u2: tuple[int, ...] = field(init=False, default=())
    #: the masking graph's seed and every site's neighbours (set by the share stage)
    _view: bytes = field(init=False, repr=False, default=b"")
    _graph: dict[int, frozenset[int]] = field(init=False, repr=False, default_factory=dict)
    _received: dict[int, tuple[bytes, bytes]] = field(init=False, repr=False,
                                                      default_factory=dict)
    _survivors: tuple[int, ...] = field(init=False, default=())
    _done: list[str] = field(init=False, default_factory=list)
    _aborted: str = field(init=False, default="")

    def __post_init__(self) -> None:
        cfg = self.config
        if self.node not in cfg.nodes:
            raise SecAggError(f"node {self.node} is not one of the vote's sites")
        if (self.identity is None) != (self.peers is None):
            raise SecAggError("an authenticated vote needs both this site's identity key and "
                              "the federation's public keys")
        federation = len(cfg.nodes)
        if self.identity is not None:
            assert self.peers is not None
            _check_p384(self.identity, "this site's identity key")
            if identity_public(self.identity) not in self.peers:
                raise SecAggError("this site's own identity key is not among the federation's "
                                  "public keys: refused")
            federation = len(self.peers)
            if len(cfg.nodes) > federation:
                raise SecAggError(f"a vote of {len(cfg.nodes)} sites in a federation of "
                                  f"{federation} authenticated sites: refused (Sybil sites)")
        floor = majority(federation) if self.min_threshold is None else int(self.min_threshold)
        self.min_threshold = floor
        if cfg.threshold < floor:
            raise SecAggError(f"threshold={cfg.threshold} is below this site's minimum "
                              f"{floor} for a federation of {federation} sites: refused (fewer "
                              "colluders could unmask a site; its policy: node config "
                              "secagg-min-fraction, secagg-max-colluders)")
        self._check_graph(federation)
        if cfg.slot in self.history:
            raise SecAggError(f"{cfg.describe()}: this site already took part in a vote on "
                              "this input: refused (a second vote lets the server difference "
                              "the sums or the masked uploads)")
        self.history = (*self.history, cfg.slot)
        self._c = ec.generate_private_key(CURVE)
        self._s = ec.generate_private_key(CURVE)
        self._seed = secrets.token_bytes(SEED_BYTES)
        c, s = _public_bytes(self._c), _public_bytes(self._s)
        if self.identity is None:
            self._advert = Advert(c, s)
        else:
            self._advert = Advert(c, s, _sign(self.identity, advert_payload(
                cfg.vote_id, self.node, c, s)), identity_public(self.identity))
        self._done = ["keys"]

    def _check_graph(self, federation: int) -> None:
        """Refuse a masking graph of a degree below this site's floor, or whose neighbourhood
        threshold the colluders it assumes could reach."""
        cfg, sites = self.config, len(self.config.nodes)
        floor = (default_neighbours(max(federation, 2)) if self.min_neighbours is None
                 else int(self.min_neighbours))
        self.min_neighbours = floor
        if cfg.neighbours < min(floor, sites - 1):
            raise SecAggError(f"a masking graph of degree {cfg.neighbours} is below this site's "
                              f"minimum {min(floor, sites - 1)} for {sites} sites: refused "
                              "(fewer sites would have to drop or collude to cut it; its "
                              "policy: node config secagg-min-neighbours)")
        colluders = int(self.max_colluders)
        if cfg.neighbours < sites - 1 and cfg.neighbours // 2 + 1 <= colluders:
            raise SecAggError(f"a masking graph of degree {cfg.neighbours} shares a site's "
                              f"secrets with threshold {cfg.neighbours // 2 + 1}, which "
                              f"{colluders} colluding sites could reach: refused (its policy: "
                              "node config secagg-max-colluders)")

    @classmethod
    def begin(cls, node: int, config: SecAggConfig, previous: Mapping | None = None,
              **kw) -> SecAggSite:
        """The keys stage of a new vote, after ``previous`` (the stored state of this site's
        last vote in this run, or None): its history carries over; a vote still open there
        is abandoned (its secrets dropped)."""
        history = _unpack_history(previous["history"]) if previous else ()
        if previous and not previous.get("done", "").endswith("unmask"):
            logger.info("SecAgg: abandoning an unfinished vote for a new one")
        return cls(node, config, history=history, **kw)

    @property
    def authenticated(self) -> bool:
        return self.identity is not None

    @property
    def stage(self) -> str:
        """The last stage this site completed."""
        return self._done[-1]

    # -- the state machine -----------------------------------------------------------------
    def expect(self, stage: str, run: int | None = None, round: int | None = None,
               layer: int | None = None) -> None:
        """Refuse (SecAggError) a ``stage`` that is repeated, out of order, or (any of run,
        round, layer given) for another vote than this one."""
        cfg = self.config
        asked = (cfg.run if run is None else int(run), cfg.round if round is None else int(round),
                 cfg.layer if layer is None else int(layer))
        if asked != (cfg.run, cfg.round, cfg.layer):
            raise SecAggError(f"a {stage} stage for the vote of run {asked[0]}, round "
                              f"{asked[1]}, layer {asked[2]}; this site is in the "
                              f"{cfg.describe()}: refused")
        if self._aborted:
            raise SecAggError(f"{cfg.describe()} was aborted at this site ({self._aborted}): "
                              f"no {stage} stage")
        if stage not in STAGES:
            raise SecAggError(f"stage {stage!r}: expected one of {STAGES}")
        if stage in self._done:
            raise SecAggError(f"a repeated {stage} stage in the {cfg.describe()}: refused "
                              "(each stage runs once per vote)")
        following = STAGES[STAGES.index(self._done[-1]) + 1:]
        allowed = following[:2] if following[:1] == ("confirm",) and not self.authenticated \
            else following[:1]
        if stage not in allowed:
            raise SecAggError(f"a {stage} stage after {self._done[-1]!r} in the "
                              f"{cfg.describe()}: expected {' or '.join(allowed) or 'none'} "
                              "(refused: out of order)")

    def _enter(self, stage: str) -> None:
        self.expect(stage)
        self._done.append(stage)

    def _abort(self, err: Exception) -> None:
        self._aborted = f"{self._done[-1]}: {err}"
        self._wipe()

    def _wipe(self) -> None:
        self._c = self._s = None
        self._seed = b""
        self._received = {}

    def _check_set(self, survivors: Sequence[int], what: str) -> tuple[int, ...]:
        got = [int(n) for n in survivors]
        out = tuple(sorted(set(got)))
        if len(out) != len(got):
            raise SecAggError(f"{what}: a site named twice")
        if set(out) - set(self._u1):
            raise SecAggError(f"{what} names sites {sorted(set(out) - set(self._u1))} that "
                              "advertised no keys")
        missing = (set(out) & self._graph[self.node]) - set(self._u2)
        if missing:
            raise SecAggError(f"{what} names sites {sorted(missing)} whose shares never reached "
                              "this site (not in its U2)")
        if self.node not in out or len(out) < self.config.threshold:
            raise SecAggError(f"{what}: {len(out)} sites (this site "
                              f"{'in' if self.node in out else 'not in'} them): expected at "
                              f"least the threshold {self.config.threshold}, this site among "
                              "them")
        try:
            cut = cut_of(self._graph, out, int(self.max_colluders))
        except ValueError as err:
            raise SecAggError(f"{what}: {err}") from None
        if cut is not None:
            raise SecAggError(f"{what}: without sites {list(cut)} ({len(cut)}, at most "
                              f"secagg-max-colluders={self.max_colluders}) the survivors' "
                              "masking graph falls apart, so the server could learn a partial "
                              "sum: refused")
        return out

    # -- the stages ---------------------------------------------------------------------------
    def advertise(self) -> Advert:
        """Stage 1 (done at construction): this site's signed public keys."""
        return self._advert

    def share(self, public: Mapping[int, Advert | tuple]) -> dict[int, bytes]:
        """Stage 2: check every relayed advertisement (authenticated: signed by a distinct
        peer of the federation; this site's own unchanged), then every other site's encrypted
        pair of shares (of ``b_i`` and of ``s_i``)."""
        self._enter("share")
        try:
            return self._share({int(n): Advert(*a) for n, a in public.items()})
        except SecAggError as err:
            self._abort(err)
            raise

    def _share(self, public: dict[int, Advert]) -> dict[int, bytes]:
        cfg = self.config
        if set(public) - set(cfg.nodes) or self.node not in public:
            raise SecAggError(f"public keys of nodes {sorted(public)[:5]}: expected this site "
                              "and only the vote's sites")
        if len(public) < cfg.threshold:
            raise SecAggError(f"{len(public)} sites advertised keys, below the threshold "
                              f"{cfg.threshold}")
        if public[self.node] != self._advert:
            raise SecAggError("the server relayed another advertisement for this site: refused")
        points = [k for a in public.values() for k in (a.c, a.s)]
        if len(set(points)) != len(points):
            raise SecAggError("one public key advertised twice: refused (replayed keys)")
        for node, advert in public.items():
            _load_public(advert.c, f"node {node}'s channel key")
            _load_public(advert.s, f"node {node}'s mask key")
        if self.authenticated:
            assert self.peers is not None
            signers: dict[bytes, int] = {}
            for node, advert in sorted(public.items()):
                if not advert.signature or not advert.signer:
                    raise SecAggError(f"node {node}'s keys are not signed: refused (an "
                                      "authenticated vote)")
                if advert.signer not in self.peers:
                    raise SecAggError(f"node {node}'s keys are signed by a key that is not one "
                                      "of the federation's: refused")
                if advert.signer in signers:
                    raise SecAggError(f"nodes {signers[advert.signer]} and {node} are one "
                                      f"identity ({self.peers[advert.signer]}): refused")
                signers[advert.signer] = node
                if not _verifies(advert.signer, advert.signature,
                                 advert_payload(cfg.vote_id, node, advert.c, advert.s)):
                    raise SecAggError(f"node {node}'s signature ({self.peers[advert.signer]}) "
                                      "does not verify on its keys for this vote: refused "
                                      "(swapped or replayed keys)")
        assert self._c is not None and self._s is not None
        self._u1 = public
        self._derive_graph()
        order = sorted(self._graph[self.node] | {self.node})
        threshold = self.share_threshold
        seed_shares = create_shares(self._seed, threshold, len(order))
        key_shares = create_shares(_scalar_bytes(self._s), threshold, len(order))
        out: dict[int, bytes] = {}
        for k, node in enumerate(order):
            if node == self.node:
                self._received[node] = (seed_shares[k], key_shares[k])
                continue
            plain = _pack_shares(self._view, self.node, node, seed_shares[k], key_shares[k])
            out[node] = _fernet(self._c, _load_public(public[node].c, f"node {node}")
                                ).encrypt(plain)
        return out

    def _derive_graph(self) -> None:
        self._view = graph_seed(DOMAIN, self.config.vote_id,
                                {n: (a.c, a.s) for n, a in self._u1.items()})
        self._graph = masking_graph(self._view, self._u1, self.config.neighbours)

    @property
    def share_threshold(self) -> int:
        """Shares that rebuild this site's seed or key (its neighbourhood's; the share stage
        sets it)."""
        return share_threshold(self.config.neighbours, len(self._u1), self.config.threshold)

    @property
    def neighbours(self) -> frozenset[int]:
        """This site's neighbours in the masking graph (after the share stage)."""
        return self._graph.get(self.node, frozenset())

    def masked(self, values: np.ndarray, ciphertexts: Mapping[int, bytes]) -> np.ndarray:
        """Stage 3: decrypt the shares addressed to this site (their senders and this site:
        U2), then the masked vector (self mask, and pairwise masks with U2 only)."""
        self._enter("masked")
        try:
            return self._masked(values, ciphertexts)
        except SecAggError as err:
            self._abort(err)
            raise

    def _masked(self, values: np.ndarray, ciphertexts: Mapping[int, bytes]) -> np.ndarray:
        from cryptography.fernet import InvalidToken

        cfg = self.config
        assert self._c is not None and self._s is not None
        received = {}
        for src, blob in ciphertexts.items():
            src = int(src)
            if src not in self._u1 or src == self.node:
                raise SecAggError(f"shares from node {src}, which advertised no keys")
            if src not in self._graph[self.node]:
                raise SecAggError(f"shares from node {src}, which is not this site's neighbour "
                                  "in the masking graph: refused")
            channel = _fernet(self._c, _load_public(self._u1[src].c, f"node {src}"))
            try:
                vote, s, d, seed_share, key_share = _unpack_shares(
                    channel.decrypt(bytes(blob)))
            except (InvalidToken, ValueError, TypeError) as err:
                raise SecAggError(f"shares from node {src} do not decrypt: {err!r}") from None
            if (vote, s, d) != (self._view, src, self.node):
                raise SecAggError(f"shares from node {src} name ({s} -> {d}) of another vote, "
                                  "pair or set of advertised keys: relayed wrongly, refused")
            received[src] = (seed_share, key_share)
        u2 = tuple(sorted({*received, self.node}))
        if len(u2) < self.share_threshold:
            raise SecAggError(f"shares of {len(u2)} sites (U2, this site included) reached this "
                              f"site, below the threshold {self.share_threshold}: refused")
        words = cfg.pack(values)
        if words.size != cfg.n_words:
            raise SecAggError(f"a vector of {np.asarray(values).size} coordinates: expected "
                              f"{cfg.numel}")
        mask = partial(apply_mask, words, vote_id=cfg.vote_id, threads=mask_threads())
        mask(self._seed, purpose=b"self")
        for node in u2:
            if node == self.node:
                continue
            pair = agree(self._s, _load_public(self._u1[node].s, f"node {node}"))
            mask(pair, purpose=b"pair", subtract=self.node > node)
        self._received.update(received)
        self._u2 = u2
        return words

    def confirm(self, survivors: Sequence[int]) -> bytes:
        """Stage 4 (consistency round): check the announced survivor set (a subset of U2, at
        least ``t``, this site in it) and sign it with the vote (unauthenticated: b"")."""
        self._enter("confirm")
        try:
            self._survivors = self._check_set(survivors, "the survivor set")
        except SecAggError as err:
            self._abort(err)
            raise
        if self.identity is None:
            return b""
        return _sign(self.identity, survivors_payload(self._view, self._survivors))

    def unmask(self, survivors: Sequence[int], signatures: Mapping[int, bytes] | None = None
               ) -> dict[int, bytes]:
        """Stage 5: this site's share of ``b_j`` for every survivor and of ``s_j`` for every
        site of U2 that is not a survivor. Authenticated, only after the consistency round, on
        the survivor set this site confirmed, with at least ``t`` valid signatures on it from
        distinct survivors (``signatures``: survivor -> its signature)."""
        self._enter("unmask")
        try:
            out = self._unmask(survivors, signatures or {})
        except SecAggError as err:
            self._abort(err)
            raise
        self._wipe()  # this vote's secrets are no longer needed
        return out

    def _unmask(self, survivors: Sequence[int], signatures: Mapping[int, bytes]
                ) -> dict[int, bytes]:
        cfg = self.config
        announced = self._check_set(survivors, "the survivor set")
        if self.authenticated:
            if announced != self._survivors:
                raise SecAggError(f"unmasking asked for survivors {list(announced)[:8]}, but "
                                  f"this site confirmed {list(self._survivors)[:8]}: refused "
                                  "(split view)")
            extra = sorted(set(int(n) for n in signatures) - set(announced))
            if extra:
                raise SecAggError(f"survivor-set signatures of nodes {extra}, which are not "
                                  "survivors: refused")
            payload = survivors_payload(self._view, announced)
            valid: set[bytes] = set()
            for node, sig in sorted(signatures.items()):
                if len(valid) >= cfg.threshold:  # enough: the rest are not needed (nor read)
                    break
                if not _verifies(self._u1[int(node)].signer, sig, payload):
                    raise SecAggError(f"node {node}'s signature on the survivor set does not "
                                      "verify: refused (another set, or forged)")
                valid.add(self._u1[int(node)].signer)
            if len(valid) < cfg.threshold:
                raise SecAggError(f"{len(valid)} survivors signed the survivor set, below the "
                                  f"threshold {cfg.threshold}: refused (the consistency round "
                                  "did not hold)")
        dropped = set(self._u2) - set(announced)
        out = {}
        for node in (*[n for n in announced if n in self._u2], *sorted(dropped)):
            seed_share, key_share = self._received[node]
            out[node] = seed_share if node in announced else key_share
        return out

    # -- stored state ------------------------------------------------------------------------
    def to_state(self) -> dict[str, bytes | int | str | bool]:
        """Everything this site holds between stages (its private keys included), as a flat
        record of scalars and bytes: kept in the site's own state store between messages (a
        deployed site may run each message in a new process); never sent. The identity key
        and the peers are not in it: the site reloads them from its own files."""
        cfg = self.config
        u1 = sorted(self._u1)
        received = sorted(self._received)
        return {
            "node": self.node, "nodes": pack_ints(cfg.nodes), "threshold": cfg.threshold,
            "numel": cfg.numel, "bits": cfg.bits, "run": cfg.run, "round": cfg.round,
            "layer": cfg.layer, "min_threshold": int(self.min_threshold or 0),
            "neighbours": cfg.neighbours, "min_neighbours": int(self.min_neighbours or 0),
            "max_colluders": int(self.max_colluders),
            "authenticated": self.authenticated,
            "history": pack_blobs(self.history),
            "c": _private_bytes(self._c) if self._c else b"-",
            "s": _private_bytes(self._s) if self._s else b"-",
            "seed": self._seed or b"-",
            "advert": pack_blobs(self._advert),
            "u1": pack_ints(u1), "u1_adverts": pack_blobs([pack_blobs(self._u1[n]) for n in u1]),
            "u2": pack_ints(self._u2), "survivors": pack_ints(self._survivors),
            "received": pack_ints(received),
            "received_seed": pack_blobs([self._received[n][0] for n in received]),
            "received_key": pack_blobs([self._received[n][1] for n in received]),
            "done": ",".join(self._done), "aborted": self._aborted or "-",
        }

    @classmethod
    def from_state(cls, state: Mapping, identity: ec.EllipticCurvePrivateKey | None = None,
                   peers: Mapping[bytes, str] | None = None) -> SecAggSite:
        """Inverse of :meth:`to_state`, with this site's own identity and peers (the same as
        when the vote began: checked)."""
        try:
            config = SecAggConfig(tuple(unpack_ints(state["nodes"])), int(state["threshold"]),
                                  int(state["numel"]), int(state["bits"]), int(state["run"]),
                                  int(state["round"]), int(state["layer"]),
                                  int(state["neighbours"]))
            site = cls.__new__(cls)
            site.node, site.config = int(state["node"]), config
            site.min_threshold = int(state["min_threshold"])
            site.min_neighbours = int(state["min_neighbours"])
            site.max_colluders = int(state["max_colluders"])
            site.identity, site.peers = identity, peers
            site.history = tuple(_unpack_history(state["history"]))
            site._c = (None if bytes(state["c"]) == b"-"
                       else _load_private(bytes(state["c"]), "stored channel key"))
            site._s = (None if bytes(state["s"]) == b"-"
                       else _load_private(bytes(state["s"]), "stored mask key"))
            site._seed = b"" if bytes(state["seed"]) == b"-" else bytes(state["seed"])
            site._advert = Advert(*unpack_blobs(state["advert"]))
            site._u1 = {n: Advert(*unpack_blobs(a)) for n, a in zip(
                unpack_ints(state["u1"]), unpack_blobs(state["u1_adverts"]), strict=True)}
            site._view, site._graph = b"", {}
            if site._u1:
                site._derive_graph()
            site._u2 = tuple(unpack_ints(state["u2"]))
            site._survivors = tuple(unpack_ints(state["survivors"]))
            site._received = {n: (a, b) for n, a, b in zip(
                unpack_ints(state["received"]), unpack_blobs(state["received_seed"]),
                unpack_blobs(state["received_key"]), strict=True)}
            site._done = str(state["done"]).split(",")
            site._aborted = "" if state["aborted"] == "-" else str(state["aborted"])
            stored_auth = bool(state["authenticated"])
        except (KeyError, TypeError, ValueError) as err:
            raise SecAggError(f"stored SecAgg state unusable: {err}") from None
        if stored_auth != (identity is not None) or (identity is not None and (
                peers is None or site._advert.signer != identity_public(identity))):
            raise SecAggError("this site's SecAgg identity changed during the vote: refused")
        return site


def _unpack_history(data) -> tuple[bytes, ...]:
    return tuple(unpack_blobs(data, "vote history"))


@dataclass
class SecAggServer:
    """The server's side: relays, and rebuilds the sum from the masked vectors and shares."""

    config: SecAggConfig
    public: dict[int, Advert | tuple] = field(default_factory=dict)
    #: U2: the sites whose shares were relayed (set by :meth:`relay`)
    shared: set[int] | None = None
    #: the vote id the sites derived (they name it in their keys replies); default the config's
    vote_id: bytes = b""

    def relay(self, shares: Mapping[int, Mapping[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Stage 2 -> 3: ``shares[src][dst]`` regrouped per destination; the sources are U2."""
        self.shared = {int(n) for n in shares}
        out: dict[int, dict[int, bytes]] = {}
        for src, per_dst in shares.items():
            for dst, blob in per_dst.items():
                if dst in self.shared:
                    out.setdefault(dst, {})[src] = blob
        return out

    def aggregate(self, masked: Mapping[int, np.ndarray], shares: Mapping[int, Mapping[int, bytes]]
                  ) -> np.ndarray:
        """Stage 5: the sum of the survivors' vectors (int64, ``numel``) from their masked
        vectors (``masked[node]``) and the survivors' shares (``shares[holder][node]``)."""
        cfg = self.config
        vote_id = self.vote_id or cfg.vote_id
        survivors = sorted(masked)
        keyed = sorted(self.shared if self.shared is not None else self.public)
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
        keys = {int(n): (Advert(*a).c, Advert(*a).s) for n, a in self.public.items()}
        graph = masking_graph(graph_seed(DOMAIN, vote_id, keys), keys, cfg.neighbours)
        threshold = share_threshold(cfg.neighbours, len(keys), cfg.threshold)
        total = np.zeros(cfg.n_words, dtype=np.uint64)
        unmask = partial(apply_mask, total, vote_id=vote_id, threads=mask_threads())
        with np.errstate(over="ignore"):
            for node in survivors:
                total += masked[node]
            for node in survivors + dropped:
                got = [h[node] for h in shares.values() if node in h]
                if len(got) < threshold:
                    raise SecAggError(f"{len(got)} shares of node {node}'s "
                                      f"{'seed' if node in masked else 'key'}: below the "
                                      f"threshold {threshold}")
                try:
                    secret = combine_shares(list(got[:threshold]))
                except (ValueError, TypeError) as err:  # SecAggError is a ValueError
                    raise SecAggError(f"node {node}'s shares do not combine: {err}") from None
                if node in masked:
                    if len(secret) != SEED_BYTES:
                        raise SecAggError(f"node {node}'s rebuilt seed has {len(secret)} bytes")
                    unmask(secret, purpose=b"self", subtract=True)
                    continue
                key = _key_from_scalar(secret, f"node {node}'s rebuilt key")
                if _public_bytes(key) != Advert(*self.public[node]).s:
                    raise SecAggError(f"node {node}'s rebuilt key does not match its public key")
                for other in sorted(graph[node] & set(survivors)):  # undo its pairwise masks
                    pair = agree(key, _load_public(Advert(*self.public[other]).s,
                                                   f"node {other}"))
                    unmask(pair, purpose=b"pair", subtract=node > other)
        return cfg.unpack(total)
