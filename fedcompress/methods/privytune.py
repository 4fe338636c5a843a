"""PrunePrivyTune, centralized and federated (paper: Garg and Torra, "PrunePrivyTune:
Accelerating Language Models with Pruning and Differentially Private Fine-Tuning", Springer
Nature, 2026; see the References of the architecture page).

The paper's pipeline: remove redundant layers by the pairwise cosine similarity of hidden states
(Sec. 4.1, :mod:`fedcompress.layers.redundancy`), fine-tune the smaller model with DP-SGD, LoRA
("W + LR") or every weight ("Train") (Sec. 4.2, :mod:`fedcompress.privacy.finetune`), evaluate,
then audit it with a training-data extraction attack (Sec. 5.5, :mod:`fedcompress.privacy.
extraction`).

Federated DP-LoRA (new; the paper has one data holder). ``clients`` sites each hold a private
share of the training data (iid or Dirichlet label skew, seeded):

* **Round 0, removal.** From public text on the server (the default: nothing derived from a
  site's data leaves it before DP training), or from the sites' pairwise cosine matrices
  (``similarity_source="sites"``, opt-in: the matrix is released without DP noise;
  each site sends its ``(L+1) x (L+1)`` matrix and example count, the server takes the
  example-weighted mean, which equals the matrix of the pooled texts). The server removes
  ``ratio`` of the layers with the highest redundancy, or runs Alg. 1's greedy removal under
  the accuracy budget ``max_drop`` on the task's validation split (held by the server, like
  a public dev set).
* **Rounds 1..R, DP-LoRA.** Each site trains the global adapter (LoRA factors, plus the
  encoder's classification head) on its own data with DP-SGD for ``local_epochs`` per round; the
  server averages the sites' trainable weights with Flower's own :class:`FedAvg` (weighted by
  example count). A site's noise multiplier is set ONCE for its whole planned run
  (``rounds x`` its local steps, at its sampling rate ``batch_size / n_site``) to reach
  ``(epsilon, dp_delta)`` w.r.t. its own data; after every round it reports the epsilon its
  accountant has spent so far. Record-level DP per site: an example's influence on everything a
  site sends is bounded; the server sees only DP outputs.
* **Evaluation.** The server evaluates the global model on the task's test split after every
  round (Flower's ``evaluate_fn``): accuracy (``objective="classify"``) or perplexity (``"lm"``;
  ``corpus`` may name a hub corpus with a test split, ``wikitext2`` or ``ptb``, online or
  cached; ``c4`` has none). With ``tasks`` (``objective="lm"`` only) it also scores the initial
  model (layers removed, before fine-tuning), the final global model and the central baseline
  on zero-shot tasks.
* **Audit.** With ``attack_samples > 0`` every site runs the extraction attack on the final
  global model with ITS training texts as members and its held-out texts as non-members (it has
  both; nothing leaves the site but the scores). Causal LMs only (an encoder has no MLM head).

Baseline (``baselines="central"``): the same removal and DP fine-tuning in-process on the union
of the sites' data at the same (epsilon, delta), for ``rounds x local_epochs`` epochs: the
paper's centralized pipeline, against which the federated run is compared.

Objectives: ``"classify"``, a labelled task (bundled BIG-bench stand-ins for GLUE, or
``glue:<name>`` online) with an encoder + head or a decoder by label tokens; ``"lm"``, private
text (a corpus's documents, first ``max_length`` tokens each) with the causal LM loss.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from fedcompress.config import FederationBase, ServerSettings, Settings, setting
from fedcompress.data.corpora import load_corpus
from fedcompress.data.partition import dirichlet_partition, iid_partition
from fedcompress.data.tasks import classification_data
from fedcompress.layers.redundancy import CosineMatrix, cosine_matrix, greedy_removal
from fedcompress.layers.removal import RemovalPlan, lowest_score_plan
from fedcompress.layers.settings import REMOVALS, SOURCES, RedundancySettings  # noqa: F401
from fedcompress.methods.base import Method
from fedcompress.methods.evaluation import TaskEvalSettings, accuracy_cells, accuracy_columns
from fedcompress.models import embedded_model_dir, num_layers
from fedcompress.privacy.accounting import epsilon_spent, noise_multiplier
from fedcompress.privacy.classifier import (
    Encoded,
    LabelTokenClassifier,
    classify,
    encode_lm,
    encode_texts,
    encoder_classifier,
    is_encoder,
    pad_id,
)
from fedcompress.privacy.extraction import (
    AttackConfig,
    extraction_attack,
    sequence_log_perplexities,
)
from fedcompress.privacy.finetune import FinetuneConfig, train_prepared
from fedcompress.privacy.ledger import DpSgdMechanism, Ledger
from fedcompress.privacy.policy import SitePolicy
from fedcompress.privacy.settings import DPSGDSettings, ExtractionAttackSettings
from fedcompress.privacy.site import ledger_metrics

__all__ = [
    "METHOD",
    "FederatedDPSettings",
    "PrivyTuneConfig",
    "PrivyTuneFederationSettings",
    "RunSettings",
    "SiteData",
    "build_model",
    "check_data",
    "check_task_eval",
    "evaluate",
    "attack_metrics",
    "load_trainable",
    "parse_removed",
    "removed_text",
    "plan_removal",
    "site_data",
    "site_train",
    "trainable_arrays",
]

logger = logging.getLogger(__name__)

OBJECTIVES = ("classify", "lm")
PARTITIONS = ("iid", "dirichlet")
#: Site-level central DP on the server's average (Flower's DP strategy wrappers): none, clipping
#: of each site's update on the server, or on the site (Flower's ``fixedclipping_mod``).
CENTRAL_DP = ("none", "server", "client")


@dataclass(frozen=True)
class PrivyTuneFederationSettings(FederationBase):
    """The federation of a PrunePrivyTune run: the model, the sites' private data (a labelled
    task or a corpus) and how it is shared among them."""

    label: ClassVar[str] = "federation"

    model: str = setting("minilm-l6", "Model to compress: an encoder (BERT family, gets a "
                         "classification head) or a causal LM (as in `eval`).")
    dtype: str = setting("float32", "Model dtype.", choices=("float32", "bfloat16", "float16"))
    objective: str = setting("classify", "classify (a labelled task) or lm (private text, "
                             "causal LM loss).", choices=OBJECTIVES)
    task: str = setting("epistemic_reasoning", "Classification task: bundled name, glue:<name> "
                        "(online) or JSONL file/dir.")
    labels: str = setting("", "Comma-separated label subset, relabelled in this order (e.g. "
                          "negative,positive); empty: every label.")
    corpus: str = setting("wiki", "Private text of objective lm: a corpus name (train split: "
                          "members; validation split: held-out).")
    train_examples: int = setting(0, "Training examples over all sites (0: the whole split).",
                                  ge=0)
    eval_examples: int = setting(0, "Test examples evaluated by the server (0: all).", ge=0)
    clients: int = setting(4, "Number of sites.", ge=1)
    min_clients: int = setting(0, "Fewest valid sites to go on with (0: all).", ge=0)
    partition: str = setting("iid", "iid or dirichlet (label skew).", choices=PARTITIONS)
    alpha: float = setting(1.0, "Dirichlet concentration.", gt=0.0)
    seed: int = setting(0, "Seed of every random choice.", ge=0)
    max_length: int = setting(128, "Tokens per example.", ge=8)

    def label_subset(self) -> tuple[str, ...] | None:
        names = tuple(x.strip() for x in self.labels.split(",") if x.strip())
        return names or None


@dataclass(frozen=True)
class FederatedDPSettings(Settings):
    """The federated rounds of DP-LoRA: the sites' local epochs, the server's FedAvg(M) of their
    updates, and the optional site-level central DP on that average (Flower's DP strategy
    wrappers)."""

    label: ClassVar[str] = "rounds and central DP"

    rounds: int = setting(3, "Federated rounds.", ge=1)
    local_epochs: float = setting(1.0, "Epochs over a site's data per round.", gt=0.0)
    server_lr: float = setting(1.0, "Server learning rate on the sites' average update "
                               "(Flower's FedAvgM): 1 is FedAvg; the number of sites adds "
                               "their updates, as many sequential passes as a centralized "
                               "epoch makes (post-processing: no privacy cost).", gt=0.0)
    server_momentum: float = setting(0.0, "Server momentum of FedAvgM (0: none).", ge=0.0,
                                     lt=1.0)
    central_dp: str = setting("none", "Site-level central DP on the FedAvg of every round "
                              "(Flower's DP strategy wrappers, on top of each site's DP-SGD): "
                              "none, server (the server clips each site's update) or client "
                              "(each site clips its own, Flower's fixedclipping_mod).",
                              choices=CENTRAL_DP)
    central_noise: float = setting(0.0, "Noise multiplier z of central DP: Gaussian noise of "
                                   "std z * central_clip / sites added to the average (> 0 "
                                   "when central_dp is on).", ge=0.0)
    central_noise_seed: int = setting(-1, "Seed of the central DP noise: -1 (default) draws "
                                      "it from the OS's entropy and never records it, as the "
                                      "guarantee needs; >= 0 makes the noise reproducible by "
                                      "anyone who reads the report (research only: the "
                                      "reported epsilon then does not hold).", ge=-1)
    central_clip: float = setting(1.0, "Clipping norm of a site's update (its trainable "
                                  "weights minus the global ones, L2 over all of them) under "
                                  "central DP.", gt=0.0)

    def validate(self) -> None:
        if self.central_dp != "none":
            if self.central_noise <= 0:
                raise self.invalid("central_noise", f"> 0 with central_dp={self.central_dp!r} "
                                   "(the accountant needs noise)")
            if self.server_lr != 1.0 or self.server_momentum != 0.0:
                raise self.invalid("server_lr", f"1 (and server_momentum 0) with central_dp="
                                   f"{self.central_dp!r}: Flower's central-DP wrapper and its "
                                   "accountant take plain FedAvg only")

    @property
    def central(self) -> bool:
        return self.central_dp != "none"


@dataclass(frozen=True)
class PrivyTuneConfig(PrivyTuneFederationSettings, RedundancySettings, DPSGDSettings,
                      FederatedDPSettings, ExtractionAttackSettings):
    """Settings of one PrunePrivyTune run as the sites see it (flat, so they travel in a Flower
    ``ConfigRecord``), composed of pieces: the federation, the layer removal
    (:class:`~fedcompress.layers.settings.RedundancySettings`), the sites' DP-SGD
    (:class:`~fedcompress.privacy.settings.DPSGDSettings`), the rounds and central DP, and the
    audit (:class:`~fedcompress.privacy.settings.ExtractionAttackSettings`). Defaults: the
    embedded MiniLM-L6 encoder on ``epistemic_reasoning`` (the RTE stand-in), 4 sites, 20% of
    the layers removed by pairwise redundancy, DP-LoRA at epsilon 8 per site, 3 rounds of one
    local epoch."""

    label: ClassVar[str] = "PrunePrivyTune"

    def validate(self) -> None:
        """Across the pieces: central DP counts every site in every round."""
        if self.central_dp != "none" and self.required_clients != self.clients:
            raise self.invalid("min_clients", f"0 or clients={self.clients} with "
                               f"central_dp={self.central_dp!r}: the central accountant "
                               "counts every site in every round")

    def finetune_config(self, epochs: float, seed: int) -> FinetuneConfig:
        return FinetuneConfig(mode=self.mode, epochs=epochs, batch_size=self.batch_size,
                              lr=self.lr if self.mode == "lora" else self.full_lr,
                              lora_r=self.lora_r, lora_alpha=self.lora_alpha,
                              epsilon=self.epsilon if self.private else None,
                              delta=self.dp_delta, max_grad_norm=self.max_grad_norm,
                              accountant=self.accountant, seed=seed,
                              physical_batch_size=self.physical_batch,
                              noise_seed=None if self.dp_noise_seed < 0 else self.dp_noise_seed)


@dataclass(frozen=True)
class RunSettings(ServerSettings):
    """How the PrunePrivyTune ServerApp drives a run (server only)."""

    label: ClassVar[str] = "PrunePrivyTune server"
    baseline_names: ClassVar[tuple[str, ...]] = ("central",)
    baselines: str = setting("central", "Comma-separated: central (the same pipeline on the "
                             "union of the sites' data), or empty.")
    timeout: float = setting(7200.0, "Seconds to wait for the sites' replies of a round.",
                             gt=0.0)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteData:
    """A site's private data (or the union, ``partition=-1``): training and held-out texts."""

    partition: int
    train_texts: list[str]
    train_labels: list[int]
    heldout_texts: list[str]
    label_names: tuple[str, ...]


