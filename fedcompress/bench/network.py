"""Simulated end-to-end time of a federated run under network profiles (FedPrLLM Tables 16-17).

Pure arithmetic on measured quantities (bytes and compute seconds per client and round); no
Flower, no sockets.

Model
-----
A run is a :class:`Schedule` of rounds. In round ``r`` every client ``i`` receives a message of
``down[r, i]`` bytes, computes for ``compute[r, i]`` seconds and sends ``up[r, i]`` bytes back.
Client ``i``'s time in round ``r`` is ::

    t[r, i] = latency + 8 * down[r, i] / down_bps * s_tx(i)
            + compute[r, i] * s_cpu(i)
            + latency + 8 * up[r, i] / up_bps * s_tx(i)

``latency`` is the one-way latency of one message (charged for both messages of a round, even an
empty one: the instruction and the reply are still sent). ``s_tx(i)`` and ``s_cpu(i)`` are 1 for
normal clients and the straggler factors for stragglers (:class:`Stragglers`). Every client has its
own link of the profile's bandwidth (the server's link is not a bottleneck) unless the profile
sets ``server_bps``: then the server's link carries the round's messages one after another, and
the round also takes at least ``2 * latency + 8 * sum_i down[r, i] / server_bps + max_i
compute[r, i] * s_cpu(i) + 8 * sum_i up[r, i] / server_bps`` (a lower bound for a shared link).
The round ends when the slowest client is done (synchronous rounds)::

    round[r] = max_i t[r, i]          total = sum_r round[r]   (+ server_s per round)

Schedules of FedPrLLM (:func:`oneshot_schedule`, :func:`iterative_schedule`):

* one-shot: 1 round; down = the instruction (``down_bytes``, default 0: every client loads the
  same public model itself); compute = the whole local pass; up = every layer's bit-packed masks.
* iterative: ``L`` rounds, one per decoder layer; round ``l`` uploads layer ``l``'s masks and
  downloads the global mask of layer ``l - 1`` (round 0 downloads nothing but the instruction; the
  last layer's global mask is applied by the server and never sent); compute = layer ``l``'s
  share of the local pass.

Network profiles (:data:`PROFILES`, overridable with :func:`get_profile`): latency and bandwidth
are the four profiles of FedPrLLM Table 16 (App. D.2), symmetric up/down as in the paper:
datacenter 1 ms / 10 Gbps, cross-silo LAN 5 ms / 1 Gbps, cross-silo WAN 50 ms / 100 Mbps, edge
100 ms / 10 Mbps.

Stragglers (FedPrLLM App. D.3): a fraction (default 20%, rounded half up: 13 of 64) of the
clients, drawn once per run with ``numpy.random.default_rng(seed)``, are slow in every round:
their bandwidth is divided by ``transfer_slowdown`` (default 2: "bandwidth at 50%", as in D.3) and
their compute time multiplied by ``compute_slowdown`` (default 2: a device half as fast; set 1 for
the paper's bandwidth-only setting).

Note on the paper's numbers: Table 16's hours correspond to 64 clients uploading one *byte* per
weight of LLaMA-7B through a shared server link, and its iterative column to that full payload
in each of 32 rounds. With per-layer payloads (this module), one-shot and iterative move the
same bytes; iterative pays ``2 * L`` latencies and waits for the slowest client ``L`` times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "PROFILES",
    "NetworkProfile",
    "Schedule",
    "SimResult",
    "Stragglers",
    "compare",
    "format_bits_per_second",
    "format_seconds",
    "get_profile",
    "iterative_schedule",
    "layer_mask_bytes",
    "markdown_table",
    "oneshot_schedule",
    "schedule_from_bench_record",
    "schedule_from_client_records",
    "simulate",
]


# ------------------------------------------------------------------------------------------
# Profiles and stragglers
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NetworkProfile:
    """One network: one-way latency (s), client down/up bandwidth (bit/s), optional shared
    server link (bit/s, None = not a bottleneck)."""

    name: str
    latency_s: float
    down_bps: float
    up_bps: float
    server_bps: float | None = None

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"profile {self.name}: latency {self.latency_s!r} must be >= 0")
        for what in ("down_bps", "up_bps"):
            value = getattr(self, what)
            if not value > 0:
                raise ValueError(f"profile {self.name}: {what} {value!r} must be > 0")
        if self.server_bps is not None and not self.server_bps > 0:
            raise ValueError(f"profile {self.name}: server_bps {self.server_bps!r} must be > 0")

    def to_dict(self) -> dict:
        return asdict(self)


#: FedPrLLM Table 16 (App. D.2): latency, bandwidth (symmetric).
PROFILES: dict[str, NetworkProfile] = {
    "datacenter": NetworkProfile("datacenter", 0.001, 10e9, 10e9),
    "lan": NetworkProfile("lan", 0.005, 1e9, 1e9),
    "wan": NetworkProfile("wan", 0.050, 100e6, 100e6),
    "edge": NetworkProfile("edge", 0.100, 10e6, 10e6),
}


def get_profile(name: str | NetworkProfile, **overrides: Any) -> NetworkProfile:
    """A profile by name (``datacenter``, ``lan``, ``wan``, ``edge``) with fields overridden,
    e.g. ``get_profile("edge", up_bps=2e6)``."""
    if isinstance(name, NetworkProfile):
        base = name
    else:
        key = name.lower()
        if key not in PROFILES:
            raise ValueError(f"unknown network profile {name!r}: expected one of "
                             f"{', '.join(PROFILES)}")
        base = PROFILES[key]
    unknown = set(overrides) - {f for f in NetworkProfile.__dataclass_fields__}
    if unknown:
        raise ValueError(f"unknown profile fields {sorted(unknown)}")
    return replace(base, **overrides) if overrides else base


@dataclass(frozen=True)
class Stragglers:
    """A seeded fraction of persistently slow clients (see the module docstring)."""

    fraction: float = 0.2
    transfer_slowdown: float = 2.0
    compute_slowdown: float = 2.0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"straggler fraction {self.fraction!r} outside [0, 1]")
        if self.transfer_slowdown < 1.0 or self.compute_slowdown < 1.0:
            raise ValueError("straggler slowdowns must be >= 1")

    def count(self, n_clients: int) -> int:
        """``fraction * n_clients`` rounded half up (20% of 64 -> 13)."""
        return int(math.floor(self.fraction * n_clients + 0.5))

    def select(self, n_clients: int) -> list[int]:
        """Sorted indices of the stragglers among ``n_clients`` (seeded, reproducible)."""
        k = self.count(n_clients)
        rng = np.random.default_rng(self.seed)
        return sorted(int(i) for i in rng.choice(n_clients, size=k, replace=False))

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------
# Schedules
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Schedule:
    """Per round: bytes down, compute seconds and bytes up of each client.

    Each of ``up_bytes``, ``down_bytes``, ``compute_s`` is a list with one entry per round; an
    entry is a number (the same for every client) or a list with one number per client.
    """

    name: str
    up_bytes: Sequence[Any]
    down_bytes: Sequence[Any]
    compute_s: Sequence[Any]

    def __post_init__(self):
        lengths = {len(self.up_bytes), len(self.down_bytes), len(self.compute_s)}
        if len(lengths) != 1:
            raise ValueError(f"schedule {self.name}: up/down/compute lists have different "
                             f"numbers of rounds {len(self.up_bytes)}, {len(self.down_bytes)}, "
                             f"{len(self.compute_s)}")
        if not self.rounds:
            raise ValueError(f"schedule {self.name} has no rounds")

    @property
    def rounds(self) -> int:
        return len(self.up_bytes)

    def matrix(self, what: str, n_clients: int) -> np.ndarray:
        """``[rounds, n_clients]`` float64 array of ``up_bytes``/``down_bytes``/``compute_s``."""
        rows = []
        for r, entry in enumerate(getattr(self, what)):
            row = np.asarray(entry, dtype=np.float64)
            if row.ndim == 0:
                row = np.full(n_clients, float(row))
            elif row.shape != (n_clients,):
                raise ValueError(f"schedule {self.name}: {what} of round {r} has "
                                 f"{row.size} entries for {n_clients} clients")
            if np.any(row < 0) or not np.all(np.isfinite(row)):
                raise ValueError(f"schedule {self.name}: {what} of round {r} must be finite "
                                 "and >= 0")
            rows.append(row)
        return np.stack(rows)


def _as_list(values: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(values, (int, float)):
        return [float(values) / n] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} values for {n} layers")
    return [float(v) for v in values]


def oneshot_schedule(layer_up_bytes: Sequence[int], compute_s: float | Sequence[float],
                     down_bytes: float = 0) -> Schedule:
    """One round: the masks of every layer up at once; ``compute_s`` the whole pass (a total,
    or per-layer seconds that are summed)."""
    total_compute = (float(compute_s) if isinstance(compute_s, (int, float))
                     else float(sum(compute_s)))
    return Schedule("one-shot", [int(sum(layer_up_bytes))], [down_bytes], [total_compute])


def iterative_schedule(layer_up_bytes: Sequence[int], compute_s: float | Sequence[float],
                       global_mask_bytes: Sequence[int] | None = None,
                       down_bytes: float = 0) -> Schedule:
    """``L`` rounds: round ``l`` uploads layer ``l``'s masks and downloads the global mask of
    layer ``l - 1`` (``global_mask_bytes``, default the same sizes as the uploads) plus the
    instruction (``down_bytes``). ``compute_s``: per-layer seconds, or a total split evenly."""
    layers = len(layer_up_bytes)
    if layers == 0:
        raise ValueError("no layers")
    glob = list(layer_up_bytes if global_mask_bytes is None else global_mask_bytes)
    if len(glob) != layers:
        raise ValueError(f"{len(glob)} global mask sizes for {layers} layers")
    down = [down_bytes] + [down_bytes + glob[i - 1] for i in range(1, layers)]
    return Schedule("iterative", [int(b) for b in layer_up_bytes], down,
                    _as_list(compute_s, layers, "compute_s"))


def layer_mask_bytes(shapes: Mapping[str, tuple[int, ...]]) -> list[int]:
    """Bit-packed bytes per decoder layer from wire keys ``layers.{i}.{name}`` -> shape
    (ceil(numel / 8) per linear layer, as :mod:`fedcompress.masks.codec` packs them)."""
    per_layer: dict[int, int] = {}
    for key, shape in shapes.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
            raise ValueError(f"not a wire key layers.<index>.<name>: {key!r}")
        numel = int(np.prod(shape))
        per_layer[int(parts[1])] = per_layer.get(int(parts[1]), 0) + (numel + 7) // 8
    return [per_layer[i] for i in sorted(per_layer)]


def schedule_from_client_records(records: Iterable[Mapping[str, Any]],
                                 down_bytes: float | Sequence[float] = 0,
                                 name: str = "measured") -> Schedule:
    """A schedule from measured per-client records ``{"round", "partition", "seconds",
    "bytes_up"}`` (the ``clients`` list of a ``fedcompress prune`` report). Every round must
    have a record of every client; ``down_bytes`` is per round (a number or a list)."""
    table: dict[int, dict[int, Mapping[str, Any]]] = {}
    for rec in records:
        table.setdefault(int(rec["round"]), {})[int(rec["partition"])] = rec
    if not table:
        raise ValueError("no client records")
    rounds = sorted(table)
    clients = sorted(set().union(*(set(v) for v in table.values())))
    for r in rounds:
        if sorted(table[r]) != clients:
            raise ValueError(f"round {r} has records of clients {sorted(table[r])}, expected "
                             f"{clients}")
    up = [[float(table[r][c]["bytes_up"]) for c in clients] for r in rounds]
    compute = [[float(table[r][c]["seconds"]) for c in clients] for r in rounds]
    down = ([down_bytes] * len(rounds) if isinstance(down_bytes, (int, float))
            else list(down_bytes))
    return Schedule(name, up, down, compute)


def schedule_from_bench_record(record: Mapping[str, Any]) -> tuple[Schedule, float]:
    """The schedule of a finished ``fedcompress bench`` FedPrLLM cell from what it measured,
    and the server's seconds per round (for :func:`simulate`'s ``server_s``).

    * one-shot: 1 round; up = ``bytes_up_per_client`` (in the cell's wire format), down =
      ``bytes_down_per_client`` (the compressed format's public reference; 0 bit-packed),
      compute = ``client_seconds_mean`` (+ ``wire_encode_seconds_mean``); server = counting +
      selection (+ decoding every payload and measuring the reference);
    * iterative: ``rounds`` rounds with the measured per-layer bytes up/down and mean client
      seconds (``layer_*`` fields); server = the mean of ``layer_server_seconds``. A record
      made before those fields were kept splits ``bytes_up_per_client`` evenly over the rounds,
      ``bytes_down_masks_per_client`` over rounds 1..L-1 and ``iterative_seconds /
      clients`` (the in-process vote, clients one after another) over the rounds, server 0.

    :class:`ValueError` when the record lacks what its mode needs (e.g. no client seconds)."""
    mode = record.get("mode", "oneshot")
    if mode == "oneshot":
        measured = record.get("client_seconds_mean")
        if measured is None:
            raise ValueError("the cell's record has no measured client seconds "
                             "(client_seconds_mean)")
        compute = float(measured) + float(record.get("wire_encode_seconds_mean") or 0.0)
        server = sum(float(record.get(k) or 0.0) for k in (
            "count_seconds", "aggregate_seconds", "wire_decode_seconds_total",
            "reference_seconds"))
        return (oneshot_schedule([int(round(float(record["bytes_up_per_client"])))], compute,
                                 down_bytes=float(record.get("bytes_down_per_client") or 0)),
                server)
    rounds = int(record["rounds"])
    if "layer_bytes_up_per_client" in record:
        up = [int(b) for b in record["layer_bytes_up_per_client"]]
        down = [int(b) for b in record["layer_bytes_down_per_client"]]
        seconds = [float(s) for s in record["layer_client_seconds_mean"]]
        server_rounds = [float(s) for s in record["layer_server_seconds"]]
        server = sum(server_rounds) / len(server_rounds)
    else:
        up = [int(record["bytes_up_per_client"]) // rounds] * rounds
        sent = int(record.get("bytes_down_masks_per_client") or 0)
        down = [0] + [sent // max(rounds - 1, 1)] * (rounds - 1)
        seconds = [float(record["iterative_seconds"]) / int(record["clients"]) / rounds] * rounds
        server = 0.0
    # round l carries the global mask of layer l - 1; the last one is never sent
    return iterative_schedule(up, seconds, global_mask_bytes=down[1:] + [0]), server


# ------------------------------------------------------------------------------------------
# Simulation
# ------------------------------------------------------------------------------------------

@dataclass
class SimResult:
    """Simulated time of one schedule on one profile."""

    schedule: str
    profile: NetworkProfile
    n_clients: int
    rounds: int
    total_seconds: float
    round_seconds: list[float]
    slowest_client: list[int]
    stragglers: list[int]
    homogeneous_seconds: float
    bytes_up_per_client: float  # mean over clients, summed over rounds
    bytes_down_per_client: float
    straggler_config: Stragglers | None = None
    extra: dict = field(default_factory=dict)

    @property
    def straggler_penalty_seconds(self) -> float:
        return self.total_seconds - self.homogeneous_seconds

    def to_dict(self) -> dict:
        out = asdict(self)
        out["profile"] = self.profile.to_dict()
        out["straggler_config"] = (self.straggler_config.to_dict()
                                   if self.straggler_config else None)
        out["straggler_penalty_seconds"] = self.straggler_penalty_seconds
        return out


def _round_times(schedule: Schedule, n_clients: int, profile: NetworkProfile,
                 slow: Sequence[int], stragglers: Stragglers | None) -> np.ndarray:
    up = schedule.matrix("up_bytes", n_clients)
    down = schedule.matrix("down_bytes", n_clients)
    compute = schedule.matrix("compute_s", n_clients)
    s_tx = np.ones(n_clients)
    s_cpu = np.ones(n_clients)
    if stragglers is not None and len(slow):
        s_tx[list(slow)] = stragglers.transfer_slowdown
        s_cpu[list(slow)] = stragglers.compute_slowdown
    lat = profile.latency_s
    cpu = compute * s_cpu
    per_client = (lat + 8.0 * down / profile.down_bps * s_tx + cpu
                  + lat + 8.0 * up / profile.up_bps * s_tx)
    if profile.server_bps is None:
        return per_client
    shared = (2 * lat + 8.0 * down.sum(1) / profile.server_bps + cpu.max(1)
              + 8.0 * up.sum(1) / profile.server_bps)
    # a virtual "server link" column: the round lasts at least as long as the shared link needs
    return np.concatenate([per_client, shared[:, None]], axis=1)


def simulate(schedule: Schedule, n_clients: int, profile: str | NetworkProfile,
             stragglers: Stragglers | None = None, server_s: float = 0.0) -> SimResult:
    """Simulated wall time of ``schedule`` with ``n_clients`` on ``profile`` (see the module
    docstring); ``server_s`` seconds of server work are added to every round."""
    if not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"number of clients {n_clients!r} must be a positive integer")
    if server_s < 0:
        raise ValueError("server_s must be >= 0")
    profile = get_profile(profile)
    slow = stragglers.select(n_clients) if stragglers is not None else []
    times = _round_times(schedule, n_clients, profile, slow, stragglers)
    homogeneous = _round_times(schedule, n_clients, profile, [], None)
    rounds = times.max(1) + server_s
    slowest = [int(i) if i < n_clients else -1 for i in times.argmax(1)]  # -1: the server link
    return SimResult(
        schedule=schedule.name, profile=profile, n_clients=n_clients, rounds=schedule.rounds,
        total_seconds=float(rounds.sum()), round_seconds=[float(t) for t in rounds],
        slowest_client=slowest, stragglers=slow,
        homogeneous_seconds=float((homogeneous.max(1) + server_s).sum()),
        bytes_up_per_client=float(schedule.matrix("up_bytes", n_clients).sum(0).mean()),
        bytes_down_per_client=float(schedule.matrix("down_bytes", n_clients).sum(0).mean()),
        straggler_config=stragglers)


def compare(oneshot: Schedule, iterative: Schedule, n_clients: int,
            profiles: Iterable[str | NetworkProfile] = tuple(PROFILES),
            stragglers: Stragglers | None = None, server_s: float = 0.0) -> list[dict]:
    """One row per profile: one-shot vs iterative times and the speedup (Table 16 shape)."""
    rows = []
    for p in profiles:
        one = simulate(oneshot, n_clients, p, stragglers, server_s)
        it = simulate(iterative, n_clients, p, stragglers, server_s)
        rows.append({
            "profile": one.profile.name,
            "latency_s": one.profile.latency_s,
            "down_bps": one.profile.down_bps,
            "up_bps": one.profile.up_bps,
            "n_clients": n_clients,
            "stragglers": len(one.stragglers),
            "oneshot_rounds": one.rounds,
            "iterative_rounds": it.rounds,
            "oneshot_seconds": one.total_seconds,
            "iterative_seconds": it.total_seconds,
            "speedup": it.total_seconds / one.total_seconds if one.total_seconds else math.inf,
            "oneshot_straggler_penalty_s": one.straggler_penalty_seconds,
            "iterative_straggler_penalty_s": it.straggler_penalty_seconds,
            "oneshot": one.to_dict(),
            "iterative": it.to_dict(),
        })
    return rows


# ------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------

def format_seconds(seconds: float) -> str:
    """``0.5 s``, ``12.3 s``, ``4.5 min``, ``3.21 h``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def format_bits_per_second(bps: float) -> str:
    """``10 Gbps``, ``100 Mbps``, ``56 kbps``."""
    for unit, scale in (("Gbps", 1e9), ("Mbps", 1e6), ("kbps", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bps"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of :func:`compare` rows."""
    head = ("| Network profile | Latency | Bandwidth (down / up) | Clients (stragglers) | "
            "One-shot time | Iterative time (rounds) | Speedup | Straggler penalty "
            "(one-shot / iterative) |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        bw = (format_bits_per_second(r["down_bps"]) if r["down_bps"] == r["up_bps"] else
              f"{format_bits_per_second(r['down_bps'])} / {format_bits_per_second(r['up_bps'])}")
        lines.append(
            f"| {r['profile']} | {r['latency_s'] * 1000:g} ms | {bw} | "
            f"{r['n_clients']} ({r['stragglers']}) | {format_seconds(r['oneshot_seconds'])} | "
            f"{format_seconds(r['iterative_seconds'])} ({r['iterative_rounds']}) | "
            f"{r['speedup']:.3g}x | {format_seconds(r['oneshot_straggler_penalty_s'])} / "
            f"{format_seconds(r['iterative_straggler_penalty_s'])} |")
    return "\n".join(lines) + "\n"
