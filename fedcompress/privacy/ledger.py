"""A site's persistent privacy ledger: every release, with the epsilon the site's own accountant
computes, kept in the site's state folder across messages, runs and restarts.

**Files** (in the site's state folder, created with mode 0700):

* ``ledger.jsonl`` (:data:`FORMAT`): an append-only journal. Its first line names the format and
  a random journal id; each later line is one release: its sequence number, the SHA-256 of the
  line before it (a hash chain), the release and the new state of what it changed (its run, and
  the inputs it voted on). Recording a release appends one line and fsyncs it: the cost does not
  grow with the ledger. A process replays the journal once and then reads only what other
  processes appended since.
* ``ledger.head``: the last line's sequence number, hash and byte offset, replaced atomically
  after each append.
* optionally a second copy of the head elsewhere (the policy's ``ledger-anchor``, e.g. on another
  volume or a write-once mount), written the same way.
* ``ledger.lock``: an exclusive ``fcntl`` lock held while checking and appending, so the
  processes of one site (a site agent, a per-message ClientApp) see one ledger and lose nothing.

**What it detects** (:class:`LedgerError`, never a reset): a line that does not parse or whose
chain breaks (an edit, an insertion, a deletion inside the journal); a journal shorter than its
head or its anchor says (truncated), or whose line at the head's sequence number has another hash
(rolled back to an older copy, or replaced); a head or anchor of another journal; a journal that
is missing while its head is not (deleted); a journal that shrinks or changes under a process
that has read it (the site agent keeps the head it last saw in memory). A line cut short at the
end while no writer holds the lock is a writer that died mid-append, before its release happened
(a release is recorded before it is computed): it is cut off with a warning. A head that lags one
line behind the journal is a writer that died between its append and its head: the head is
brought forward.

**Composition** (what the site's epsilon means):

* **DP-SGD within a run.** The run's first DP-SGD round FIXES the mechanism: noise multiplier
  ``sigma``, sampling rate ``q``, ``delta``, accountant and the run's epsilon target (bounded by
  the policy's ``max-epsilon``). Later rounds of the run must ask for exactly these (the server
  cannot change sigma, q or delta mid-run), and the run's epsilon is the accountant's (opacus'
  RDP or PRV) over ALL the run's steps at that sigma and q. A round whose steps would take the
  run's epsilon above its target is refused before any training. Privacy unit: one training
  example of the site.
* **Text (exponential mechanism).** Each release of sanitized text spends its pure-DP epsilon
  per word (privacy unit: one word of the site's text; a record of k words has k times it);
  releases of a run add up.
* **DP statistics within a run** (FedPrLLM's statistics mode with DP,
  :mod:`fedcompress.privacy.dp_stats`). The run's first release FIXES the mechanism (target
  epsilon, delta, placement, planned number of layer releases ``L``, noise multiplier, Gaussian
  or Skellam, fixed-point bits, SecAgg+ threshold, the clip bounds' digest); a later release
  must ask for exactly these, and at most ``L`` releases are answered. The run's epsilon is the
  accountant's over the releases so far (RDP, composed like DP-SGD's steps). Privacy unit: one
  calibration window. A run does not mix DP statistics with DP-SGD or text releases (refused).
* **Across runs: basic composition.** The lifetime epsilon is the SUM of every run's epsilon
  (DP-SGD run epsilon + its text epsilons) and the deltas add up likewise. Basic summation is
  sound (and loose); it also adds the word-level text epsilons to the example-level DP-SGD
  ones, which is sound for a unit that is both (one word in one example) and conservative
  otherwise. A request that would take the lifetime epsilon above the budget is refused.
* **Releases that are not DP** (binary masks, layer statistics, accuracies, cosine matrices)
  are recorded with epsilon ``"none: not DP"``: the ledger says what left, it bounds nothing.

Spending is recorded BEFORE the release happens (the check and the record are one locked
transaction): a round that fails after its check still counts (conservative).

What is not protected: whoever can write the state folder and the anchor can replace both with
an older copy of each (a backup restored over the site's state rolls its budget back unless the
anchor lives where that user cannot write); the journal's hashes are not signed, so such a user
can also write a new, consistent journal. The state folder's permissions are the site
operator's (the policy refuses one that group or others can write). A run id is the
SuperLink's, so a server that starts a new run for every round gets a fresh per-run budget each
time, but never beyond the lifetime budget.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcompress.privacy.accounting import epsilon_spent
from fedcompress.privacy.policy import PolicyError

__all__ = ["FORMAT", "HEAD_FILE", "LEDGER_FILE", "NOT_DP", "DpSgdMechanism", "Grant", "Ledger",
           "LedgerError", "summary_rows"]

FORMAT = "fedcompress-ledger/2"
LEDGER_FILE = "ledger.jsonl"
HEAD_FILE = "ledger.head"
LOCK_FILE = "ledger.lock"
#: The whole-file ledger of fedcompress before the journal: read once, imported, then renamed
#: to :data:`LEGACY_IMPORTED` (kept, never read again).
LEGACY_FORMAT = "fedcompress-ledger/1"
LEGACY_FILE = "ledger.json"
LEGACY_IMPORTED = "ledger.v1.json"
#: What a release that is not differentially private records as its epsilon.
NOT_DP = "none: not DP"

logger = logging.getLogger(__name__)


class LedgerError(RuntimeError):
    """A ledger that cannot be read, verified or written (never silently reset)."""


@dataclass(frozen=True)
class DpSgdMechanism:
    """A run's DP-SGD mechanism, fixed at its first round."""

    sigma: float
    sample_rate: float
    delta: float
    accountant: str
    target_epsilon: float

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class Grant:
    """What the ledger allowed and recorded: the run's and the lifetime epsilon after it."""

    run_epsilon: float
    lifetime_epsilon: float
    lifetime_budget: float
    run_steps: int = 0
    mechanism: DpSgdMechanism | None = None

    def metrics(self) -> dict[str, float]:
        """The reply's view of the site's ledger."""
        return {"ledger_run_epsilon": self.run_epsilon,
                "ledger_lifetime_epsilon": self.lifetime_epsilon,
                "ledger_lifetime_budget": self.lifetime_budget}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _line(value: dict[str, Any]) -> bytes:
    """One journal line: canonical JSON (sorted keys, no spaces) and a newline."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _replace(path: Path, content: bytes) -> None:
    """Write ``path`` atomically (a temporary file in its folder, fsync, ``os.replace``, fsync
    of the folder), mode 0600."""
    tmp = tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}-",
                                      suffix=".tmp", delete=False)
    try:
        with tmp:
            tmp.write(content)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp.name, 0o600)
        os.replace(tmp.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _digest(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


@dataclass
class _Replay:
    """What a process knows of the journal: where it has read to, and the state it built."""

    journal_id: str = ""
    offset: int = 0
    seq: int = 0
    hash: str = ""
    last_line: int = 0  # the length of the last line read (re-checked before reading on)
    tables: dict[str, dict[str, Any]] = field(default_factory=lambda: {"runs": {},
                                                                       "inputs": {}})
    lifetime_epsilon: float = 0.0
    lifetime_delta: float = 0.0

    def apply(self, changes: dict[str, dict[str, Any]]) -> None:
        for table, values in changes.items():
            rows = self.tables.setdefault(table, {})
            for key, value in values.items():
                if table == "runs":
                    old = rows.get(key) or {}
                    self.lifetime_epsilon += (float(value.get("epsilon", 0.0))
                                              - float(old.get("epsilon", 0.0)))
                    self.lifetime_delta += (float(value.get("delta", 0.0))
                                            - float(old.get("delta", 0.0)))
                rows[key] = value


class _Transaction:
    """The ledger inside one locked transaction: the runs it touched (copies), the releases it
    adds; nothing reaches the journal unless the body returns."""

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay
        self.runs: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, Any] = {}
        self.releases: list[dict[str, Any]] = []

    def run(self, run: str, method: str) -> dict[str, Any]:
        if run not in self.runs:
            stored = self._replay.tables["runs"].get(run)
            self.runs[run] = (json.loads(json.dumps(stored)) if stored is not None else
                              {"method": method, "started": _now(), "epsilon": 0.0,
                               "delta": 0.0, "steps": 0, "text_epsilon": 0.0, "releases": 0})
        entry = self.runs[run]
        if method not in entry["method"].split("+"):  # a run id reused by another method:
            entry["method"] += f"+{method}"  # its releases compose in the same run
        return entry

    def input(self, key: str) -> Any:
        return self.inputs.get(key, self._replay.tables["inputs"].get(key))

    def others_epsilon(self, run: str) -> float:
        """The lifetime epsilon of every run but ``run`` (constant time: running totals)."""
        stored = self._replay.tables["runs"].get(run) or {}
        return max(self._replay.lifetime_epsilon - float(stored.get("epsilon", 0.0)), 0.0)

    def others_delta(self, run: str) -> float:
        stored = self._replay.tables["runs"].get(run) or {}
        return max(self._replay.lifetime_delta - float(stored.get("delta", 0.0)), 0.0)

    def lifetime_epsilon(self) -> float:
        total = self._replay.lifetime_epsilon
        for run, entry in self.runs.items():
            stored = self._replay.tables["runs"].get(run) or {}
            total += float(entry["epsilon"]) - float(stored.get("epsilon", 0.0))
        return total


class Ledger:
    """The ledger of the site whose state folder is ``state_dir`` (created 0700 if missing).
    ``anchor``: a second copy of the head (the policy's ``ledger-anchor``), checked and kept
    like the head. One object per process may serve many messages: it reads only what was
    appended since its last transaction."""

    def __init__(self, state_dir: str | os.PathLike[str], lifetime_budget: float,
                 anchor: str | os.PathLike[str] | None = None,
                 lifetime_delta: float = math.inf) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / LEDGER_FILE
        self.head_path = self.dir / HEAD_FILE
        self.anchor = Path(anchor) if anchor else None
        self.lifetime_budget = float(lifetime_budget)
        self.lifetime_delta = float(lifetime_delta)
        self._replay: _Replay | None = None

    # -- reading ------------------------------------------------------------------------------

    def read(self) -> dict[str, Any]:
        """The ledger's content, verified from its first line: ``format``, ``runs``,
        ``inputs``, every release in order (``releases``) and the journal's length (``seq``).
        An empty ledger when there is no journal yet (nor an older ledger to import)."""
        if not self.dir.is_dir():
            return {"format": FORMAT, "runs": {}, "inputs": {}, "releases": [], "seq": 0}
        with self._locked(fcntl.LOCK_SH):
            if not self.path.exists():
                legacy = self._legacy()
                if legacy is not None:
                    return {"format": FORMAT, "runs": legacy["runs"], "inputs": {},
                            "releases": list(legacy["releases"]), "seq": 0}
                self._check_no_head()
                return {"format": FORMAT, "runs": {}, "inputs": {}, "releases": [], "seq": 0}
            replay = _Replay()
            releases: list[dict[str, Any]] = []
            heads = self._read_heads()
            seen = {h["seq"]: "" for _, h in heads.values() if h is not None}
            self._scan(replay, releases, False, seen)
            self._check_heads(replay, heads, seen, repair=False)
        return {"format": FORMAT, "runs": replay.tables["runs"],
                "inputs": replay.tables["inputs"], "releases": releases, "seq": replay.seq}

    def lifetime_spent(self, data: dict[str, Any] | None = None) -> float:
        """The lifetime epsilon: the sum of every run's epsilon (basic composition)."""
        data = self.read() if data is None else data
        return float(sum(float(run.get("epsilon", 0.0)) for run in data["runs"].values()))

    # -- the journal ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _error(self, what: str) -> LedgerError:
        return LedgerError(f"privacy ledger {self.path}: {what}: refusing to release anything; "
                           "restore the state folder from a backup (never delete the ledger: "
                           "that would reset this site's budget)")

    def _scan(self, replay: _Replay, releases: list[dict[str, Any]] | None, repair: bool,
              seen: dict[int, str]) -> None:
        """Read the journal from ``replay``'s offset on, checking the chain, and apply each
        line; ``seen``: the hash of each line whose sequence number is a key of it (the
        heads'). The line ``replay`` read last is checked first (a journal rewritten under this
        process is refused). ``repair``: cut off a line left incomplete by a dead writer (the
        caller holds the exclusive lock)."""
        if replay.seq in seen and replay.offset:
            seen[replay.seq] = replay.hash
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < replay.offset:
                raise self._error(f"the journal shrank to {size:,} bytes while this process "
                                  f"had read {replay.offset:,} (truncated or rolled back)")
            if replay.offset:
                f.seek(replay.offset - replay.last_line)
                if _digest(f.read(replay.last_line)) != replay.hash:
                    raise self._error(f"line {replay.seq} changed after this process read it "
                                      "(rewritten or rolled back)")
            else:
                f.seek(0)
            data = f.read()
        position = replay.offset
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                if not repair:  # a writer may be appending: the line is not there yet
                    break
                logger.warning("privacy ledger %s: its last line (%d bytes) was left "
                               "incomplete by a writer that died before its release; cutting "
                               "it off", self.path, len(raw))
                with open(self.path, "r+b") as f:
                    f.truncate(position)
                    os.fsync(f.fileno())
                break
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
            except (UnicodeDecodeError, ValueError) as err:
                raise self._error(f"line {replay.seq + 1} is not a journal line ({err})"
                                  ) from None
            if position == 0:
                if record.get("format") != FORMAT or not record.get("id"):
                    raise self._error(f"its first line is not a {FORMAT} header")
                replay.journal_id = str(record["id"])
            else:
                if record.get("seq") != replay.seq + 1 or record.get("prev") != replay.hash:
                    raise self._error(f"line {replay.seq + 1} does not follow line "
                                      f"{replay.seq} (seq {record.get('seq')!r}; the hash "
                                      "chain is broken: edited, inserted or deleted lines)")
                replay.seq += 1
                changes = record.get("set") or {}
                if not isinstance(changes, dict) or not all(isinstance(v, dict)
                                                            for v in changes.values()):
                    raise self._error(f"line {replay.seq} has a malformed 'set'")
                replay.apply(changes)
                if releases is not None:
                    releases.extend(record.get("imported") or [])
                    releases.append(record.get("release") or {})
            replay.hash = _digest(raw)
            replay.last_line = len(raw)
            if replay.seq in seen:
                seen[replay.seq] = replay.hash
            position += len(raw)
        replay.offset = position
        if replay.offset == 0:
            raise self._error("the journal is empty (no header line)")

    def _read_head(self, path: Path) -> dict[str, Any] | None:
        try:
            head = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._error(f"its head {path} cannot be read ({err})") from None
        if (not isinstance(head, dict) or head.get("format") != FORMAT
                or not isinstance(head.get("seq"), int) or not isinstance(head.get("hash"), str)):
            raise self._error(f"its head {path} is not a {FORMAT} head")
        return head

    def _heads(self) -> list[tuple[str, Path]]:
        return [("head", self.head_path)] + ([("anchor", self.anchor)] if self.anchor else [])

    def _read_heads(self) -> dict[str, tuple[Path, dict[str, Any] | None]]:
        return {name: (path, self._read_head(path)) for name, path in self._heads()}

    def _check_heads(self, replay: _Replay, heads: dict[str, tuple[Path, dict | None]],
                     seen: dict[int, str], repair: bool) -> None:
        """The head (and the anchor), read before the journal, against it: never ahead of it,
        the same hash at its sequence number (``seen``, filled by :meth:`_scan`; a head older
        than what this process had read already is only brought forward). A head behind the
        journal is brought forward when ``repair``; a missing anchor is written."""
        for name, (path, head) in heads.items():
            if head is None:
                if name == "head" and replay.seq > 0:
                    raise self._error(f"its head {path} is missing while the journal holds "
                                      f"{replay.seq} releases (deleted?)")
                if repair:
                    self._write_head(path, replay)
                continue
            if head.get("id") != replay.journal_id:
                raise self._error(f"its {name} {path} belongs to another journal (id "
                                  f"{str(head.get('id'))[:12]}, this journal "
                                  f"{replay.journal_id[:12]}): replaced?")
            if head["seq"] > replay.seq:
                raise self._error(f"the journal ends at release {replay.seq} but its {name} "
                                  f"{path} records release {head['seq']}: truncated or rolled "
                                  "back")
            known = seen.get(head["seq"]) or None
            if known is not None and known != head["hash"]:
                raise self._error(f"release {head['seq']} of the journal differs from the one "
                                  f"its {name} {path} records: rolled back or replaced")
            if repair and head["seq"] < replay.seq:
                if head["seq"] < replay.seq - 1:
                    logger.warning("privacy ledger %s: its %s was %d releases behind; brought "
                                   "forward", self.path, name, replay.seq - head["seq"])
                self._write_head(path, replay)

    def _check_no_head(self) -> None:
        for name, path in self._heads():
            if path.exists():
                raise self._error(f"the journal is missing while its {name} {path} is not "
                                  "(deleted?)")

    def _write_head(self, path: Path, replay: _Replay) -> None:
        _replace(path, json.dumps({"format": FORMAT, "id": replay.journal_id, "seq": replay.seq,
                                   "hash": replay.hash, "bytes": replay.offset}).encode())

    def _create(self) -> None:
        """A new journal (its header line), importing the older whole-file ledger if there is
        one (renamed to :data:`LEGACY_IMPORTED` after)."""
        self._check_no_head()
        legacy = self._legacy()
        header = _line({"format": FORMAT, "id": secrets.token_hex(16), "created": _now()})
        lines = [header]
        if legacy is not None:
            lines.append(_line({"seq": 1, "prev": _digest(header), "time": _now(),
                                "release": {"kind": "import", "source": LEGACY_FILE,
                                            "releases": len(legacy["releases"])},
                                "imported": legacy["releases"],
                                "set": {"runs": legacy["runs"]}}))
        _replace(self.path, b"".join(lines))
        created = _Replay(journal_id=json.loads(header)["id"], offset=sum(map(len, lines)),
                          seq=len(lines) - 1, hash=_digest(lines[-1]))
        for _, path in self._heads():
            self._write_head(path, created)
        if legacy is not None:
            os.replace(self.dir / LEGACY_FILE, self.dir / LEGACY_IMPORTED)
            logger.info("privacy ledger %s: imported %d releases of %s (kept as %s)", self.path,
                        len(legacy["releases"]), LEGACY_FILE, LEGACY_IMPORTED)

    def _legacy(self) -> dict[str, Any] | None:
        path = self.dir / LEGACY_FILE
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LedgerError(f"privacy ledger {path} cannot be read ({err}): refusing to "
                              "release anything; restore it from a backup (never delete it: "
                              "that would reset this site's budget)") from err
        if (not isinstance(data, dict) or data.get("format") != LEGACY_FORMAT
                or not isinstance(data.get("runs"), dict)
                or not isinstance(data.get("releases"), list)):
            raise LedgerError(f"privacy ledger {path} is not a {LEGACY_FORMAT} ledger: refusing "
                              "to release anything; restore it from a backup")
        return data

    # -- transactions -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_Transaction]:
        """The ledger under the exclusive lock, brought up to date; the releases the body adds
        are appended (one line each) and the head replaced; nothing is written if it raises."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._locked(fcntl.LOCK_EX):
            if not self.path.exists():
                if self._replay is not None:
                    raise self._error("the journal this process read is gone (deleted)")
                self._create()
            replay = self._replay or _Replay()
            heads = self._read_heads()
            seen = {h["seq"]: "" for _, h in heads.values() if h is not None}
            self._scan(replay, None, True, seen)
            self._check_heads(replay, heads, seen, repair=True)
            self._replay = replay
            txn = _Transaction(replay)
            yield txn
            if not txn.releases:
                return
            lines = []
            for i, release in enumerate(txn.releases):
                run = str(release.get("run"))  # each line: the state its run ends with
                changes: dict[str, dict[str, Any]] = (
                    {"runs": {run: txn.runs[run]}} if run in txn.runs else {})
                if i == len(txn.releases) - 1:  # and the rest after the last release
                    changes["runs"] = dict(txn.runs)
                    if txn.inputs:
                        changes["inputs"] = dict(txn.inputs)
                line = _line({"seq": replay.seq + 1, "prev": replay.hash, "release": release,
                              "set": changes})
                lines.append(line)
                replay.seq += 1
                replay.hash = _digest(line)
                replay.last_line = len(line)
                replay.apply(changes)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, b"".join(lines))
                os.fsync(fd)
            finally:
                os.close(fd)
            replay.offset += sum(len(line) for line in lines)
            for _, path in self._heads():
                self._write_head(path, replay)

    def _check_lifetime_delta(self, txn: _Transaction, run: str, new_run_delta: float) -> None:
        others = txn.others_delta(run)
        if others + new_run_delta > self.lifetime_delta * (1 + 1e-9):
            raise PolicyError(f"this release would bring the site's lifetime delta to "
                              f"{others + new_run_delta:.3g}, above its bound lifetime-delta="
                              f"{self.lifetime_delta:g} ({others:.3g} already by other runs; "
                              "node config lifetime-delta)")

    def _check_lifetime(self, txn: _Transaction, run: str, new_run_epsilon: float) -> float:
        others = txn.others_epsilon(run)
        total = others + new_run_epsilon
        if total > self.lifetime_budget + 1e-9:
            raise PolicyError(f"this release would bring the site's lifetime epsilon to "
                              f"{total:.4g}, above its budget lifetime-epsilon="
                              f"{self.lifetime_budget:g} ({others:.4g} already spent by other "
                              f"runs, {new_run_epsilon:.4g} by run {run}; node config "
                              "lifetime-epsilon)")
        return total

    def dp_sgd(self, run: str, method: str, action: str, proposal: DpSgdMechanism, steps: int,
               detail: dict[str, Any] | None = None) -> Grant:
        """Check and record ``steps`` DP-SGD steps of run ``run``: the run's first round fixes
        ``proposal`` as its mechanism; a later round must propose the same (else refused). The
        run's epsilon over all its steps at that mechanism must stay within its target, the
        lifetime within the budget; else :class:`PolicyError` before anything is recorded."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise PolicyError(f"steps={steps!r} is invalid: expected an int >= 1")
        with self._transaction() as txn:
            entry = txn.run(run, method)
            if entry.get("dp_stats") is not None:
                raise PolicyError(f"run {run} released DP statistics: it cannot also train "
                                  "with DP-SGD (one mechanism per run)")
            fixed = entry.get("mechanism")
            if fixed is None:
                mechanism = proposal
                entry["mechanism"] = proposal.to_dict()
            else:
                mechanism = DpSgdMechanism(**fixed)
                changed = {k: (fixed[k], v) for k, v in proposal.to_dict().items()
                           if not _same(fixed[k], v)}
                if changed:
                    raise PolicyError(
                        f"run {run} fixed its DP-SGD mechanism at its first round; this round "
                        "asks for "
                        + ", ".join(f"{k}={new!r} (fixed: {old!r})"
                                    for k, (old, new) in changed.items())
                        + ": the server cannot change sigma, q, delta or the target mid-run")
            total_steps = int(entry["steps"]) + steps
            dp_epsilon = epsilon_spent(mechanism.sigma, mechanism.sample_rate, total_steps,
                                       mechanism.delta, mechanism.accountant)
            run_epsilon = dp_epsilon + float(entry["text_epsilon"])
            # The run's text releases count against the same target: text then DP-SGD in one
            # run must not exceed it together (DP-SGD then text is bounded in :meth:`text`).
            if run_epsilon > mechanism.target_epsilon * (1 + 1e-6):
                raise PolicyError(
                    f"{steps} more DP-SGD steps would bring run {run}'s epsilon to "
                    f"{run_epsilon:.4g} (DP-SGD {dp_epsilon:.4g}: {total_steps} steps at "
                    f"sigma={mechanism.sigma:.4g}, q={mechanism.sample_rate:.4g}; text "
                    f"{float(entry['text_epsilon']):.4g}), above the run's target "
                    f"{mechanism.target_epsilon:g} (bounded by node config max-epsilon): the "
                    "run's budget is spent; no more rounds")
            lifetime = self._check_lifetime(txn, run, run_epsilon)
            self._check_lifetime_delta(txn, run, mechanism.delta)
            entry.update(epsilon=run_epsilon, delta=mechanism.delta, steps=total_steps,
                         releases=int(entry["releases"]) + 1)
            txn.releases.append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "dp-sgd", "steps": steps,
                                     "epsilon": dp_epsilon, **(detail or {})})
        return Grant(run_epsilon, lifetime, self.lifetime_budget, total_steps, mechanism)

    def dp_stats(self, run: str, method: str, action: str, plan: Any,
                 detail: dict[str, Any] | None = None) -> Grant:
        """Check and record one DP statistics release (one decoder layer) of run ``run`` under
        ``plan`` (a :class:`~fedcompress.privacy.dp_stats.DpStatsPlan`): the run's first
        release fixes ``plan.ledger_mechanism()``; a later one must propose the same (else
        refused); at most ``plan.releases`` releases; the run's epsilon is
        ``plan.epsilon_after(releases)``, within the target, the lifetime within the budget.
        :class:`PolicyError` before anything is recorded."""
        proposal = plan.ledger_mechanism()
        with self._transaction() as txn:
            entry = txn.run(run, method)
            fixed = entry.get("dp_stats")
            if entry.get("mechanism") is not None or float(entry["text_epsilon"]) > 0:
                raise PolicyError(f"run {run} already spent epsilon on DP-SGD or text: it "
                                  "cannot also release DP statistics (one mechanism per run)")
            if fixed is None:
                entry["dp_stats"] = fixed = proposal
                entry["dp_releases"] = 0
            changed = {k: (fixed.get(k), v) for k, v in proposal.items()
                       if k not in fixed or not _same(fixed[k], v)}
            if changed:
                raise PolicyError(
                    f"run {run} fixed its DP statistics mechanism at its first release; this "
                    "release asks for "
                    + ", ".join(f"{k}={new!r} (fixed: {old!r})"
                                for k, (old, new) in sorted(changed.items()))
                    + ": the server cannot change the budget, the noise, the clip bounds or "
                    "the number of releases mid-run")
            count = int(entry["dp_releases"]) + 1
            if count > int(fixed["releases"]):
                raise PolicyError(
                    f"run {run} announced {fixed['releases']} DP statistics releases and has "
                    f"made them all; release {count} is refused (its epsilon would exceed the "
                    f"run's target {float(fixed['epsilon']):g})")
            run_epsilon = float(plan.epsilon_after(count))
            if run_epsilon > float(fixed["epsilon"]) * (1 + 1e-6):
                raise PolicyError(f"release {count} would bring run {run}'s epsilon to "
                                  f"{run_epsilon:.4g}, above its target "
                                  f"{float(fixed['epsilon']):g}")
            lifetime = self._check_lifetime(txn, run, run_epsilon)
            self._check_lifetime_delta(txn, run, float(fixed["delta"]))
            entry.update(epsilon=run_epsilon, delta=float(fixed["delta"]), dp_releases=count,
                         releases=int(entry["releases"]) + 1)
            txn.releases.append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "dp-stats",
                                     "epsilon": run_epsilon, "delta": float(fixed["delta"]),
                                     "placement": fixed["placement"], "unit": fixed["unit"],
                                     "release": count, **(detail or {})})
        return Grant(run_epsilon, lifetime, self.lifetime_budget, count)

    def text(self, run: str, method: str, action: str, epsilon_per_word: float,
             max_epsilon: float, detail: dict[str, Any] | None = None) -> Grant:
        """Check and record a release of exponential-mechanism text at ``epsilon_per_word``
        (its pure-DP epsilon per word): the run's epsilon (its text releases added) must stay
        within ``max_epsilon``, the lifetime within the budget."""
        if isinstance(epsilon_per_word, bool) or not isinstance(epsilon_per_word, (int, float)) \
                or not math.isfinite(epsilon_per_word) or epsilon_per_word <= 0:
            raise PolicyError(f"epsilon per word {epsilon_per_word!r} is invalid: expected a "
                              "finite number > 0")
        with self._transaction() as txn:
            entry = txn.run(run, method)
            if entry.get("dp_stats") is not None:
                raise PolicyError(f"run {run} released DP statistics: it cannot also release "
                                  "text (one mechanism per run)")
            run_epsilon = float(entry["epsilon"]) + float(epsilon_per_word)
            if run_epsilon > max_epsilon + 1e-9:
                raise PolicyError(f"this text release would bring run {run}'s epsilon per word "
                                  f"to {run_epsilon:.4g}, above this site's bound max-epsilon="
                                  f"{max_epsilon:g} (node config max-epsilon)")
            lifetime = self._check_lifetime(txn, run, run_epsilon)
            entry.update(epsilon=run_epsilon,
                         text_epsilon=float(entry["text_epsilon"]) + float(epsilon_per_word),
                         releases=int(entry["releases"]) + 1)
            txn.releases.append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "exponential-mechanism",
                                     "epsilon": float(epsilon_per_word),
                                     "unit": "one word", **(detail or {})})
        return Grant(run_epsilon, lifetime, self.lifetime_budget)

    def input_release(self, run: str, method: str, action: str, key: str, layer: int,
                      runs_per_input: int) -> Grant:
        """Check and record that run ``run`` releases something computed on the input ``key``
        (a digest of the site's windows, its model and what is computed) for decoder layer
        ``layer`` (-1: every layer at once), before it is computed. Refused: a second release of
        a layer in one run, a one-shot and a per-layer release in one run (their first layer
        has the same input), and a run beyond the ``runs_per_input``-th on one input (sums of
        different runs over the same inputs can be differenced)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < -1:
            raise PolicyError(f"layer={layer!r} is invalid: expected -1 or an int >= 0")
        with self._transaction() as txn:
            entry = txn.run(run, method)
            stored = txn.input(key) or {"runs": [], "layers": {}}
            runs: list[str] = list(stored["runs"])
            layers: dict[str, list[int]] = {r: list(ls) for r, ls in stored["layers"].items()}
            done = layers.get(run, [])
            what = "every layer at once" if layer < 0 else f"layer {layer}"
            if layer in done:
                raise PolicyError(f"run {run} already released {what} on this input: a second "
                                  "release of the same input is refused")
            if done and (layer < 0 or -1 in done):
                before = ("every layer at once" if -1 in done
                          else "layers " + ", ".join(map(str, done)))
                raise PolicyError(f"run {run} already released {before} on this input, and "
                                  f"asks for {what}: a one-shot and a per-layer release share "
                                  "their first layer's input; refused")
            if run not in runs:
                if len(runs) >= runs_per_input:
                    raise PolicyError(
                        f"this site already released masks or statistics on this input in "
                        f"{len(runs)} run(s), its bound (node config "
                        f"runs-per-input={runs_per_input}): sums of several runs over the same "
                        "input can be differenced; refused")
                runs.append(run)
            layers[run] = [*done, layer]
            txn.inputs[key] = {"runs": runs, "layers": layers}
            txn.releases.append({"time": _now(), "run": run, "method": method,
                                 "action": action, "kind": "input", "input": key[:16],
                                 "layer": layer, "epsilon": NOT_DP})
            run_epsilon = float(entry["epsilon"])
            lifetime = txn.lifetime_epsilon()
        return Grant(run_epsilon, lifetime, self.lifetime_budget)

    def not_dp(self, run: str, method: str, action: str,
               detail: dict[str, Any] | None = None, limit: int | None = None) -> Grant:
        """Record a release that is not differentially private (masks, statistics, scores);
        refused beyond ``limit`` such releases in the run (the policy's
        ``non-dp-releases-per-run``)."""
        with self._transaction() as txn:
            entry = txn.run(run, method)
            count = int(entry.get("not_dp", 0)) + 1
            if limit is not None and count > limit:
                raise PolicyError(f"run {run} has made {count - 1} releases that are not DP, "
                                  f"this site's bound (node config non-dp-releases-per-run="
                                  f"{limit}): {action} is refused")
            entry["not_dp"] = count
            entry["releases"] = int(entry["releases"]) + 1
            txn.releases.append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "not-dp", "epsilon": NOT_DP,
                                     **(detail or {})})
            run_epsilon = float(entry["epsilon"])
            lifetime = txn.lifetime_epsilon()
        return Grant(run_epsilon, lifetime, self.lifetime_budget)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9)


def summary_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run of a ledger's content: run, method, releases (DP and not), epsilon."""
    rows = []
    for run, entry in data["runs"].items():
        kinds: dict[str, int] = {}
        for release in data["releases"]:
            if release["run"] == run:
                kinds[release["kind"]] = kinds.get(release["kind"], 0) + 1
        mechanism = entry.get("mechanism") or entry.get("dp_stats") or {}
        rows.append({"run": run, "method": entry["method"], "started": entry["started"],
                     "releases": int(entry["releases"]), "kinds": kinds,
                     "steps": int(entry["steps"]), "epsilon": float(entry["epsilon"]),
                     "delta": float(entry["delta"]),
                     "target": mechanism.get("target_epsilon", mechanism.get("epsilon")),
                     "sigma": mechanism.get("sigma")})
    return rows