def _task(config: PrivyTuneConfig, split: str):
    return classification_data(config.task, split, label_subset=config.label_subset())


def _texts_labels(config: PrivyTuneConfig, split: str) -> tuple[list[str], list[int],
                                                                tuple[str, ...]]:
    if config.objective == "lm":
        return [d.text for d in load_corpus(config.corpus, split)], [], ()
    data = _task(config, split)
    return data.texts, data.labels, data.label_names


def site_data(config: PrivyTuneConfig, partition: int) -> SiteData:
    """Site ``partition``'s share (``-1``: the union of all sites) of the training split (cut
    to ``train_examples`` in total) and of the held-out split (``validation``), seeded."""
    if not -1 <= partition < config.clients:
        raise ValueError(f"partition {partition} is outside [0, {config.clients})")
    texts, labels, names = _texts_labels(config, "train")
    held, _, _ = _texts_labels(config, "validation")
    order = np.random.default_rng(config.seed).permutation(len(texts))
    if config.train_examples:
        if config.train_examples > len(texts):
            raise ValueError(f"train_examples={config.train_examples} but the training split "
                             f"has {len(texts)} examples")
        order = order[:config.train_examples]
    if len(order) < config.clients or len(held) < config.clients:
        raise ValueError(f"{config.clients} sites but {len(order)} training and {len(held)} "
                         "held-out examples: expected at least one of each per site")
    if partition == -1:
        train_idx, held_idx = order, np.arange(len(held))
    else:
        if config.partition == "iid" or not labels:
            parts = iid_partition(len(order), config.clients, config.seed)
        else:
            parts = dirichlet_partition(len(order), config.clients, config.alpha, config.seed,
                                        labels=[labels[i] for i in order])
        train_idx = order[parts[partition]]
        held_idx = iid_partition(len(held), config.clients, config.seed + 1)[partition]
    return SiteData(partition, [texts[i] for i in train_idx],
                    [labels[i] for i in train_idx] if labels else [],
                    [held[i] for i in held_idx], names)


