"""A site's privacy policy: the bounds a site holds against the server, from its own node config.

The privacy boundary is the site (``docs/architecture.md``). Every value a guarantee depends on
(the epsilon a run may spend, the lifetime budget, delta, whether DP may be off, the smallest
SecAgg threshold, the models and corpora a site loads, simulation-only switches) is bounded
here, from the SuperNode's own ``--node-config`` (or a TOML policy file it names), never from
the server's message. The defaults are the private ones.

Node-config keys (the SuperNode operator's, ``flower-supernode --node-config '...'``):

=================================== ========= ===================================================
key                                 default   meaning
=================================== ========= ===================================================
``policy``                          ""        path of a TOML file holding any of the keys below
                                              (node-config keys override it)
``max-epsilon``                     8.0       most epsilon one run may spend at this site
``lifetime-epsilon``                32.0      most epsilon all runs together may spend (ledger)
``max-delta``                       1e-5      largest delta a run may ask for
``lifetime-delta``                  1e-4      largest sum of the deltas of all runs (ledger)
``allow-no-dp``                     false     may a DP-capable method run without DP
``dp-placements``                   distrib.  where this site lets DP noise be added to its
                                              statistics (``distributed``: by the sites under
                                              SecAgg+; ``central``: by the server, which is then
                                              trusted with the un-noised sum), comma-separated
``dp-public-files``                 ""        files this site's operator holds as PUBLIC text
                                              (comma-separated paths): a run may pin one by its
                                              SHA-256
                                              (``dp_public_text = "sha256:..."``) for its DP clip
                                              bounds and scales; the site reads no other file for
                                              them, whatever the server names
``secagg-min-fraction``             0.5       a SecAgg threshold must exceed this fraction of sites
``secagg-max-colluders``            1         sites that may collude with a malicious server: the
                                              threshold must exceed (sites + colluders) / 2, so
                                              that no split view of the survivors can be
                                              confirmed twice (Bonawitz et al. 2017); 0 trusts
                                              every other site
``secagg-min-neighbours``           0         the least degree k of SecAgg+'s masking graph
                                              (each site masks with and shares its secrets
                                              among k neighbours): 0 is 2 * ceil(log2 n) for n
                                              sites (16: 8, 64: 12); k must also be at least
                                              twice secagg-max-colluders. Privacy does not rest
                                              on k (a site checks that no secagg-max-colluders
                                              survivors cut the survivors' graph before it
                                              reveals a share); k sets how many drops a vote
                                              survives
``require-secagg``                  true      refuse to release masks or statistics in the clear
                                              (only their sum, under SecAgg+)
``custext-top-k``                   20        CusText's group size: the candidates each word may
                                              become (a request for another is refused; a
                                              small group releases most words verbatim)
``custext-keep-stopwords``          false     whether stop words are released in the clear
``non-dp-releases-per-run``         256       releases that are not DP (masks, statistics, scores,
                                              accuracies, cosines) one run may have (ledger)
``runs-per-input``                  1         runs that may release masks or statistics (not DP)
                                              computed on the same input (the site's windows and
                                              model): the sums of several runs over one input can
                                              be differenced (ledger)
``secagg-key``                      ""        this site's P-384 private key (PEM) for SecAgg+
``secagg-peers``                    ""        folder of the federation's public keys (``*.pub``)
``models``                          embedded  model specs accepted (comma-separated in node config,
                                              a list or a string in the file): embedded names, local
                                              paths, hub ids; default the embedded names only
``corpora``                         bundled   corpus / task names (or folders) the server may
                                              choose (``calib_text`` only when the site has no
                                              ``data-path``; ``task`` and ``corpus`` always);
                                              default the bundled ones
``state-dir``                       see below the site's persistent folder (its privacy ledger)
``ledger-anchor``                   ""        a second copy of the ledger's head, best on a volume
                                              that whoever restores the state folder cannot
                                              write: a rolled-back state folder is then refused
``research-reproducible-secrets``   false     seeded secret draws (research only: every reply and
                                              report then says the guarantee does not hold)
``site-mode``                       ""        ``"simulation"``: this site is a simulated one (an
                                              in-process harness); ``"deployment"``: never
                                              simulated; ``"development"``: as deployment, but
                                              the SuperNode may run the operations without an
                                              agent
=================================== ========= ===================================================

**How ``simulation`` is derived (never from the server).** True when

* the site runs inside Flower's Simulation Engine: its ClientApp executes in a Ray worker
  process, in an actor of Flower's ``ClientAppActor`` (``flwr.simulation.ray_transport``;
  both ``fedcompress ... --simulation`` through :func:`flwr.simulation.run_simulation` and
  ``flwr run`` on a local-simulation federation use that backend). A deployed site's ClientApp
  runs in a ``flwr-clientapp`` process (or a warm site worker), never in a Ray actor, and a
  server cannot change how a SuperNode runs its ClientApp; or
* the site's own node config says ``site-mode="simulation"`` (tests' in-process harness, which
  plays the SuperNodes itself).

``site-mode="deployment"`` (or ``"development"``) forces False even inside Ray (a site
operator who runs its own ClientApp on Ray). A deployed site's ClientApp relays every message
to the site's agent (:mod:`clients.site_agent`) and refuses to run without one; only
``site-mode="development"`` (a test bench, never a site with private data) lets the SuperNode's
ClientApp process run the operations itself, with the data, keys and ledger in its reach. In
simulation the server runs the sites (a Simulation Engine gives its virtual sites no node
config of their own), so there is nobody to hold a bound against: the
fault and attack switches are honoured, and the bounds the server chooses (max-epsilon,
allow-no-dp, max-delta, models, corpora, a known seed) are not enforced; every reply says so
(its ``site_policy_enforced`` metric is 0; :attr:`SitePolicy.enforcement`). The ledger still
records every release and still fixes a run's DP-SGD mechanism at its first round; without
``state-dir`` it lives in a temporary folder of the simulation, one per run (in the Ray
session's folder; else one per process, removed at exit), with no lifetime budget, so
simulations and tests do not accumulate budget.

**Default ``state-dir``** outside simulation: ``$FEDCOMPRESS_STATE``, else
``$XDG_STATE_HOME/fedcompress`` (``~/.local/state/fedcompress``), in a subfolder
``site-<partition-id>`` (``site`` without one). Two SuperNodes on one host as one user MUST be
given their own ``state-dir`` if they share a partition id (or have none): they would share a
ledger (which is safe, only stricter: they spend one budget).

**Files another user could change.** Outside simulation, the policy file (and its folder), the
``secagg-peers`` folder and its keys, the ``state-dir`` and the ``ledger-anchor``'s folder are
refused when a user other than the site's (or root) owns them or when group or others may write
them (each could then loosen a bound, add a Sybil peer or roll the ledger back), and the
``secagg-key`` when group or others may read it (:func:`check_private_files`). The error names
the path, its owner and mode, and the command that fixes it.

What is not protected here: a site operator can set any bound (the policy is theirs); root, and
the site's own user, can change any of these files.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import math
import os
import shutil
import stat
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = [
    "POLICY_KEYS",
    "SIMULATION_SWITCHES",
    "PolicyError",
    "SitePolicy",
    "check_private_files",
    "default_corpora",
    "default_models",
    "in_simulation_engine",
    "site_policy",
]


class PolicyError(ValueError):
    """A request the site's policy refuses (or a policy that is invalid). The message names the
    value asked, the bound, and the node-config key that sets it."""


#: Settings of the methods that only a simulation may honour (fault injection, Byzantine
#: attack models), with their "off" value. Refused outside simulation unless off.
SIMULATION_SWITCHES: dict[str, Any] = {"fault": "none", "faulty": 0, "fault_seconds": None,
                                       "fault_layer": 0, "attack": "none", "attackers": 0}


def default_models() -> tuple[str, ...]:
    """The embedded model names (no hub id, no path)."""
    from fedcompress.models import EMBEDDED_MODELS

    return tuple(EMBEDDED_MODELS)


def default_corpora() -> tuple[str, ...]:
    """The bundled corpora and tasks (offline, shipped with the package)."""
    from fedcompress.data.corpora import BUNDLED_CORPORA
    from fedcompress.data.tasks import BUNDLED_TASKS, DERIVED_TASKS

    return (*BUNDLED_CORPORA, *BUNDLED_TASKS, *DERIVED_TASKS)


@dataclass(frozen=True)
class SitePolicy:
    """A site's bounds (module docstring: keys, defaults, how ``simulation`` is derived)."""

    max_epsilon: float = 8.0
    lifetime_epsilon: float = 32.0
    max_delta: float = 1e-5
    lifetime_delta: float = 1e-4
    allow_no_dp: bool = False
    dp_placements: tuple[str, ...] = ("distributed",)
    dp_public_files: tuple[str, ...] = ()
    secagg_min_fraction: float = 0.5
    secagg_max_colluders: int = 1
    secagg_min_neighbours: int = 0
    require_secagg: bool = True
    runs_per_input: int = 1
    non_dp_releases_per_run: int = 256
    custext_top_k: int = 20
    custext_keep_stopwords: bool = False
    secagg_key: str = ""
    secagg_peers: str = ""
    models: tuple[str, ...] = field(default_factory=default_models)
    corpora: tuple[str, ...] = field(default_factory=default_corpora)
    state_dir: str = ""
    ledger_anchor: str = ""
    reproducible_secrets: bool = False
    simulation: bool = False
    #: the state folder is a temporary one of a simulation (the ledger then keeps one folder
    #: per run: simulations and tests do not accumulate budget)
    ephemeral_state: bool = False

    def __post_init__(self) -> None:
        for name, key in (("max_epsilon", "max-epsilon"), ("lifetime_epsilon",
                                                           "lifetime-epsilon")):
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                raise PolicyError(f"node config {key}={value!r} is invalid: expected a finite "
                                  "number > 0")
        if self.max_epsilon > self.lifetime_epsilon:
            raise PolicyError(f"node config max-epsilon={self.max_epsilon} exceeds "
                              f"lifetime-epsilon={self.lifetime_epsilon}: expected at most it")
        if not _finite(self.max_delta) or not 0 < self.max_delta < 1:
            raise PolicyError(f"node config max-delta={self.max_delta!r} is invalid: expected "
                              "a number in (0, 1)")
        if not _finite(self.lifetime_delta) or not self.max_delta <= self.lifetime_delta < 1:
            raise PolicyError(f"node config lifetime-delta={self.lifetime_delta!r} is invalid: "
                              f"expected a number in [max-delta={self.max_delta:g}, 1)")
        unknown = [p for p in self.dp_placements if p not in ("central", "distributed")]
        if unknown:
            raise PolicyError(f"node config dp-placements={','.join(self.dp_placements)!r} is "
                              "invalid: expected 'central' and/or 'distributed'")
        if not _finite(self.secagg_min_fraction) or not 0 <= self.secagg_min_fraction < 1:
            raise PolicyError(f"node config secagg-min-fraction={self.secagg_min_fraction!r} "
                              "is invalid: expected a number in [0, 1)")
        if isinstance(self.secagg_max_colluders, bool) \
                or not isinstance(self.secagg_max_colluders, int) or self.secagg_max_colluders < 0:
            raise PolicyError(f"node config secagg-max-colluders={self.secagg_max_colluders!r} "
                              "is invalid: expected an integer >= 0")
        if isinstance(self.secagg_min_neighbours, bool) \
                or not isinstance(self.secagg_min_neighbours, int) \
                or self.secagg_min_neighbours < 0:
            raise PolicyError(f"node config secagg-min-neighbours={self.secagg_min_neighbours!r} "
                              "is invalid: expected an integer >= 0 (0: 2 * ceil(log2 n))")
        if isinstance(self.custext_top_k, bool) or not isinstance(self.custext_top_k, int) \
                or self.custext_top_k < 2:
            raise PolicyError(f"node config custext-top-k={self.custext_top_k!r} is invalid: "
                              "expected an integer >= 2")
        for key, value in (("runs-per-input", self.runs_per_input),
                           ("non-dp-releases-per-run", self.non_dp_releases_per_run)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicyError(f"node config {key}={value!r} is invalid: expected an "
                                  "integer >= 1")

    # -- checks a handler calls -------------------------------------------------------------

    def min_secagg_threshold(self, sites: int) -> int:
        """The smallest SecAgg threshold this site accepts among ``sites`` sites:
        ``floor(secagg_min_fraction * sites) + 1`` and ``floor((sites + k) / 2) + 1`` for
        ``k = secagg_max_colluders``, at least 2. The second bound is what the consistency round
        needs against a malicious server with ``k`` colluding sites: two disjoint groups of
        ``t - k`` honest sites (each completed by the colluders' signatures) can confirm two
        different survivor sets, and so reveal both a victim's seed and its mask key, whenever
        ``sites >= 2 t - k``."""
        if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
            raise PolicyError(f"sites={sites!r} is invalid: expected an int >= 1")
        return max(2, math.floor(self.secagg_min_fraction * sites) + 1,
                   (sites + self.secagg_max_colluders) // 2 + 1)

    def min_secagg_neighbours(self, sites: int) -> int:
        """The least degree of a SecAgg+ masking graph this site accepts among ``sites`` sites:
        ``secagg-min-neighbours`` (0: :func:`~fedcompress.privacy.secagg_graph.default_neighbours`)
        and twice ``secagg-max-colluders`` (so that a neighbourhood's share threshold, k/2 + 1,
        exceeds the colluders)."""
        from fedcompress.privacy.secagg_graph import default_neighbours

        if isinstance(sites, bool) or not isinstance(sites, int) or sites < 2:
            raise PolicyError(f"sites={sites!r} is invalid: expected an int >= 2")
        return max(self.secagg_min_neighbours or default_neighbours(sites),
                   2 * self.secagg_max_colluders)

    def check_epsilon(self, epsilon: float | None, what: str = "epsilon") -> float | None:
        """``epsilon`` if this policy allows it for one run: None or 0 (no DP) only with
        ``allow-no-dp``; else a finite number in ``(0, max-epsilon]``. In simulation (the
        server runs the sites: nobody to protect against) any epsilon >= 0 passes."""
        if self.simulation and (epsilon is None or (_finite(epsilon) and epsilon >= 0)):
            return None if not epsilon else float(epsilon)
        if epsilon is None or (_finite(epsilon) and epsilon == 0):
            if not self.allow_no_dp:
                raise PolicyError(f"{what}={epsilon!r} asks to run without differential "
                                  "privacy; this site's policy refuses it (node config "
                                  "allow-no-dp=false)")
            return None
        if not _finite(epsilon) or epsilon < 0:
            raise PolicyError(f"{what}={epsilon!r} is invalid: expected a finite number > 0")
        if epsilon > self.max_epsilon:
            raise PolicyError(f"{what}={epsilon:g} exceeds this site's bound max-epsilon="
                              f"{self.max_epsilon:g} (node config max-epsilon)")
        return float(epsilon)

    def check_delta(self, delta: float) -> float:
        """``delta`` if in ``(0, max-delta]`` (in simulation: any delta in (0, 1))."""
        if not _finite(delta) or not 0 < delta < 1:
            raise PolicyError(f"delta={delta!r} is invalid: expected a number in (0, 1)")
        if self.simulation:
            return float(delta)
        if delta > self.max_delta:
            raise PolicyError(f"delta={delta:g} exceeds this site's bound max-delta="
                              f"{self.max_delta:g} (node config max-delta)")
        return float(delta)

    def check_dp_placement(self, placement: str) -> str:
        """``placement`` of DP noise if this site allows it (node config ``dp-placements``;
        in simulation: either)."""
        if placement not in ("central", "distributed"):
            raise PolicyError(f"dp placement {placement!r} is invalid: expected 'central' or "
                              "'distributed'")
        if self.simulation or placement in self.dp_placements:
            return placement
        raise PolicyError(f"dp placement {placement!r} is refused by this site's policy: "
                          f"expected one of {', '.join(self.dp_placements) or '(none)'} (node "
                          "config dp-placements; 'central' trusts the server with the "
                          "un-noised sum)")

    def public_file(self, digest: str) -> str:
        """The file of this site's ``dp-public-files`` whose SHA-256 is ``digest`` (a run's
        pinned public text); PolicyError naming each listed file's digest if none is."""
        from fedcompress.privacy.dp_stats import public_text_source

        try:
            return public_text_source(digest, self.dp_public_files)
        except ValueError as err:
            raise PolicyError(f"dp_public_text {digest}: not a file this site holds as public "
                              f"(node config dp-public-files): {err}") from err

    def check_model(self, spec: str) -> str:
        """``spec`` if this site accepts that model (node config ``models``): an embedded name
        or hub id listed as it is, a path whose resolved location is listed (in simulation:
        any)."""
        if self.simulation or _listed(str(spec), self.models):
            return spec
        raise PolicyError(f"model {spec!r} is not accepted by this site's policy: expected one "
                          f"of {', '.join(self.models) or '(none)'} (node config models)")

    def check_corpus(self, name: str) -> str:
        """``name`` (a corpus or task the server chose, the site having no ``data-path``) if
        this site accepts it (node config ``corpora``; in simulation: any)."""
        if self.simulation or _listed(str(name), self.corpora):
            return name
        raise PolicyError(f"corpus {name!r} is not accepted by this site's policy: expected one "
                          f"of {', '.join(self.corpora) or '(none)'} (node config corpora)")

    def check_simulation_switches(self, settings: Mapping[str, Any]) -> None:
        """Refuse a fault or attack switch (:data:`SIMULATION_SWITCHES`, keys in snake or
        kebab case) turned on outside simulation."""
        if self.simulation:
            return
        for key, value in settings.items():
            name = str(key).replace("-", "_")
            if name not in SIMULATION_SWITCHES:
                continue
            off = SIMULATION_SWITCHES[name]
            if off is None or value == off or (isinstance(off, int) and value in (0, "0")):
                continue
            raise PolicyError(f"{key}={value!r} is a simulation-only switch (fault injection or "
                              "attack model); this site is deployed and refuses it (only the "
                              "Simulation Engine or node config site-mode=\"simulation\" "
                              "honours it)")

    def check_clear_release(self, action: str, what: str) -> None:
        """Refuse ``action``, which releases ``what`` of this site in the clear, when this
        site requires SecAgg+ (node config ``require-secagg``; in simulation: allowed)."""
        if self.simulation or not self.require_secagg:
            return
        raise PolicyError(f"{action} asks for {what} in the clear; this site's policy releases "
                          "masks and statistics only under SecAgg+ (node config "
                          "require-secagg=true): run with --secagg, or the site sets "
                          "require-secagg=false")

    def check_sanitizer(self, mechanism: str, top_k: int, keep_stopwords: bool) -> None:
        """Refuse a text release whose exponential mechanism differs from this site's: CusText's
        group size (``custext-top-k``) and its stop words (``custext-keep-stopwords``) are the
        site's, not the server's (in simulation: any)."""
        if self.simulation:
            return
        if mechanism == "custext" and int(top_k) != self.custext_top_k:
            raise PolicyError(f"top_k={top_k} asks for CusText groups of {top_k} words; this "
                              f"site perturbs with groups of {self.custext_top_k} (node config "
                              "custext-top-k; a small group releases most words as they are)")
        if bool(keep_stopwords) and not self.custext_keep_stopwords:
            raise PolicyError("keep_stopwords=true asks this site to release its stop words in "
                              "the clear; its policy refuses it (node config "
                              "custext-keep-stopwords=false)")

    def check_known_seed(self, key: str, seed: Any) -> bool:
        """Whether a seed the server sent for a secret draw (``key``; None or < 0: none) may be
        used: only with ``research-reproducible-secrets`` or in simulation; else refused."""
        if seed is None or (isinstance(seed, int) and seed < 0):
            return False
        if self.reproducible_secrets or self.simulation:
            return True
        raise PolicyError(f"{key}={seed!r} asks this site to draw its secret randomness from a "
                          "seed the server knows; this site's policy refuses it (node config "
                          "research-reproducible-secrets=false)")

    @property
    def enforcement(self) -> str:
        """How this site holds its bounds, as a reply says it."""
        return ("simulation: bounds not enforced (the server runs the sites)" if self.simulation
                else "enforced")

    @property
    def guarantee_note(self) -> str:
        """What a reply or report says about this site's secret draws ("" when they are
        secret)."""
        if self.reproducible_secrets:
            return ("research-reproducible-secrets: this site drew its secret randomness from "
                    "a seed; its privacy guarantee does NOT hold against whoever knows it")
        return ""


def _finite(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _listed(value: str, allowed: Iterable[str]) -> bool:
    allowed = tuple(allowed)
    if value in allowed:
        return True
    path = Path(value).expanduser()
    if not (path.is_absolute() or value.startswith((".", "~")) or path.exists()):
        return False
    resolved = path.resolve()
    return any(resolved == Path(a).expanduser().resolve() for a in allowed
               if os.sep in a or a.startswith((".", "~")))


# -- from the node config ------------------------------------------------------------------

#: node-config key -> SitePolicy field
POLICY_KEYS: dict[str, str] = {
    "max-epsilon": "max_epsilon", "lifetime-epsilon": "lifetime_epsilon",
    "max-delta": "max_delta", "lifetime-delta": "lifetime_delta", "allow-no-dp": "allow_no_dp",
    "dp-placements": "dp_placements",
    "dp-public-files": "dp_public_files",
    "secagg-min-fraction": "secagg_min_fraction",
    "secagg-max-colluders": "secagg_max_colluders", "require-secagg": "require_secagg",
    "secagg-min-neighbours": "secagg_min_neighbours",
    "runs-per-input": "runs_per_input", "custext-top-k": "custext_top_k",
    "non-dp-releases-per-run": "non_dp_releases_per_run",
    "custext-keep-stopwords": "custext_keep_stopwords",
    "secagg-key": "secagg_key",
    "secagg-peers": "secagg_peers", "models": "models", "corpora": "corpora",
    "state-dir": "state_dir", "ledger-anchor": "ledger_anchor",
    "research-reproducible-secrets": "reproducible_secrets",
}
_OTHER_KEYS = ("policy", "site-mode")
#: ``site-mode``'s values ("": derived, see the module docstring)
SITE_MODES = ("", "simulation", "deployment", "development")
#: node-config keys a site uses for other purposes (never mistaken for a policy typo)
_SITE_KEYS = ("partition-id", "num-partitions", "data-path", "site-agent")
_FIELD_TYPES = {f.name: f.type for f in fields(SitePolicy)}


def site_policy(node_config: Mapping[str, Any]) -> SitePolicy:
    """This site's policy from its SuperNode's node config: the TOML file named by ``policy``
    (if any), overridden by the node config's own keys; private defaults for the rest.

    Raises:
        PolicyError: an unreadable or malformed policy file; a key of the file that is not a
            policy key; a node-config key that looks like a misspelt policy key; a value of the
            wrong type or out of range.
    """
    values: dict[str, Any] = {}
    path = node_config.get("policy")
    if path:
        values.update(_read_file(str(path)))
    for key, value in node_config.items():
        key = str(key)
        if key in POLICY_KEYS or key in _OTHER_KEYS:
            if key != "policy":
                values[key] = value
            continue
        if key in _SITE_KEYS:
            continue
        close = difflib.get_close_matches(key, [*POLICY_KEYS, *_OTHER_KEYS], n=1, cutoff=0.85)
        if close:
            raise PolicyError(f"node config key {key!r} is not a policy key: did you mean "
                              f"{close[0]!r}?")
    mode = str(values.pop("site-mode", "") or "")
    if mode not in SITE_MODES:
        raise PolicyError(f"node config site-mode={mode!r} is invalid: expected 'simulation', "
                          "'deployment', 'development' or nothing")
    simulation = mode == "simulation" or (mode == "" and in_simulation_engine())
    kwargs: dict[str, Any] = {POLICY_KEYS[k]: _convert(k, v) for k, v in values.items()}
    ephemeral = False
    if not kwargs.get("state_dir"):
        kwargs["state_dir"] = _default_state_dir(node_config, simulation)
        ephemeral = simulation
    policy = SitePolicy(simulation=simulation, ephemeral_state=ephemeral, **kwargs)
    if not simulation:
        check_private_files(policy, str(path) if path else "")
    return policy


def _owner_fix(path: str, uid: int, folder: bool) -> str:
    return (f"chown {uid} {path} && chmod {'700' if folder else '600'} {path}")


def _check_not_writable(path: str, what: str, key: str, folder: bool) -> None:
    """Refuse ``path`` (a policy file, a folder of keys or state) if a user other than this
    process's or root owns it, or group or others may write it. A missing path passes."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise PolicyError(f"node config {key}={path!r}: cannot check {what} ({err.strerror})"
                          ) from err
    uid, mode = os.geteuid(), stat.S_IMODE(info.st_mode)
    if info.st_uid not in (uid, 0):
        raise PolicyError(f"node config {key}={path!r}: {what} is owned by uid {info.st_uid}, "
                          f"not by this site's user (uid {uid}) or root, who alone may change "
                          f"it: {_owner_fix(path, uid, folder)}")
    if mode & 0o022:
        raise PolicyError(f"node config {key}={path!r}: {what} has mode {mode:04o}, writable "
                          "by group or others, who could change it: chmod go-w "
                          f"{path}")


def check_private_files(policy: SitePolicy, policy_file: str = "") -> None:
    """Refuse files of this site that another user could change (module docstring): the policy
    file and its folder, the peers folder and its keys, the state folder, the anchor's folder;
    and a private key that group or others may read."""
    if policy_file:
        _check_not_writable(policy_file, "the policy file", "policy", False)
        _check_not_writable(os.path.dirname(os.path.abspath(policy_file)),
                            "the policy file's folder", "policy", True)
    if policy.secagg_peers:
        _check_not_writable(policy.secagg_peers, "the folder of the federation's keys",
                            "secagg-peers", True)
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(policy.secagg_peers)):
                if name.endswith(".pub"):
                    _check_not_writable(os.path.join(policy.secagg_peers, name),
                                        "a peer's public key", "secagg-peers", False)
    if policy.state_dir and not policy.ephemeral_state:
        _check_not_writable(policy.state_dir, "the state folder (the ledger)", "state-dir",
                            True)
    if policy.ledger_anchor:
        _check_not_writable(os.path.dirname(os.path.abspath(policy.ledger_anchor)),
                            "the ledger anchor's folder", "ledger-anchor", True)
        _check_not_writable(policy.ledger_anchor, "the ledger anchor", "ledger-anchor", False)
    if policy.secagg_key:
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(policy.secagg_key)
            if stat.S_IMODE(info.st_mode) & 0o077 or info.st_uid not in (os.geteuid(), 0):
                raise PolicyError(
                    f"node config secagg-key={policy.secagg_key!r}: this site's private key "
                    f"has mode {stat.S_IMODE(info.st_mode):04o} and owner uid {info.st_uid}; "
                    f"expected 0600 and this site's user: "
                    f"{_owner_fix(policy.secagg_key, os.geteuid(), False)}")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise PolicyError(f"node config policy={path!r}: cannot read the policy file "
                          f"({err.strerror or err})") from err
    except tomllib.TOMLDecodeError as err:
        raise PolicyError(f"node config policy={path!r} is not valid TOML: {err}") from err
    for key in data:
        if key not in POLICY_KEYS and key != "site-mode":
            close = difflib.get_close_matches(key, list(POLICY_KEYS), n=1)
            raise PolicyError(f"policy file {path}: unknown key {key!r}: expected one of "
                              f"{', '.join(POLICY_KEYS)}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
    return data


def _convert(key: str, value: Any) -> Any:
    kind = _FIELD_TYPES[POLICY_KEYS[key]]
    bad = PolicyError(f"node config {key}={value!r} is invalid: expected {kind}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no", ""):
            return False
        raise bad
    if kind == "float":
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if kind == "int":
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not number.is_integer():
            raise bad
        return int(number)
    if kind == "tuple[str, ...]":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise bad
        return tuple(i.strip() for i in items if i.strip())
    if not isinstance(value, str):
        raise bad
    return value


def in_simulation_engine() -> bool:
    """True when this process is a Ray worker running an actor of Flower's Simulation Engine
    (module docstring). Imports nothing: a process that never imported Ray is not one."""
    ray = sys.modules.get("ray")
    if ray is None or "flwr.simulation.ray_transport.ray_actor" not in sys.modules:
        return False
    try:
        worker = ray._private.worker.global_worker
        if worker.mode != ray._private.worker.WORKER_MODE:
            return False
        return not worker.actor_id.is_nil()
    except Exception:  # noqa: BLE001 - another Ray layout: not recognised, so not simulated
        return False


_SIM_DIRS: dict[str, str] = {}


def _default_state_dir(node_config: Mapping[str, Any], simulation: bool) -> str:
    site = (f"site-{node_config['partition-id']}" if "partition-id" in node_config else "site")
    if simulation:
        return str(Path(_simulation_root()) / site)
    root = os.environ.get("FEDCOMPRESS_STATE") or str(
        Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        / "fedcompress")
    return str(Path(root) / site)


def _simulation_root() -> str:
    """A temporary folder of this simulation: in the Ray session's folder (shared by the
    simulation's actors, gone with the session), else one per process removed at exit."""
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            session = ray._private.worker._global_node.get_session_dir_path()
            return str(Path(session) / "fedcompress-state")
        except Exception:  # noqa: BLE001 - not in a Ray session: a per-process folder
            pass
    if "process" not in _SIM_DIRS:
        path = tempfile.mkdtemp(prefix="fedcompress-sim-state-")
        _SIM_DIRS["process"] = path
        atexit.register(shutil.rmtree, path, True)
    return _SIM_DIRS["process"]
