"""The masking graph of SecAgg+ (Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS 2020, https://eprint.iacr.org/2020/704): which sites mask with
each other and hold each other's shares. Plain functions of public values, no Flower.

**Derived, not chosen.** The graph's seed is SHA-256 over the vote id and every advertised
site's index and fresh public keys (:func:`graph_seed`). The keys are drawn at each site from OS
entropy in the keys stage, so nobody knows the seed before every advertisement exists; the
server's only influence is which advertisements it relays (at least the vote's threshold), and
every site derives the same graph from what it was shown. Each site's shares name the seed they
were made under, so two sites shown different advertisements never mask with each other or hold
each other's shares (their shares are refused).

**The graph** (:func:`masking_graph`): the Harary graph ``H(k, m)`` on the ``m`` advertised sites,
placed on a ring in the order of ``SHA-256(seed || index)``: each site's neighbours are the
``k / 2`` nearest on either side (``k`` even, ``2 <= k < m - 1``); ``k >= m - 1`` is the complete
graph (SecAgg). ``H(k, m)`` is ``k``-vertex-connected: removing any ``k - 1`` sites leaves it
connected. A site shares its self-mask seed and its mask key among its neighbours and itself
with threshold :func:`share_threshold` (``k / 2 + 1``, a majority of its ``k + 1``; the complete
graph keeps the vote's threshold), and masks pairwise with its neighbours only: ``k + 1`` AES
streams per site instead of ``n``. The default degree (:func:`default_neighbours`) is Bell et
al.'s logarithmic one, ``2 * ceil(log2 n)`` (16 sites: 8; 64: 12; 1,000: 20).

**What a site checks before it reveals a share** (:func:`cut_of`): for every set ``C`` of at most
``c`` survivors (``c``: its policy's ``secagg-max-colluders``), the graph on the survivors
without ``C`` is connected. A pairwise mask with a colluder or with a dropped site (whose mask key
the server rebuilds) is known to the server; the other masks hide every proper part of a
connected group of honest survivors, so the server learns the sum over all survivors and no
partial sum. The check is deterministic: a graph the server steered (by relaying a chosen set of
advertisements) or a survivor set it chose (by dropping sites) can cost it the vote, never a
site's input. What the degree ``k`` buys is how many sites may drop before the check or the
unmasking fails: ``H(k, m)`` passes the check after any ``k - c - 1`` drops, and each site's
shares unmask after any ``k / 2`` of its neighbours drop.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

#: Derivation label of the graph seed (after the protocol's name)
_GRAPH = b"/graph/"
#: At most this many colluder sets are tried by :func:`cut_of` (the cost of the check)
MAX_CUT_CANDIDATES = 1_000_000


def default_neighbours(sites: int) -> int:
    """Bell et al.'s logarithmic degree ``2 * ceil(log2 sites)``, at most ``sites - 1`` (then
    the complete graph)."""
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 2:
        raise ValueError(f"sites={sites!r}: expected an int >= 2")
    return min(sites - 1, 2 * math.ceil(math.log2(sites)))


def effective_neighbours(neighbours: int, sites: int) -> int:
    """The degree on ``sites`` advertised sites: ``neighbours``, or ``sites - 1`` (the complete
    graph) when it is at least that."""
    return min(int(neighbours), sites - 1)


def check_neighbours(neighbours: int, sites: int) -> str:
    """'' when ``neighbours`` is a degree a vote of ``sites`` sites can use (an even number
    ``>= 2``, or ``>= sites - 1``: the complete graph), else what is wrong."""
    if isinstance(neighbours, bool) or not isinstance(neighbours, int):
        return f"neighbours={neighbours!r}: expected an int"
    if neighbours >= sites - 1:
        return ""
    if neighbours < 2 or neighbours % 2:
        return (f"neighbours={neighbours}: expected an even degree >= 2, or >= {sites - 1} "
                f"(the complete graph of {sites} sites)")
    return ""


def share_threshold(neighbours: int, sites: int, vote_threshold: int) -> int:
    """Shares of a site's seed and key needed to rebuild it: the vote's threshold on the
    complete graph, else ``k // 2 + 1`` (a majority of the site and its ``k`` neighbours)."""
    k = effective_neighbours(neighbours, sites)
    return vote_threshold if k >= sites - 1 else k // 2 + 1


def graph_seed(domain: bytes, vote_id: bytes, keys: Mapping[int, tuple[bytes, bytes]]) -> bytes:
    """32 bytes from the vote and every advertised site's index and (channel, mask) public
    keys, in index order: fresh per vote, known to nobody before the keys stage ends."""
    h = hashlib.sha256(domain + _GRAPH + vote_id)
    for node in sorted(keys):
        c, s = keys[node]
        h.update(int(node).to_bytes(8, "little"))
        for key in (c, s):
            h.update(len(key).to_bytes(4, "little") + bytes(key))
    return h.digest()


def masking_graph(seed: bytes, nodes: Iterable[int], neighbours: int
                  ) -> dict[int, frozenset[int]]:
    """Every node's neighbours: ``H(k, m)`` on a ring ordered by ``SHA-256(seed || node)``;
    the complete graph when ``k >= m - 1``."""
    order = sorted({int(n) for n in nodes},
                   key=lambda n: hashlib.sha256(seed + n.to_bytes(8, "little")).digest())
    m = len(order)
    k = effective_neighbours(neighbours, m)
    if k >= m - 1:
        return {n: frozenset(order) - {n} for n in order}
    problem = check_neighbours(k, m)
    if problem:
        raise ValueError(problem)
    half = k // 2
    return {n: frozenset(order[(p + d) % m] for d in range(-half, half + 1) if d)
            for p, n in enumerate(order)}


def _connected(graph: Mapping[int, frozenset[int]], nodes: set[int]) -> bool:
    if len(nodes) <= 1:
        return True
    start = next(iter(nodes))
    seen, stack = {start}, [start]
    while stack:
        for other in graph[stack.pop()]:
            if other in nodes and other not in seen:
                seen.add(other)
                stack.append(other)
    return len(seen) == len(nodes)


def cut_of(graph: Mapping[int, frozenset[int]], survivors: Sequence[int], colluders: int
           ) -> tuple[int, ...] | None:
    """A set of at most ``colluders`` survivors whose removal disconnects the graph on the
    survivors (the smallest found first), or None: the server, with that many colluding sites,
    can learn no partial sum of the survivors' vectors."""
    alive = {int(n) for n in survivors}
    if any(n not in graph for n in alive):
        raise ValueError(f"survivors {sorted(n for n in alive if n not in graph)[:5]} are not "
                         "in the masking graph")
    if all(alive - {n} <= graph[n] for n in alive):  # complete on the survivors
        return None
    tried = 0
    for size in range(min(colluders, len(alive) - 1) + 1):
        tried += math.comb(len(alive), size)
        if tried > MAX_CUT_CANDIDATES:
            raise ValueError(f"checking {colluders} colluders among {len(alive)} survivors "
                             f"tries over {MAX_CUT_CANDIDATES:,} sets: lower "
                             "secagg-max-colluders or the number of sites")
        for removed in combinations(sorted(alive), size):
            if not _connected(graph, alive - set(removed)):
                return removed
    return None
