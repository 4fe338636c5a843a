"""Federated personalized layer pruning (seed 004 made federated; the paper has no federated
design): the settings, the steps as plain functions (used in-process by the bench study
kind ``personalize``, :mod:`fedcompress.bench.personalize_study`) and the method's registry
entry (its Flower files: ``clients/personalize.py``, ``strategies/personalize.py``,
``server/personalize.py``).

1. **Classify** (each site, on its private calibration windows): Alg. 1
   (:func:`fedcompress.layers.personalized.classify_units`); the site sends only the class of
   each unit (2 bits per unit).
2. **Count** (server): per unit, how many sites found it personalized / generic / others; the
   *global class* is the most frequent one, ties broken towards keeping weights
   (personalized > others > generic) (:func:`global_classes`). The *global plan* is Eq. 4 on
   the global classes, rescaled to the sparsity ``p``.
3. **Vote** (FedPrLLM): each site's local Wanda masks at the global plan, summed by the server
   (:class:`~fedcompress.methods.fedprllm.federated.MaskAggregator`).
4. **Personalize** (each site): the site's plan is Eq. 4 with ITS personalized units at the
   personalized factor and every other unit at its global class, rescaled to ``p`` (so every
   site's model has the overall sparsity ``p``); a linear layer of a unit the site found
   personalized gets a LOCAL Wanda mask (from the site's own data, at the site's ratio); every
   other linear layer gets the GLOBAL mask: the top vote counts of the shared vote at the
   site's ratio for that layer (the server's comparison group and tie-break). One sequential
   pass of the calibration walker (:func:`site_masks`): local masks are computed on the inputs
   the already-pruned layers below produce. Every site ends with its own model sharing the
   global part.

The baselines of the benchmark: uniform FedPrLLM (one global mask at ``p`` everywhere),
local-only (the site's own Wanda masks at ``p``) and the dense model; every model is scored by
the perplexity of the site's own held-out windows (:func:`windows_perplexity`).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from fedcompress.config import FederationBase, ServerSettings, Settings, setting
from fedcompress.layers.personalized import (
    CLASSES,
    Classification,
    ClassifyConfig,
    mean_lm_loss,
    personalized_plan,
    plan_summary,
)
from fedcompress.layers.settings import PersonalizedPlanSettings, UnitClassSettings
from fedcompress.masks.aggregate import TIE_BREAKS, global_mask
from fedcompress.methods.base import Method
from fedcompress.methods.evaluation import TaskEvalSettings, accuracy_cells, accuracy_columns
from fedcompress.methods.fedprllm.config import PARTITIONS
from fedcompress.models import ModelAdapter, weight_matrix
from fedcompress.pruning.allocation import SparsityPlan
from fedcompress.pruning.local import layer_sizes
from fedcompress.pruning.walker import walk
from fedcompress.solver.select import GROUPS

if TYPE_CHECKING:
    from fedcompress.methods.fedprllm.federated import MaskAggregator

__all__ = [
    "CLASSES",
    "METHOD",
    "PersonalizeConfig",
    "PersonalizeFederationSettings",
    "PersonalizeMaskSettings",
    "RunSettings",
    "SparsityPlan",
    "TIE_ORDER",
    "UnitCounts",
    "check_corpora",
    "global_classes",
    "guard_choice",
    "site_classes_plan",
    "site_plan_summary",
    "masks_by_layer_list",
    "personal_linears",
    "plot_unit_classes",
    "server_models",
    "shared_masks",
    "site_masks",
    "site_view",
    "windows_perplexity",
]

logger = logging.getLogger(__name__)

#: Among equally frequent classes the global class keeps the most weights.
TIE_ORDER = ("personalized", "others", "generic")
#: Weight importances of the masks (seed 004's Table V: weight vs gradient pruning).
IMPORTANCES = ("wanda", "magnitude", "gradient")
#: What each site evaluates next to its personalized model.
BASELINES = ("dense", "fedprllm", "local-only")
#: The site's guard: keep the better of its personalized and the uniform FedPrLLM model by
#: its held-out perplexity, or always keep the personalized one.
GUARDS = ("heldout", "off")


@dataclass(frozen=True)
class PersonalizeFederationSettings(FederationBase):
    """The federation of a personalized-pruning run: the model and the sites' calibration and
    held-out windows."""

    label: ClassVar[str] = "federation"

    model: str = setting("smollm2-135m", "Model spec: embedded name, local directory, .gguf "
                         "file or hub id.")
    dtype: str = setting("float32", "Model dtype.", choices=("float32", "bfloat16", "float16"))
    clients: int = setting(8, "Number of sites.", ge=1)
    min_clients: int = setting(0, "Fewest valid sites to go on with (0: all).", ge=0)
    samples_per_client: int = setting(4, "Calibration windows per site (classification and "
                                      "masks); as many held-out windows of the test split, "
                                      "of the same source mixture, score its models.", ge=1)
    seqlen: int = setting(256, "Tokens per window.", ge=2)
    calib_text: str = setting("wiki", "Corpora of the sites' text ('+' joins several, e.g. "
                              "wiki+shakespeare+code: label skew over sources).")
    partition: str = setting("dirichlet", "iid or dirichlet.", choices=PARTITIONS)
    alpha: float = setting(0.1, "Dirichlet concentration.", gt=0.0)
    seed: int = setting(0, "Seed of every random choice.", ge=0)
    batch_size: int = setting(4, "Windows per forward.", ge=1)


@dataclass(frozen=True)
class PersonalizeMaskSettings(Settings):
    """The masks of personalized pruning: their weight importance, the server's vote, and the
    site's guard against a worse personalized model."""

    label: ClassVar[str] = "masks and vote"

    importance: str = setting("wanda", "Weight importance of every mask (vote and local): "
                              "wanda, magnitude or gradient (first-order Taylor |W * dL/dW|; "
                              "the paper's Table V 'weight' vs 'gradient').",
                              choices=IMPORTANCES)
    guard: str = setting("heldout", "Each site keeps the better of its personalized model and "
                         "uniform FedPrLLM by its held-out perplexity (heldout), or always its "
                         "personalized one (off).", choices=GUARDS)
    group: str = setting("layer", "Server's comparison group for the vote.", choices=GROUPS)
    tie_break: str = setting("magnitude", "Among equal vote counts prune first.",
                             choices=TIE_BREAKS)


