"""A site's persistent privacy ledger: every release, with the epsilon the site's own accountant
computes, kept in the site's state folder across messages, runs and restarts.

File: ``<state-dir>/ledger.json`` (JSON, :data:`FORMAT`), rewritten atomically (a temporary file
in the same folder, fsync, ``os.replace``, fsync of the folder) under an exclusive ``fcntl``
lock on ``<state-dir>/ledger.lock``, so concurrent processes of one site (a SuperNode's
per-message ClientApps, a warm worker) see one ledger and never lose an entry. A file that
cannot be read or parsed is an error (:class:`LedgerError`), never a reset to an empty ledger.

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

What is not protected: a local user who can write the state folder can delete the ledger (the
folder's permissions are the site operator's); a run id is the SuperLink's, so a server that
starts a new run for every round gets a fresh per-run budget each time, but never beyond the
lifetime budget.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcompress.privacy.accounting import epsilon_spent
from fedcompress.privacy.policy import PolicyError

__all__ = ["FORMAT", "LEDGER_FILE", "NOT_DP", "DpSgdMechanism", "Grant", "Ledger",
           "LedgerError", "summary_rows"]

FORMAT = "fedcompress-ledger/1"
LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
#: What a release that is not differentially private records as its epsilon.
NOT_DP = "none: not DP"


class LedgerError(RuntimeError):
    """A ledger file that cannot be read, parsed or written (never silently reset)."""


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


class Ledger:
    """The ledger of the site whose state folder is ``state_dir`` (created 0700 if missing)."""

    def __init__(self, state_dir: str | os.PathLike[str], lifetime_budget: float) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / LEDGER_FILE
        self.lifetime_budget = float(lifetime_budget)

    # -- reading ------------------------------------------------------------------------------

    def read(self) -> dict[str, Any]:
        """The ledger's content (an empty ledger when the file does not exist yet)."""
        if not self.path.exists():
            return {"format": FORMAT, "runs": {}, "releases": []}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LedgerError(f"privacy ledger {self.path} cannot be read ({err}): refusing to "
                              "release anything; restore it from a backup (never delete it: "
                              "that would reset this site's budget)") from err
        if (not isinstance(data, dict) or data.get("format") != FORMAT
                or not isinstance(data.get("runs"), dict)
                or not isinstance(data.get("releases"), list)):
            raise LedgerError(f"privacy ledger {self.path} is not a {FORMAT} ledger: refusing "
                              "to release anything; restore it from a backup")
        return data

    def lifetime_spent(self, data: dict[str, Any] | None = None) -> float:
        """The lifetime epsilon: the sum of every run's epsilon (basic composition)."""
        data = self.read() if data is None else data
        return float(sum(float(run.get("epsilon", 0.0)) for run in data["runs"].values()))

    # -- transactions -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[dict[str, Any]]:
        """The ledger under the exclusive lock; what the body leaves in it is written atomically
        (nothing is written if the body raises)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self.read()
            yield data
            self._write(data)
        finally:
            os.close(fd)  # releases the lock

    def _write(self, data: dict[str, Any]) -> None:
        text = json.dumps(data, indent=1, sort_keys=True)
        tmp = tempfile.NamedTemporaryFile("w", dir=self.dir, prefix=".ledger-", suffix=".tmp",
                                          delete=False)
        try:
            with tmp:
                tmp.write(text)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.chmod(tmp.name, 0o600)
            os.replace(tmp.name, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)
            raise
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _run(self, data: dict[str, Any], run: str, method: str) -> dict[str, Any]:
        entry = data["runs"].setdefault(run, {"method": method, "started": _now(),
                                              "epsilon": 0.0, "delta": 0.0, "steps": 0,
                                              "text_epsilon": 0.0, "releases": 0})
        if method not in entry["method"].split("+"):  # a run id reused by another method:
            entry["method"] += f"+{method}"  # its releases compose in the same run
        return entry

    def _check_lifetime(self, data: dict[str, Any], run: str, new_run_epsilon: float) -> float:
        others = sum(float(r.get("epsilon", 0.0)) for k, r in data["runs"].items() if k != run)
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
        with self._transaction() as data:
            entry = self._run(data, run, method)
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
            lifetime = self._check_lifetime(data, run, run_epsilon)
            entry.update(epsilon=run_epsilon, delta=mechanism.delta, steps=total_steps,
                         releases=int(entry["releases"]) + 1)
            data["releases"].append({"time": _now(), "run": run, "method": method,
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
        with self._transaction() as data:
            entry = self._run(data, run, method)
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
            lifetime = self._check_lifetime(data, run, run_epsilon)
            entry.update(epsilon=run_epsilon, delta=float(fixed["delta"]), dp_releases=count,
                         releases=int(entry["releases"]) + 1)
            data["releases"].append({"time": _now(), "run": run, "method": method,
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
        with self._transaction() as data:
            entry = self._run(data, run, method)
            if entry.get("dp_stats") is not None:
                raise PolicyError(f"run {run} released DP statistics: it cannot also release "
                                  "text (one mechanism per run)")
            run_epsilon = float(entry["epsilon"]) + float(epsilon_per_word)
            if run_epsilon > max_epsilon + 1e-9:
                raise PolicyError(f"this text release would bring run {run}'s epsilon per word "
                                  f"to {run_epsilon:.4g}, above this site's bound max-epsilon="
                                  f"{max_epsilon:g} (node config max-epsilon)")
            lifetime = self._check_lifetime(data, run, run_epsilon)
            entry.update(epsilon=run_epsilon,
                         text_epsilon=float(entry["text_epsilon"]) + float(epsilon_per_word),
                         releases=int(entry["releases"]) + 1)
            data["releases"].append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "exponential-mechanism",
                                     "epsilon": float(epsilon_per_word),
                                     "unit": "one word", **(detail or {})})
        return Grant(run_epsilon, lifetime, self.lifetime_budget)

    def not_dp(self, run: str, method: str, action: str,
               detail: dict[str, Any] | None = None) -> Grant:
        """Record a release that is not differentially private (masks, statistics, scores)."""
        with self._transaction() as data:
            entry = self._run(data, run, method)
            entry["releases"] = int(entry["releases"]) + 1
            data["releases"].append({"time": _now(), "run": run, "method": method,
                                     "action": action, "kind": "not-dp", "epsilon": NOT_DP,
                                     **(detail or {})})
            run_epsilon = float(entry["epsilon"])
            lifetime = self.lifetime_spent(data)
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