def check_data(config: PrivyTuneConfig) -> None:
    """Every split the run reads loads (the sites' train and held-out shares, the server's
    test split): an unknown task, corpus or split (``c4`` has no test split), or a hub corpus
    (``wikitext2``, ``ptb``) that cannot be loaded offline, fails here with the error naming
    it."""
    site_data(config, 0)
    _texts_labels(config, "test")


def check_task_eval(config: PrivyTuneConfig, evals: TaskEvalSettings) -> None:
    """Zero-shot tasks score a causal LM: refused unless ``objective`` is ``lm`` (a
    ``classify`` run fine-tunes a classification head, which the tasks cannot score)."""
    if evals.task_names and config.objective != "lm":
        raise evals.invalid("tasks", f"none with objective={config.objective!r}: zero-shot "
                            "tasks score a causal LM and need objective='lm' (a classify run "
                            "fine-tunes a classification head)")


def encode(config: PrivyTuneConfig, tokenizer: Any, texts: Sequence[str],
           labels: Sequence[int], label_names: Sequence[str], decoder: bool) -> Encoded:
    if config.objective == "lm":
        return encode_lm(tokenizer, texts, config.max_length)
    return encode_texts(tokenizer, texts, labels, config.max_length, decoder, len(label_names))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def build_model(config: PrivyTuneConfig, base: nn.Module, path: str, tokenizer: Any,
                label_names: Sequence[str], removed: Sequence[int] = ()) -> nn.Module:
    """The model to fine-tune: an encoder with a seeded head, a decoder by label tokens, or the
    causal LM itself (objective ``lm``); with the layers of ``removed`` taken out."""
    if config.objective == "lm":
        if is_encoder(base):
            raise ValueError(f"objective lm needs a causal LM; {config.model!r} is an encoder")
        model = copy.deepcopy(base)
    elif is_encoder(base):
        model = encoder_classifier(path, len(label_names), seed=config.seed)
    else:
        model = LabelTokenClassifier(copy.deepcopy(base), tokenizer, label_names)
    if removed:
        from fedcompress.models import remove_layers

        remove_layers(model.lm if isinstance(model, LabelTokenClassifier) else model,
                      list(removed))
    return model.to(torch.float32).eval()