@dataclass(frozen=True)
class PersonalizeConfig(PersonalizeFederationSettings, UnitClassSettings,
                        PersonalizedPlanSettings, PersonalizeMaskSettings):
    """One federated personalized-pruning run as the sites see it, composed of pieces: the
    federation, the unit classification
    (:class:`~fedcompress.layers.settings.UnitClassSettings`), the sparsity plan
    (:class:`~fedcompress.layers.settings.PersonalizedPlanSettings`) and the masks. Defaults:
    the embedded SmolLM2, 8 sites with label-skewed text (Dirichlet 0.1 over the given
    corpora), 4 calibration windows of 256 tokens each, 50% sparsity, Alg. 1 with k = 4 units
    per draw."""

    label: ClassVar[str] = "Personalized pruning"

    def validate(self) -> None:
        """No check across the pieces (each piece checks its own fields)."""

    def classify_config(self, partition: int) -> ClassifyConfig:
        return classify_config(self.k, self.max_iter, self.granularity, self.zero, self.seed,
                               partition, self.batch_size, self.adapt_steps, self.adapt_lr,
                               self.class_rule, self.class_quantile)

    def prune_config(self, layer_sparsity: str = ""):
        """The local recipe of a site's masks (its importance, row-wise comparison as Wanda's
        own) at ``layer_sparsity`` (empty: uniform ``sparsity``)."""
        from fedcompress.pruning.local import PruneConfig

        return PruneConfig(self.importance, self.sparsity, "row", layer_sparsity=layer_sparsity)

    @property
    def server(self):
        """The server's vote settings (its comparison group and tie-break; no scaling)."""
        from fedcompress.methods.fedprllm.config import ServerConfig

        return ServerConfig(self.group, False, self.tie_break, self.seed)

    def windows_config(self, split: str):
        """The FedPrLLM settings whose windows are this run's (``split``: train = calibration,
        test = held-out; the same per-site source mixture)."""
        from fedcompress.methods.fedprllm.config import FedPrLLMConfig

        return FedPrLLMConfig(model=self.model, clients=self.clients,
                              samples_per_client=self.samples_per_client, seqlen=self.seqlen,
                              partition=self.partition, alpha=self.alpha, seed=self.seed,
                              calib_text=self.calib_text, calib_split=split)


