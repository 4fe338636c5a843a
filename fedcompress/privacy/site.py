"""What a site does around every message, whatever its method (no Flower): admit the request
under the site's policy, open its ledger, record a release that is not DP, and say in the reply
what the ledger says.

The site's operation runner (``clients/site_agent.py``) calls :func:`admit` before a handler
runs and :func:`record_release` after it (unless the handler recorded a DP release itself, which a
method's DP code does through :func:`ledger` before it trains or perturbs anything). The generic
checks here: simulation-only switches (fault injection, attack models) outside simulation; the
model spec; the corpora or tasks the server names (always for ``task`` and ``corpus``, which no
``data-path`` replaces; for ``calib_text`` and ``wire_reference`` when the site has no
``data-path``).

The policy is read once per message: :func:`admit` reads it, the runner holds it while the
handler runs (:func:`admitted`), and a handler asks for it with :func:`policy` (the same
object; the file is not read again, so a policy file changed mid-message cannot make one
message's checks disagree).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from fedcompress.privacy.ledger import Grant, Ledger
from fedcompress.privacy.policy import SitePolicy, site_policy

__all__ = ["CORPUS_KEYS", "SiteError", "admit", "admitted", "input_key", "is_simulated",
           "ledger", "ledger_metrics", "policy", "public_error", "record_input",
           "record_release"]

#: Settings naming a corpus or task a site loads: (key, replaced by the site's data-path)
CORPUS_KEYS: tuple[tuple[str, bool], ...] = (("calib_text", True), ("wire_reference", True),
                                             ("task", False), ("corpus", False))


class SiteError(RuntimeError):
    """An error a site sends to the server: its message names settings, keys and bounds,
    never a private value (a record, a path, a number computed from the site's data)."""


def is_simulated(node_config: Mapping[str, Any]) -> bool:
    """Whether this site is a simulated one (:func:`~fedcompress.privacy.policy.site_policy`'s
    rule, without reading the policy: for an error raised before the policy is read)."""
    from fedcompress.privacy.policy import in_simulation_engine

    mode = str(node_config.get("site-mode", "") or "")
    return mode == "simulation" or (mode == "" and in_simulation_engine())


def public_error(action: str, err: BaseException) -> str:
    """What a deployed site tells the server about ``err`` raised by ``action``: the text of
    the errors whose messages name only settings and bounds (this module's
    :class:`SiteError`, a settings error, a SecAgg+ protocol error); for any other, its class
    only (its text may quote the site's data; the site's log has it)."""
    from fedcompress.config import SettingsError
    from fedcompress.privacy.secagg import SecAggError

    if isinstance(err, (SiteError, SettingsError, SecAggError)):
        return f"{type(err).__name__}: {err}"
    return (f"{action} failed at this site ({type(err).__name__}); a deployed site does not "
            "send an error's text, which may quote its data: the site's log has it")


def _flat(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in settings.items()}


def admit(node_config: Mapping[str, Any], settings: Mapping[str, Any] | None,
          action: str = "", clear: str = "") -> SitePolicy:
    """This site's policy, after checking the generic parts of a request's ``settings`` (the
    message's ``config`` record) and, for an ``action`` that releases ``clear`` (the site's
    masks or statistics) in the clear, whether the policy requires SecAgg+: raises
    :class:`~fedcompress.privacy.policy.PolicyError`."""
    policy = site_policy(node_config)
    flat = _flat(settings or {})
    policy.check_simulation_switches(flat)
    if flat.get("model"):
        policy.check_model(str(flat["model"]))
    has_data = bool(node_config.get("data-path"))
    for key, replaced in CORPUS_KEYS:
        value = str(flat.get(key) or "")
        if replaced and has_data:
            continue
        for name in value.split("+"):
            if name.strip() and name.strip() != "none":
                policy.check_corpus(name.strip())
    if clear:  # last: a more specific refusal above names its own key
        policy.check_clear_release(action, clear)
    return policy


#: the policy that admitted the message being handled, with the node config it was read from
_ADMITTED: ContextVar[tuple[Mapping[str, Any], SitePolicy] | None] = ContextVar(
    "fedcompress_admitted_policy", default=None)


@contextlib.contextmanager
def admitted(node_config: Mapping[str, Any], policy: SitePolicy) -> Iterator[SitePolicy]:
    """While the handler of a message admitted under ``policy`` runs: :func:`policy` of the
    same ``node_config`` (the same object) returns it instead of reading the policy again."""
    token = _ADMITTED.set((node_config, policy))
    try:
        yield policy
    finally:
        _ADMITTED.reset(token)


def policy(node_config: Mapping[str, Any]) -> SitePolicy:
    """This site's policy: the one that admitted the message being handled (:func:`admitted`),
    else read from ``node_config`` now (a handler called outside the runner, e.g. a test)."""
    held = _ADMITTED.get()
    if held is not None and held[0] is node_config:
        return held[1]
    return site_policy(node_config)


#: the ledgers this process opened: each reads only what was appended since its last use
_LEDGERS: dict[tuple[str, float, str, float], Ledger] = {}


def ledger(policy: SitePolicy, run_id: int | str) -> Ledger:
    """The site's ledger (a simulation's temporary state: one folder per run, no lifetime
    budget), one object per process and folder."""
    if policy.ephemeral_state:
        key = (str(Path(policy.state_dir) / f"run-{run_id}"), math.inf, "", math.inf)
    else:
        key = (policy.state_dir, policy.lifetime_epsilon, policy.ledger_anchor,
               policy.lifetime_delta)
    if key not in _LEDGERS:
        if len(_LEDGERS) >= 64:  # a simulation's per-run folders: forget the oldest
            _LEDGERS.pop(next(iter(_LEDGERS)))
        _LEDGERS[key] = Ledger(key[0], key[1], anchor=key[2] or None, lifetime_delta=key[3])
    return _LEDGERS[key]


def ledger_metrics(policy: SitePolicy, grant: Grant, dp: bool) -> dict[str, float]:
    """What a reply carries of the site's ledger: the run's and the lifetime epsilon (and the
    budget when there is one), whether this release was DP (``ledger_dp`` 0: not DP, its
    epsilon is "none"), whether the site enforced its bounds and kept its draws secret."""
    out = {"ledger_run_epsilon": float(grant.run_epsilon),
           "ledger_lifetime_epsilon": float(grant.lifetime_epsilon),
           "ledger_dp": 1 if dp else 0,
           "site_policy_enforced": 0 if policy.simulation else 1,
           "secrets_reproducible": 1 if policy.reproducible_secrets else 0}
    if math.isfinite(grant.lifetime_budget):
        out["ledger_lifetime_budget"] = float(grant.lifetime_budget)
    return out


def record_input(policy: SitePolicy, run_id: int | str, method: str, action: str,
                 key: str, layer: int) -> None:
    """Before a release of masks or statistics that is not DP: check and record in the ledger
    that run ``run_id`` releases ``layer`` (-1: every layer) computed on the input ``key``
    (:meth:`~fedcompress.privacy.ledger.Ledger.input_release`: one release per layer and run,
    not both a one-shot and a per-layer one, at most ``runs-per-input`` runs per input). In
    simulation (the server runs the sites) nothing is enforced."""
    if policy.simulation:
        return
    ledger(policy, run_id).input_release(str(run_id), method, action, key, layer,
                                         policy.runs_per_input)


def input_key(model: str, what: str, windows: Any) -> str:
    """The digest naming an input: the model spec, what is computed (``masks``,
    ``statistics``) and the token ids of every window, in order."""
    import hashlib

    digest = hashlib.sha256(f"{model}|{what}|{len(windows)}".encode())
    for window in windows:
        digest.update(window.detach().cpu().numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def record_release(policy: SitePolicy, run_id: int | str, method: str, action: str
                   ) -> dict[str, float]:
    """Record a release that is not DP (masks, statistics, scores, a model's accuracy) and
    return the reply's ledger metrics."""
    grant = ledger(policy, run_id).not_dp(
        str(run_id), method, action,
        limit=None if policy.simulation else policy.non_dp_releases_per_run)
    return ledger_metrics(policy, grant, dp=False)