def evaluate(config: PrivyTuneConfig, model: nn.Module, tokenizer: Any, encoded: Encoded
             ) -> dict[str, float]:
    """Accuracy (classify) or perplexity (lm) on ``encoded``: ``metric`` is higher-better
    (accuracy, or -log perplexity)."""
    pad = pad_id(tokenizer)
    if config.objective == "lm":
        log_ppl = sequence_log_perplexities(model, encoded, pad)
        mean = math.fsum(log_ppl) / len(log_ppl)
        return {"perplexity": math.exp(mean), "metric": -mean, "n": len(log_ppl)}
    result = classify(model, encoded, pad)
    return {"accuracy": result["accuracy"], "loss": result["loss"],
            "metric": result["accuracy"], "n": result["n"]}


def eval_split(config: PrivyTuneConfig, tokenizer: Any, label_names: Sequence[str],
               decoder: bool, split: str) -> Encoded:
    """The server's evaluation data: the task's ``split`` (lm: the corpus's), cut to
    ``eval_examples``."""
    texts, labels, _ = _texts_labels(config, split)
    if config.eval_examples:
        texts, labels = texts[:config.eval_examples], labels[:config.eval_examples]
    return encode(config, tokenizer, texts, labels, label_names, decoder)


def similarity_texts(config: PrivyTuneConfig, data: SiteData) -> list[str]:
    return data.train_texts[:config.similarity_texts]