@dataclass(frozen=True)
class RunSettings(ServerSettings):
    """How the personalized-pruning ServerApp drives a run (server only)."""

    label: ClassVar[str] = "Personalized pruning server"
    baseline_names: ClassVar[tuple[str, ...]] = BASELINES
    baselines: str = setting("dense,fedprllm,local-only", "Comma-separated, evaluated by every "
                             "site on its held-out windows: dense, fedprllm (uniform FedPrLLM at "
                             "p), local-only (the site's own Wanda masks at p).")
    timeout: float = setting(7200.0, "Seconds to wait for the sites' replies of a round.",
                             gt=0.0)


def check_corpora(config: PersonalizeConfig) -> None:
    """Every corpus of ``calib_text`` loads in the splits the sites read (``train``:
    calibration, ``test``: held-out): an unknown name, or a hub corpus (``wikitext2``, ``ptb``)
    that cannot be loaded offline, fails here with the error naming it (``c4`` has no test
    split)."""
    from fedcompress.data.corpora import load_corpus

    for name in [n for n in config.calib_text.split("+") if n] or [""]:
        for split in ("train", "test"):
            load_corpus(name, split)


def site_windows(config: PersonalizeConfig, tokenizer, data_path: str | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every site's calibration and held-out windows (``data_path`` overrides the corpora)."""
    from fedcompress.methods.fedprllm.federated import federation_windows

    calib, sources = federation_windows(tokenizer, config.windows_config("train"), data_path)
    held, held_sources = federation_windows(tokenizer, config.windows_config("test"),
                                            data_path)
    if sources != held_sources:
        raise ValueError("the held-out windows do not follow the calibration windows' source "
                         "mixture")
    return calib, held


@dataclass(frozen=True)
class UnitCounts:
    """How many sites put each unit in each class (``counts[unit][cls]``), and the global
    class."""

    counts: dict[str, dict[str, int]]
    classes: dict[str, str]

    def to_dict(self) -> dict:
        return {"counts": self.counts, "classes": self.classes}


def global_classes(sites: Sequence[Mapping[str, str]]) -> UnitCounts:
    """Count the sites' classes per unit; the most frequent is the unit's global class (ties:
    :data:`TIE_ORDER`). Every site must classify the same units into known classes."""
    if not sites:
        raise ValueError("no site sent its unit classes")
    units = list(sites[0])
    for i, site in enumerate(sites):
        if list(site) != units:
            raise ValueError(f"site {i} classified units {sorted(set(site) ^ set(units))[:3]} "
                             "differently: expected the same units from every site")
        bad = sorted(set(site.values()) - set(CLASSES))
        if bad:
            raise ValueError(f"site {i} sent unknown classes {bad}: expected {CLASSES}")
    counts = {u: {c: Counter(s[u] for s in sites)[c] for c in CLASSES} for u in units}
    def rank(unit: str, cls: str) -> tuple[int, int]:
        return counts[unit][cls], -TIE_ORDER.index(cls)

    classes = {u: max(TIE_ORDER, key=functools.partial(rank, u)) for u in units}
    return UnitCounts(counts, classes)


def site_classes_plan(units: Mapping[str, Sequence[str]], unit_classes: Mapping[str, str],
                      model: nn.Module, sparsity: float,
                      factors: Mapping[str, float] | None = None,
                      bound: float | None = None) -> SparsityPlan:
    """Eq. 4's per-linear plan for ``unit_classes`` (unit -> class), rescaled to ``sparsity``
    over ``model``'s prunable weights; no ratio further than ``bound`` from it (None: no
    bound)."""
    linear_classes = {lin: unit_classes[u] for u, lins in units.items() for lin in lins}
    return personalized_plan(linear_classes, layer_sizes(model), sparsity, factors, bound)


def site_plan_summary(units: Mapping[str, Sequence[str]], unit_classes: Mapping[str, str],
                      model: nn.Module, sparsity: float,
                      factors: Mapping[str, float] | None = None,
                      bound: float | None = None) -> dict:
    """:func:`site_classes_plan`'s ratios described for a report
    (:class:`~fedcompress.layers.personalized.PlanSummary`, with its one-line text)."""
    linear_classes = {lin: unit_classes[u] for u, lins in units.items() for lin in lins}
    summary = plan_summary(linear_classes, layer_sizes(model), sparsity, factors, bound)
    return {**summary.to_dict(), "text": summary.line()}


def guard_choice(scores: Mapping[str, float]) -> tuple[str, str]:
    """The site's guard: the model it keeps (``personalized`` or ``fedprllm``) by its held-out
    perplexities ``scores``, and why. Ties keep the personalized model."""
    mine, uniform = float(scores["personalized"]), float(scores["fedprllm"])
    if mine <= uniform:
        return "personalized", (f"kept personalized: {mine:.2f} <= uniform FedPrLLM "
                                f"{uniform:.2f} on the held-out windows")
    return "fedprllm", (f"kept fedprllm: personalized {mine:.2f} > uniform FedPrLLM "
                        f"{uniform:.2f} on the held-out windows ({mine / uniform:.2f}x)")


def site_view(site: Classification, global_: UnitCounts) -> dict[str, str]:
    """A site's classes for its own plan: its personalized units, the global class elsewhere."""
    return {u: "personalized" if site.classes[u] == "personalized" else global_.classes[u]
            for u in site.units}


def shared_masks(counts: Mapping[str, torch.Tensor], plan: SparsityPlan, personal: set[str],
                 model: nn.Module, group: str = "layer", tie_break: str = "magnitude"
                 ) -> dict[str, torch.Tensor]:
    """The global masks a site receives: for every linear layer outside its ``personal`` set,
    the top ``counts`` (the shared vote, wire keys ``"layers.<layer>.<name>"``) at the site's
    ratio of that layer, in the server's ``group`` with its ``tie_break``."""
    out = {}
    for i, layer in enumerate(ModelAdapter(model).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            if f"{i}.{name}" in personal:
                continue
            key = f"layers.{i}.{name}"
            out[key] = global_mask(counts[key], plan.at(i, name), group, tie_break,
                                   weight_matrix(module).detach().cpu())
    return out


def site_masks(model: nn.Module, windows: torch.Tensor, plan: SparsityPlan,
               shared: Mapping[str, torch.Tensor] | None, local_group: str = "row",
               batch_size: int = 4, importance: str = "wanda") -> list[dict[str, torch.Tensor]]:
    """A site's masks in one sequential walker pass: a linear layer with a ``shared`` (global)
    mask (wire key ``"layers.<layer>.<name>"``) keeps it; every other one gets a local mask of
    the ``importance`` (:data:`IMPORTANCES`) at the plan's ratio (``local_group``), computed on
    the inputs the already-pruned layers below produce (gradient: of the dense model's loss).
    ``shared=None``: every layer local."""
    from fedcompress.pruning.local import PruneConfig, layer_prune_fn, weight_gradients

    if importance not in IMPORTANCES:
        raise ValueError(f"importance={importance!r} is invalid: expected one of {IMPORTANCES}")
    plan.check_layers(len(ModelAdapter(model)))
    shared = shared or {}
    grads = (weight_gradients(model, windows, batch_size) if importance == "gradient"
             else None)
    local = layer_prune_fn(PruneConfig(importance, plan.default, local_group,
                                       layer_sparsity=plan.to_text()), grads)

    def prune(index: int, layer: nn.Module, stats):
        masks, _ = local(index, layer, stats)
        for name in masks:
            key = f"layers.{index}.{name}"
            if key in shared:
                masks[name] = shared[key]
        return masks, None

    return walk(model, windows, prune, batch_size=batch_size).masks


def server_models(model: nn.Module, config: PersonalizeConfig, plan: SparsityPlan,
                  voted: MaskAggregator, uniform: MaskAggregator | None = None,
                  dense: bool = False) -> Iterator[tuple[str, nn.Module]]:
    """The models the server holds, one pruned copy of ``model`` at a time: ``global-plan``
    (the shared vote ``voted`` at the global ``plan`` on every linear layer: the model of a
    site that found no unit personalized), ``fedprllm`` (the uniform vote ``uniform`` at ``p``,
    when given) and, with ``dense``, ``model`` itself. The sites' personalized models are not
    among them: they never leave the sites."""
    from fedcompress.pruning.local import apply_masks

    def pruned(flat: Mapping[str, torch.Tensor]) -> nn.Module:
        return apply_masks(copy.deepcopy(model), masks_by_layer_list(flat, model))

    yield "global-plan", pruned(shared_masks(voted.counts(), plan, set(), model, config.group,
                                             config.tie_break))
    if uniform is not None:
        yield "fedprllm", pruned(uniform.global_masks(config.server, config.sparsity))
    if dense:
        yield "dense", model


def masks_by_layer_list(flat: Mapping[str, torch.Tensor], model: nn.Module
                        ) -> list[dict[str, torch.Tensor]]:
    """Wire-keyed masks -> one dict per decoder layer of ``model`` (the form of
    :func:`~fedcompress.pruning.local.apply_masks`)."""
    from fedcompress.methods.fedprllm.federated import masks_by_layer

    by_layer = masks_by_layer(dict(flat))
    return [by_layer.get(i, {}) for i in range(len(ModelAdapter(model)))]


def personal_linears(site: Classification) -> set[str]:
    """The linear layers (``"<layer>.<name>"``) of the units a site found personalized."""
    return {lin for unit, lins in site.units.items() if site.classes[unit] == "personalized"
            for lin in lins}


def windows_perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """``exp`` of the mean token cross-entropy over ``windows`` (float32)."""
    return math.exp(mean_lm_loss(model, windows, batch_size))


def classify_config(k: int, max_iter: int, granularity: str, zero: str, seed: int,
                    partition: int, batch_size: int, adapt_steps: int = 0,
                    adapt_lr: float = 1e-3, rule: str = "paper",
                    quantile: float = 0.5) -> ClassifyConfig:
    """A site's Alg. 1 settings: its draws seeded by the run seed and its partition."""
    return ClassifyConfig(k=k, max_iter=max_iter, granularity=granularity, zero=zero,
                          seed=seed * 1_000_003 + partition, batch_size=batch_size,
                          adapt_steps=adapt_steps, adapt_lr=adapt_lr, rule=rule,
                          quantile=quantile)


def plot_unit_classes(counts: UnitCounts, path) -> None:
    """A heat map of how many sites put each unit in each class (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    units = list(counts.counts)
    data = np.array([[counts.counts[u][c] for u in units] for c in CLASSES], dtype=float)
    fig, ax = plt.subplots(figsize=(max(6, len(units) * 0.25), 2.6))
    im = ax.imshow(data, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(CLASSES)), CLASSES)
    ax.set_xticks(range(len(units)), units, rotation=90, fontsize=6)
    ax.set_title("Sites per class, per unit")
    fig.colorbar(im, ax=ax, label="sites")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(report: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The CLI's table: each site's held-out perplexity per model and, with ``--tasks``, the
    zero-shot accuracy of the models the server holds (rows ``server <model>``)."""
    results = report.get("results", [])
    rows = [r for r in results if "site" in r]
    held = [r for r in results if "site" not in r]  # the server's models, scored on tasks
    names = [k for k in ("personalized", "fedprllm", "kept", "local-only", "dense")
             if any(k in r for r in rows)]
    tasks = accuracy_columns(held)
    table = [[str(r["site"])] + [f"{r[n]:.2f}" if n in r else "-" for n in names]
             + ["-"] * len(tasks) for r in rows]
    table += [[f"server {r['name']}"] + ["-"] * len(names) + accuracy_cells(r, tasks)
              for r in held]
    notes = []
    if "wins" in report:
        notes.append(f"personalized beats uniform FedPrLLM on {report['wins']} of "
                     f"{len(rows)} sites")
    if "guard" in report:
        kept = report["guard"]["kept_fedprllm"]
        notes.append(f"kept: the model each site's guard kept (the better on its held-out "
                     f"windows; {len(kept)} of {len(rows)} sites kept uniform FedPrLLM)")
    if tasks:
        notes.append("perplexity columns: each site's held-out windows; acc <task>: the "
                     "server's global models (the sites' personalized models are not scored "
                     "on the tasks)")
    return ("fedcompress personalize", ["site", *names, *(f"acc {t}" for t in tasks)], table,
            notes)


METHOD = Method(
    name="personalize",
    command="personalize",
    help="Federated personalized layer pruning on Flower's Simulation Engine: sites classify "
         "the model's units on their private text (seed 004, Alg. 1) and send only the "
         "classes; the server votes FedPrLLM masks at the global plan; each site keeps local "
         "masks on its personalized layers; per-site held-out perplexity against uniform "
         "FedPrLLM and local-only pruning; a report.",
    settings=(PersonalizeConfig, TaskEvalSettings, RunSettings),
    actions={"query.classify": "classify", "train.plan_masks": "plan_masks",
             "query.personalize": "personalize"},
    message_keys={"config": "config", "classes": "classes", "plan": "plan", "masks": "masks",
                  "uniform": "uniform", "shared": "shared", "metrics": "metrics",
                  "state": "personalize"},
    clear_releases={"train.plan_masks": "its masks"},
    client_module="clients.personalize",
    server_module="server.personalize",
    summary=summary,
)