def site_cosines(config: PrivyTuneConfig, base: nn.Module, tokenizer: Any, data: SiteData
                 ) -> CosineMatrix:
    """A site's pairwise cosine matrix of the base model's hidden states on its texts."""
    return cosine_matrix(base, tokenizer, similarity_texts(config, data), config.max_length,
                         progress=False)


def public_cosines(config: PrivyTuneConfig, base: nn.Module, tokenizer: Any) -> CosineMatrix:
    """The cosine matrix on public text (the bundled wiki corpus's validation split)."""
    texts = [d.text for d in load_corpus("wiki", "validation")][:config.similarity_texts]
    return cosine_matrix(base, tokenizer, texts, config.max_length, progress=False)


def plan_removal(config: PrivyTuneConfig, matrix: CosineMatrix, base: nn.Module, path: str,
                 tokenizer: Any, label_names: Sequence[str]) -> tuple[RemovalPlan, dict]:
    """The removal plan: ``ratio`` of the layers (the most redundant), Alg. 1's greedy search
    on the validation split, or nothing. Returns the plan and details for the report.

    Greedy on a classifier measures the metric of the model as it will be fine-tuned: for an
    encoder, whose head is new and random, that is the accuracy of a linear probe fit on half of
    the validation split and scored on the other half (:func:`probe_accuracy`)."""
    n = num_layers(base)
    if config.removal == "none":
        plan = lowest_score_plan(matrix.importance(config.measure), 0.0)
        return plan, {}
    if config.removal == "ratio":
        plan = lowest_score_plan(matrix.importance(config.measure), config.ratio)
        return plan, {}
    decoder = not is_encoder(base)
    val = eval_split(config, tokenizer, label_names, decoder, "validation")

    if config.objective == "classify" and not decoder:
        def metric(candidate: nn.Module) -> float:
            return probe_accuracy(candidate, val, pad_id(tokenizer), config.seed)
    else:
        def metric(candidate: nn.Module) -> float:
            model = (LabelTokenClassifier(candidate, tokenizer, label_names)
                     if config.objective == "classify" else candidate)
            return evaluate(config, model, tokenizer, val)["metric"]

    result = greedy_removal(base, matrix, metric, config.max_drop,
                            tau=None if config.tau <= -1 else config.tau, measure=config.measure,
                            max_remove=n - 1)
    return result.plan, result.to_dict()


def probe_accuracy(encoder: nn.Module, data: Encoded, pad: int, seed: int) -> float:
    """Accuracy of a logistic-regression probe on the encoder's mean-pooled last hidden state:
    fit (L-BFGS, float32, seeded order) on the first half of ``data``, scored on the second."""
    from fedcompress.privacy.classifier import pad_batch

    feats = []
    with torch.inference_mode():
        for start in range(0, len(data), 32):
            ids, att = pad_batch(data.ids[start:start + 32], pad)
            hidden = encoder(input_ids=ids, attention_mask=att).last_hidden_state.float()
            feats.append((hidden * att[..., None]).sum(1) / att.sum(1, keepdim=True))
    x = torch.cat(feats)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    y = torch.tensor(data.labels)
    half = len(y) // 2
    k = int(y.max()) + 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = nn.Linear(x.shape[1], k)
    opt = torch.optim.LBFGS(probe.parameters(), max_iter=100)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(probe(x[:half]), y[:half]) + 1e-3 * (
            probe.weight ** 2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.inference_mode():
        return float((probe(x[half:]).argmax(-1) == y[half:]).float().mean())


# --------------------------------------------------------------------------------------------
# Training: what a site (or the central baseline) does
# --------------------------------------------------------------------------------------------


def trainable_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The trainable weights (LoRA factors, a new head; every weight in full mode), by name."""
    return {name: p.detach().cpu().float().numpy().copy()
            for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Set the trainable weights from ``arrays`` (same names and shapes; checked)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(arrays):
        missing, extra = sorted(set(params) - set(arrays)), sorted(set(arrays) - set(params))
        raise ValueError(f"adapter mismatch: missing {missing[:3]}, unexpected {extra[:3]} "
                         f"({len(arrays)} arrays for {len(params)} trainable weights)")
    with torch.no_grad():
        for name, p in params.items():
            value = torch.as_tensor(np.asarray(arrays[name]))
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name}: array of shape {tuple(value.shape)}, expected "
                                 f"{tuple(p.shape)}")
            p.copy_(value.to(p.dtype))


def initial_model(config: PrivyTuneConfig, base: nn.Module, path: str, tokenizer: Any,
                  label_names: Sequence[str], removed: Sequence[int]) -> nn.Module:
    """The global model before round 1: layers removed, trainable parts added (seeded)."""
    from fedcompress.privacy.finetune import prepare_trainable

    model = build_model(config, base, path, tokenizer, label_names, removed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model, _ = prepare_trainable(model, config.finetune_config(1.0, config.seed))
    return model


def site_steps(config: PrivyTuneConfig, n: int) -> int:
    """A site's DP-SGD steps per round for ``n`` training examples."""
    return config.finetune_config(config.local_epochs, 0).steps_for(n)


def site_train(config: PrivyTuneConfig, model: nn.Module, train: Encoded, pad: int,
               server_round: int, partition: int, policy: SitePolicy | None = None,
               ledger: Ledger | None = None, run: str = "") -> dict[str, Any]:
    """One round at a site: DP-SGD on its data for ``local_epochs``, with the noise multiplier
    of its whole planned run; returns the metrics (epsilon spent after this round included).
    ``model`` holds the global trainable weights on entry and the site's on return.

    A deployed site passes its ``policy`` and ``ledger`` (run id ``run``): then epsilon and
    delta are bounded by the policy (no DP only with ``allow-no-dp``), a seed the server sent
    for the noise is refused unless the site allows reproducible secrets, and the round is
    checked against and recorded in the ledger BEFORE training: the run's first round fixes
    sigma, q, delta and the target; a round beyond the run's budget, or one that changes them,
    is refused (:class:`~fedcompress.privacy.policy.PolicyError`). ``epsilon_spent`` is then the
    ledger's run epsilon (the site's own accountant over all the run's steps), not a value
    derived from the server's round number. The Poisson sampling and the noise come from OS
    entropy unless a seed is allowed (the metrics' ``secrets_reproducible`` then says 1)."""
    n = len(train)
    steps = site_steps(config, n)
    sigma = None
    grant = None
    epsilon: float | None = config.epsilon if config.private else None
    seeded = config.dp_noise_seed >= 0
    if policy is not None:
        epsilon = policy.check_epsilon(epsilon, "epsilon")
        if epsilon is not None:
            policy.check_delta(config.dp_delta)
        seeded = policy.check_known_seed("dp_noise_seed", config.dp_noise_seed)
        config = config.replace(epsilon=epsilon or 0.0,
                                dp_noise_seed=config.dp_noise_seed if seeded else -1)
    q = min(1.0, config.batch_size / n)
    if config.private:
        sigma = noise_multiplier(config.epsilon, config.dp_delta, q, steps * config.rounds,
                                 config.accountant)
        if ledger is not None:
            grant = ledger.dp_sgd(run, "privytune", "train.dplora",
                                  DpSgdMechanism(sigma=sigma, sample_rate=q,
                                                 delta=config.dp_delta,
                                                 accountant=config.accountant,
                                                 target_epsilon=float(config.epsilon)),
                                  steps, detail={"round": server_round})
    elif ledger is not None and policy is not None:
        grant = ledger.not_dp(run, "privytune", "train.dplora",
                              detail={"round": server_round, "note": "trained without DP"})
    seed = config.seed + 1000 * server_round + partition
    result = train_prepared(model, train, config.finetune_config(config.local_epochs, seed),
                             pad, sigma=sigma, progress=False)
    # "site-weight": every site counts once in a FedAvg under central DP (its accountant's
    # sensitivity assumes equal weights); "num-examples" weights it otherwise.
    metrics: dict[str, Any] = {"num-examples": n, "site-weight": 1, "steps": result.steps,
                               "loss_first": result.losses[0], "loss_last": result.losses[-1],
                               "seconds": result.seconds}
    if sigma is not None:  # with a ledger, its run epsilon (not derived from the round number)
        metrics.update({"sigma": sigma, "sample_rate": q, "epsilon_spent": (
            grant.run_epsilon if grant is not None
            else epsilon_spent(sigma, q, steps * server_round, config.dp_delta,
                               config.accountant))})
    if grant is not None and policy is not None:
        metrics.update(ledger_metrics(policy, grant, dp=sigma is not None))
        metrics["secrets_reproducible"] = 1 if seeded else 0
        if sigma is not None and not policy.simulation:
            # the losses are the un-noised model's on the site's examples: not covered by the
            # DP release, so a deployed site does not send them
            del metrics["loss_first"], metrics["loss_last"]
    return metrics


def removed_text(removed: Sequence[int]) -> str:
    """The removal plan as a message value (``"none"`` or ``"3,7"``: Flower rejects empty
    values)."""
    return ",".join(str(int(i)) for i in removed) or "none"


def parse_removed(text: str) -> list[int]:
    """Inverse of :func:`removed_text`; a malformed plan is an error naming it."""
    if text == "none":
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError as err:
        raise ValueError(f"removed={text!r} is invalid: expected 'none' or comma-separated "
                         "layer indices") from err


def attack_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The attack's scalar scores, flat (a site's reply, a report row)."""
    out = {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}
    for side in ("members", "nonmembers"):
        out.update({f"bert_{k}_{side}": float(v)
                    for k, v in result[f"bertscore_{side}"].items()})
    return out


def attack_config(config: PrivyTuneConfig) -> AttackConfig:
    return AttackConfig(samples=config.attack_samples, max_length=config.max_length,
                        seed=config.seed)


def site_attack(config: PrivyTuneConfig, model: nn.Module, tokenizer: Any, data: SiteData
                ) -> dict[str, Any]:
    """The extraction audit at a site: its training texts vs its held-out texts."""
    lm = model.causal_lm() if isinstance(model, LabelTokenClassifier) else model
    longer = attack_config(config).prefix_tokens + 1
    members = [t for t in data.train_texts if len(tokenizer(t)["input_ids"]) > longer]
    nonmembers = [t for t in data.heldout_texts if len(tokenizer(t)["input_ids"]) > longer]
    attack = attack_config(config)
    k = min(config.attack_samples, len(members), len(nonmembers))
    if k == 0:
        raise ValueError(f"no member or held-out text is longer than the attack's "
                         f"{attack.prefix_tokens}-token prefix")
    result = extraction_attack(lm, tokenizer, members[:k], nonmembers[:k],
                               str(embedded_model_dir("minilm-l6")[0]),
                               dataclasses.replace(attack, samples=k))
    return result.to_dict()


def can_attack(config: PrivyTuneConfig, base: nn.Module) -> bool:
    """The audit needs a model that generates text: a causal LM (not an encoder)."""
    return config.attack_samples > 0 and not is_encoder(base)


def central_run(config: PrivyTuneConfig, base: nn.Module, path: str, tokenizer: Any,
                plan: RemovalPlan, union: SiteData | None = None) -> dict[str, Any]:
    """The paper's centralized pipeline on the union of the sites' data, after ``plan``'s
    removal: ``rounds x local_epochs`` epochs of (DP) fine-tuning at the run's
    (epsilon, delta), the test metric, and the audit when the model generates. One row."""
    union = union or site_data(config, -1)
    decoder = not is_encoder(base)
    model = initial_model(config, base, path, tokenizer, union.label_names, plan.removed)
    train = encode(config, tokenizer, union.train_texts, union.train_labels, union.label_names,
                   decoder)
    tuned = train_prepared(model, train, config.finetune_config(
        config.rounds * config.local_epochs, config.seed), pad_id(tokenizer), progress=False)
    test = eval_split(config, tokenizer, union.label_names, decoder, "test")
    metrics = evaluate(config, model, tokenizer, test)
    row: dict[str, Any] = {
        "name": "central", **{k: metrics[k] for k in ("accuracy", "perplexity", "loss")
                              if k in metrics},
        "layers": num_layers(base) - len(plan.removed), "removed": len(plan.removed),
        "epsilon": config.epsilon if config.private else "none",
        "epsilon_spent_max": tuned.budget.spent if tuned.budget else None, "sites": 1,
        "seconds": tuned.seconds, "steps": tuned.steps, "trainable": tuned.trainable}
    if can_attack(config, base):
        result = site_attack(config, model, tokenizer, union)
        scores = attack_metrics(result)
        row.update({k: scores[k] for k in ("membership_gap", "auc", "bert_precision_members",
                                           "bert_recall_members", "bert_f1_members",
                                           "bert_f1_nonmembers", "member_perplexity",
                                           "nonmember_perplexity")})
    row["model"] = model
    return row


def summary(report: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The CLI's table: one row per result (the federated run and the baselines; with
    ``--tasks`` also the initial model) and, with ``--tasks``, the zero-shot accuracies."""
    tasks = accuracy_columns(report["results"])
    columns = ["name", "layers", "metric", "epsilon", "spent_max", "seconds",
               *(f"acc {t}" for t in tasks)]
    rows = []
    for r in report["results"]:
        metric = r.get("accuracy", r.get("perplexity"))
        rows.append([r["name"], str(r.get("layers", "-")),
                     "-" if metric is None else f"{metric:.4f}",
                     str(r.get("epsilon", "-")),
                     "-" if r.get("epsilon_spent_max") is None
                     else f"{r['epsilon_spent_max']:.3f}",
                     "-" if r.get("seconds") is None else f"{r['seconds']:.1f}",
                     *accuracy_cells(r, tasks)])
    return "fedcompress privytune", columns, rows, []


METHOD = Method(
    name="privytune",
    command="privytune",
    help="PrunePrivyTune on Flower's Simulation Engine: layer removal by pairwise cosine "
         "redundancy (sites' matrices averaged), federated DP-SGD LoRA (or full) fine-tuning "
         "with FedAvg, per-site epsilon, an extraction-attack audit; the centralized pipeline "
         "as baseline; a report.",
    settings=(PrivyTuneConfig, TaskEvalSettings, RunSettings),
    actions={"query.cosines": "cosines", "train.dplora": "train",
             "query.attack": "attack"},
    message_keys={"config": "config", "plan": "plan", "arrays": "arrays",
                  "metrics": "metrics", "matrix": "matrix"},
    client_module="clients.privytune",
    server_module="server.privytune",
    summary=summary,
)
