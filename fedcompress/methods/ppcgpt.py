"""PPC-GPT as library steps: plain torch; no Flower import (paper: "PPC-GPT: Federated
Task-Specific Compression of Large Language Models via Pruning and Chain-of-Thought
Distillation", an anonymous ACL submission; see the References of the architecture page).

The Flower apps (``clients/ppcgpt.py``, ``strategies/ppcgpt.py``, ``server/ppcgpt.py``) call these
functions; each step is usable on its own.

Round 1, client (:func:`client_data`, :func:`perturb_records`): a client holds a partition of a
multiple-choice task's ``train`` split (its private labelled data) and of its evaluation split
(its private test data). It sends only its questions and choices, each word perturbed by the
exponential mechanism (:mod:`fedcompress.privacy.sanitize`, ``eps`` per word); labels never leave
it. When every example of the client shares one choice list (a closed label set such as
Yes/No), the choices are public task metadata and are sent as they are; otherwise they are
perturbed like the question.

Server (:func:`parse_perturbed`, :func:`compress`): the received text is validated (a client
that sends garbage is rejected with a reason); the server's generator LLM_syn writes synthetic
questions, 3-sample-agreed chain-of-thought answers and rationales
(:func:`fedcompress.synth.generate_synthetic`); Block Influence on (question -> label) plus
(question -> rationale) ranks the decoder layers of LLM_o and the ``prune_ratio`` least
influential ones are removed (or the deepest ones: the "Seq" baseline); the smaller model is
trained with LoRA on ``L_label + L_rationale`` (CoT distillation; ``rationales=False``: the label
loss only and BI on labels only).

Round 2, client (:func:`rebuild_model`, :func:`client_retrain`): the server sends the removal plan
(public layer indices) and the LoRA adapter; the client rebuilds the pruned model from the same
base model it loaded, measures its accuracy on its private test data (paper's "S"), retrains the
adapter on its private labelled data with the label loss and measures again ("C").

Baselines (:func:`dense_sft`, :func:`plain_c`), per client on its own data: DenseSFT (LoRA on the
dense model) and Plain-C (BI on the client's own labelled data, removal, LoRA).

Accuracy everywhere is multiple-choice accuracy in the distillation prompt format
(:func:`fedcompress.distill.task_accuracy`).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from fedcompress.config import FederationBase, ServerSettings, setting
from fedcompress.data.partition import dirichlet_partition, iid_partition
from fedcompress.data.tasks import load_task
from fedcompress.distill import (
    LoraSettings,
    PromptFormat,
    TrainConfig,
    add_lora,
    distill,
    normalize_samples,
    retrain_client,
    task_accuracy,
)
from fedcompress.distill.settings import CoTDistillSettings
from fedcompress.layers import (
    LayerImportance,
    RemovalPlan,
    apply_plan,
    block_influence,
    label_rationale_influence,
    lowest_score_plan,
    seq_plan,
)
from fedcompress.layers.settings import PRUNE_POLICIES, BlockInfluenceSettings  # noqa: F401
from fedcompress.methods.base import Method
from fedcompress.methods.evaluation import TaskEvalSettings, accuracy_cells, accuracy_columns
from fedcompress.models import num_layers, remove_layers
from fedcompress.privacy.settings import MECHANISMS, TextDPSettings  # noqa: F401
from fedcompress.synth.settings import SynthSettings

if TYPE_CHECKING:
    from fedcompress.privacy.ledger import Ledger
    from fedcompress.privacy.policy import SitePolicy

__all__ = [
    "METHOD",
    "ClientData",
    "Compressed",
    "InvalidClientText",
    "NotEnoughSyntheticData",
    "PPCGPTConfig",
    "PPCGPTFederationSettings",
    "RunSettings",
    "adapter_arrays",
    "client_data",
    "client_retrain",
    "client_text",
    "compress",
    "dense_accuracy",
    "dense_sft",
    "make_backend",
    "parse_perturbed",
    "perturb_records",
    "plain_c",
    "rebuild_model",
    "removal_plan",
    "sanitizer_for",
    "weighted_accuracy",
]

logger = logging.getLogger(__name__)

PARTITIONS = ("iid", "dirichlet")
# Limits on what a client may send (a larger payload is garbage, not data).
MAX_EXAMPLES_PER_CLIENT = 100_000
MAX_TEXT_CHARS = 4_000
MAX_CHOICES = 16


class InvalidClientText(ValueError):
    """A client's perturbed text is not a list of {question, choices} examples."""


class NotEnoughSyntheticData(RuntimeError):
    """The generator produced fewer accepted synthetic samples than the run needs."""


@dataclass(frozen=True)
class PPCGPTFederationSettings(FederationBase):
    """The federation of a PPC-GPT run: LLM_o, the multiple-choice task and the clients'
    private shares of it (labelled training examples and test examples)."""

    label: ClassVar[str] = "federation"

    model: str = setting("smollm2-135m", "LLM_o, the model to compress (as in `eval`).")
    dtype: str = setting("float32", "Model dtype.", choices=("float32", "bfloat16", "float16"))
    task: str = setting("strategyqa", "Multiple-choice task: bundled name or JSONL file/dir "
                        "with train and eval splits.")
    eval_split: str = setting("test", "Split of the task holding the clients' test data.")
    clients: int = setting(4, "Number of clients.", ge=1)
    min_clients: int = setting(0, "Fewest valid clients to go on with (0: all).", ge=0)
    examples_per_client: int = setting(16, "Private labelled training examples per client "
                                       "(0: the whole partition).", ge=0)
    eval_per_client: int = setting(50, "Private test examples per client (0: the whole "
                                   "partition).", ge=0)
    partition: str = setting("iid", "iid or dirichlet (label skew).", choices=PARTITIONS)
    alpha: float = setting(1.0, "Dirichlet concentration.", gt=0.0)
    seed: int = setting(0, "Seed of every random choice.", ge=0)
    eval_batch_size: int = setting(16, "Evaluation batch size.", ge=1)


@dataclass(frozen=True)
class PPCGPTConfig(PPCGPTFederationSettings, TextDPSettings, SynthSettings,
                   BlockInfluenceSettings, CoTDistillSettings):
    """Settings of one PPC-GPT run as the clients see it (flat, so they travel in a Flower
    ``ConfigRecord``), composed of pieces: the federation, the sites' text perturbation
    (:class:`~fedcompress.privacy.settings.TextDPSettings`), the synthetic data
    (:class:`~fedcompress.synth.settings.SynthSettings`), the layer removal
    (:class:`~fedcompress.layers.settings.BlockInfluenceSettings`) and the distillation
    (:class:`~fedcompress.distill.settings.CoTDistillSettings`); every field's help says what
    it does. Defaults: the embedded SmolLM2-135M as LLM_o (and LLM_syn), StrategyQA, 4 clients
    x 16 private examples, eps 3 per word (CusText groups of 20), 30% of the layers removed by
    Block Influence, LoRA r=8.
    """

    label: ClassVar[str] = "PPC-GPT"

    def validate(self) -> None:
        """No check across the pieces (each piece checks its own fields)."""

    # Derived settings ---------------------------------------------------------------------------
    def train_config(self, side: str) -> TrainConfig:
        """LoRA training of the ``server`` (distillation) or a ``client`` (retraining)."""
        steps = self.server_steps if side == "server" else self.client_steps
        epochs = self.server_epochs if side == "server" else self.client_epochs
        return TrainConfig(lr=self.lr, max_steps=steps or None, epochs=epochs,
                           batch_size=self.batch_size, grad_accum=self.grad_accum,
                           rationale_weight=1.0 if self.rationales else 0.0, seed=self.seed,
                           lora=self.lora(), max_length=self.max_length,
                           overflow="truncate", log_every=5, progress=False)

    def synth_settings(self) -> dict[str, Any]:
        """Keyword arguments of :class:`fedcompress.synth.SynthConfig`."""
        return {"ratio": self.synth_ratio, "answer_samples": self.answer_samples,
                "question_max_new_tokens": self.question_tokens,
                "answer_max_new_tokens": self.answer_tokens,
                "rationale_max_new_tokens": self.rationale_tokens,
                "batch_size": self.synth_batch_size, "seed": self.seed,
                "time_limit": self.synth_time_limit or None}


# ---------------------------------------------------------------------------------------------
# Client data and perturbation (round 1, client side)
# ---------------------------------------------------------------------------------------------


@dataclass
class ClientData:
    """One client's private data: labelled training records and test records."""

    partition: int
    train: list[dict[str, Any]]
    test: list[dict[str, Any]]


def _parts(n_items: int, labels: Sequence[int], config: PPCGPTConfig, salt: int
           ) -> list[np.ndarray]:
    if n_items < config.clients:
        raise ValueError(f"{config.clients} clients but only {n_items} examples to share: "
                         "expected at least one example per client")
    if config.partition == "iid":
        return iid_partition(n_items, config.clients, config.seed + salt)
    return dirichlet_partition(n_items, config.clients, config.alpha, config.seed + salt,
                               labels=list(labels))


def client_data(config: PPCGPTConfig, partition: int) -> ClientData:
    """Client ``partition``'s records: its share of the task's ``train`` split (iid, or
    Dirichlet label skew) cut to ``examples_per_client``, and its iid share of ``eval_split``
    cut to ``eval_per_client``. Every client computes the same seeded split."""
    if not 0 <= partition < config.clients:
        raise ValueError(f"partition {partition} is outside [0, {config.clients})")
    train = load_task(config.task, "train")
    test = load_task(config.task, config.eval_split)
    if config.examples_per_client and config.examples_per_client * config.clients > len(train):
        raise ValueError(f"{config.clients} clients x {config.examples_per_client} examples "
                         f"need {config.clients * config.examples_per_client}, but task "
                         f"{config.task!r} has {len(train)} training examples")
    train_idx = _parts(len(train), [r["label"] for r in train], config, 0)[partition]
    if len(test) < config.clients:
        raise ValueError(f"{config.clients} clients but task {config.task!r} has only "
                         f"{len(test)} {config.eval_split} examples: expected at least one "
                         "per client")
    test_idx = iid_partition(len(test), config.clients, config.seed + 1)[partition]
    if config.examples_per_client:
        train_idx = train_idx[: config.examples_per_client]
    if config.eval_per_client:
        test_idx = test_idx[: config.eval_per_client]
    return ClientData(partition, [dict(train[i]) for i in train_idx],
                      [dict(test[i]) for i in test_idx])


@functools.lru_cache(maxsize=2)
def sanitizer_for(mechanism: str, top_k: int, keep_stopwords: bool) -> Any:
    """The word-level exponential-mechanism sanitizer of these settings over the GloVe
    vocabulary (built once per process: its candidate sets take a moment). Out-of-vocabulary
    words are always replaced by a uniform candidate, never released."""
    from fedcompress.privacy.sanitize import OOVPolicy, Sanitizer, SanitizerConfig

    return Sanitizer.glove(SanitizerConfig(mechanism=mechanism, top_k=top_k,
                                           keep_stopwords=keep_stopwords,
                                           oov=OOVPolicy.RANDOM))


def client_text(config: PPCGPTConfig, data: ClientData, policy: SitePolicy | None = None,
                ledger: Ledger | None = None, run: str = ""
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Round 1 on a client: its training questions (and open choices) perturbed at
    ``config.eps`` per word, ids ``client<partition>-<i>``; and the privacy budget spent
    (:func:`perturb_records`). The draws come from a fresh secret seed unless
    ``config.noise_seed >= 0`` (then mixed with the partition): the run seed is known to the
    server, and whoever knows the draws can narrow down the words that produced the output.

    A deployed site passes its ``policy`` and ``ledger`` (run id ``run``): ``eps`` per word is
    bounded by ``max-epsilon``, a seed from the server is refused unless the site allows
    reproducible secrets, and the release is checked against and recorded in the ledger (its
    epsilon per word; privacy unit: one word) BEFORE anything is perturbed; the budget then
    carries the ledger's values (``ledger_*``)."""
    from fedcompress.privacy.accounting import noise_seed
    from fedcompress.privacy.site import ledger_metrics

    seeded = config.noise_seed >= 0
    grant = None
    if policy is not None and ledger is not None:
        policy.check_epsilon(config.eps, "eps (per word)")
        policy.check_sanitizer(config.mechanism, config.top_k, config.keep_stopwords)
        seeded = policy.check_known_seed("noise_seed", config.noise_seed)
        bound = math.inf if policy.simulation else policy.max_epsilon
        grant = ledger.text(run, "ppcgpt", "query.perturb", float(config.eps), bound,
                            detail={"mechanism": config.mechanism,
                                    "examples": len(data.train)})
    sanitizer = sanitizer_for(config.mechanism, config.top_k, config.keep_stopwords)
    seed = noise_seed(config.noise_seed if seeded else None, data.partition)
    examples, budget = perturb_records(data.train, sanitizer, config.eps, seed=seed,
                                       prefix=f"client{data.partition}")
    if grant is not None and policy is not None:
        budget.update(ledger_metrics(policy, grant, dp=True))
        budget["secrets_reproducible"] = 1 if seeded else 0
    return examples, budget


def privacy_notes(config: PPCGPTConfig, budgets: Sequence[Mapping[str, Any]]) -> str:
    """The report's privacy section for round 1: the guarantee and what the sites released in
    the clear, from their budgets (:func:`perturb_records`; missing counts read as 0)."""
    from fedcompress.privacy.sanitize import OOVPolicy, SanitizerConfig, release_notes

    def total(key: str) -> int:
        return int(sum(float(b.get(key, 0)) for b in budgets))

    sanitizer = SanitizerConfig(mechanism=config.mechanism, top_k=config.top_k,
                                keep_stopwords=config.keep_stopwords, oov=OOVPolicy.RANDOM)
    draws = ("The perturbation draws come from a fresh secret seed at each client (never "
             "recorded or sent)." if config.noise_seed < 0 else
             f"The perturbation draws are reproducible from noise_seed={config.noise_seed} "
             "(research only): eps does NOT hold against anyone who knows it.")
    return draws + "\n\n" + release_notes(
        sanitizer, eps=config.eps, words=total("words"), perturbed=total("perturbed"),
        kept=total("kept"), oov=total("oov"), unit="example (question and choices)",
        eps_document_max=max((float(b.get("eps_per_example_max", 0.0)) for b in budgets),
                             default=0.0))


def perturb_records(records: Sequence[Mapping[str, Any]], sanitizer: Any, eps: float, seed: int,
                    prefix: str = "example") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Perturb each record's question (and choices, unless all records share one choice list)
    with ``sanitizer`` at ``eps`` per word. Labels and ids are not sent: the examples get ids
    ``<prefix>-<i>``. Returns the examples and the privacy budget spent: ``eps`` per word,
    the total per example (sum over its texts, by sequential composition) as max and mean,
    and word counts (``clear``: words released as written, see
    :class:`fedcompress.privacy.sanitize.SanitizeReport`)."""
    if not records:
        raise ValueError("no records to perturb")
    closed = len({tuple(r["choices"]) for r in records}) == 1
    texts: list[str] = []
    for r in records:
        texts.append(str(r["question"]))
        if not closed:
            texts.extend(str(c) for c in r["choices"])
    outs = sanitizer.sanitize_many(texts, eps=eps, seed=seed)
    examples, per_example, it = [], [], iter(outs)
    totals = {"words": 0, "perturbed": 0, "kept": 0, "oov": 0, "clear": 0, "changed": 0}
    for i, r in enumerate(records):
        parts = [next(it)] + ([] if closed else [next(it) for _ in r["choices"]])
        choices = list(r["choices"]) if closed else [p.text.strip() for p in parts[1:]]
        examples.append({"id": f"{prefix}-{i}", "question": parts[0].text, "choices": choices})
        per_example.append(sum(p.report.eps_total for p in parts))
        for p in parts:
            rep = p.report
            totals["words"] += rep.n_words
            totals["perturbed"] += rep.n_perturbed
            totals["kept"] += rep.n_kept
            totals["oov"] += rep.n_oov
            totals["clear"] += rep.n_clear
            totals["changed"] += rep.n_changed
    budget = {"eps_per_word": float(eps), "eps_per_example_max": float(max(per_example)),
              "eps_per_example_mean": float(np.mean(per_example)), "choices_perturbed": not closed,
              **totals}
    return examples, budget


# ---------------------------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------------------------


def parse_perturbed(payload: str, max_examples: int = MAX_EXAMPLES_PER_CLIENT
                    ) -> list[dict[str, Any]]:
    """A client's round-1 payload (a JSON list of ``{id, question, choices}``) -> examples.

    Raises:
        InvalidClientText: not JSON, not a list, too many examples, an example without a
            question, with fewer than 2 or more than ``MAX_CHOICES`` choices, a text longer
            than ``MAX_TEXT_CHARS``, a label field (labels must stay on the client), or a
            repeated id. The message names the example and the field.
    """
    try:
        data = json.loads(payload)
    except (TypeError, ValueError) as err:
        raise InvalidClientText(f"payload is not JSON: {err}") from None
    if not isinstance(data, list) or not data:
        raise InvalidClientText(f"payload is a {type(data).__name__}"
                                + (" (empty)" if data == [] else "")
                                + ": expected a non-empty list of examples")
    if len(data) > max_examples:
        raise InvalidClientText(f"{len(data)} examples: at most {max_examples} accepted")
    seen, out = set(), []
    for i, ex in enumerate(data):
        where = f"example {i}"
        if not isinstance(ex, dict):
            raise InvalidClientText(f"{where} is a {type(ex).__name__}: expected an object")
        if "label" in ex:
            raise InvalidClientText(f"{where} carries a label: clients send questions and "
                                    "choices only")
        eid, question, choices = ex.get("id"), ex.get("question"), ex.get("choices")
        if not isinstance(eid, str) or not eid or eid in seen:
            raise InvalidClientText(f"{where}: id {eid!r} is missing, not a string or repeated")
        seen.add(eid)
        if not isinstance(question, str) or not question.strip():
            raise InvalidClientText(f"{where} ({eid}): question {question!r} is empty or not "
                                    "a string")
        if (not isinstance(choices, list) or not 2 <= len(choices) <= MAX_CHOICES
                or not all(isinstance(c, str) and c.strip() for c in choices)):
            raise InvalidClientText(f"{where} ({eid}): choices {choices!r}: expected 2 to "
                                    f"{MAX_CHOICES} non-empty strings")
        longest = max([len(question)] + [len(c) for c in choices])
        if longest > MAX_TEXT_CHARS:
            raise InvalidClientText(f"{where} ({eid}): a text of {longest} characters: at most "
                                    f"{MAX_TEXT_CHARS}")
        out.append({"id": eid, "question": question, "choices": list(choices)})
    return out


@dataclass
class Compressed:
    """The server's compressed model: a ``PeftModel`` over the pruned LLM_o, and how it was
    made."""

    model: nn.Module
    plan: RemovalPlan
    importance: LayerImportance | None
    train_metrics: dict[str, Any] | None
    seconds: dict[str, float]


def _pairs(samples: Sequence[Any], fmt: PromptFormat, task: str) -> list[tuple[str, str]]:
    return [(fmt.prompt(task, s.question, s.choices), fmt.target(task, s)) for s in samples]


def removal_plan(model: nn.Module, tokenizer: Any, samples: Sequence[Any], ratio: float,
                 policy: str, rationales: bool, max_length: int, fmt: PromptFormat | None = None
                 ) -> tuple[RemovalPlan, LayerImportance | None]:
    """The layers to remove: ``bi`` ranks layers by Block Influence on (question -> label)
    plus, with ``rationales``, (question -> rationale) (paper Eq. 7), and removes the lowest;
    ``seq`` removes the deepest ones (paper Table 6's baseline)."""
    fmt = fmt or PromptFormat()
    if policy == "seq":
        return seq_plan(num_layers(model), ratio), None
    clean = normalize_samples(samples, require_rationale=rationales)
    kwargs = {"max_length": max_length, "batch_size": 8, "progress": False}
    if rationales:
        importance = label_rationale_influence(model, tokenizer, _pairs(clean, fmt, "label"),
                                               _pairs(clean, fmt, "rationale"), **kwargs)
    else:
        importance = block_influence(model, tokenizer, _pairs(clean, fmt, "label"), **kwargs)
    return lowest_score_plan(importance, ratio), importance


def compress(model: nn.Module, tokenizer: Any, samples: Sequence[Any], config: PPCGPTConfig,
             fmt: PromptFormat | None = None) -> Compressed:
    """Server side: remove layers of a copy of ``model`` by the removal plan of ``samples``
    (synthetic, with rationales unless ``config.rationales`` is off), then CoT-distil it with
    LoRA (``config.server_retrain``) or attach an untrained adapter. ``model`` is not changed."""
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    plan, importance = removal_plan(model, tokenizer, samples, config.prune_ratio,
                                    config.prune_policy, config.rationales, config.max_length,
                                    fmt)
    pruned = apply_plan(copy.deepcopy(model), plan)
    seconds["layer_removal"] = time.perf_counter() - start
    logger.info("removed %d of %d layers: %s", len(plan.removed), plan.num_layers,
                list(plan.removed))
    metrics = None
    start = time.perf_counter()
    if config.server_retrain:
        result = distill(pruned, tokenizer, samples, config.train_config("server"), fmt=fmt)
        peft_model, metrics = result.model, result.metrics.to_dict()
    else:
        peft_model = add_lora(pruned, config.lora())
    seconds["distillation"] = time.perf_counter() - start
    return Compressed(peft_model, plan, importance, metrics, seconds)


def adapter_arrays(peft_model: nn.Module) -> dict[str, np.ndarray]:
    """The LoRA tensors of ``peft_model`` as float32 numpy arrays (what round 2 sends)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to(torch.float32).cpu().numpy()
            for k, v in get_peft_model_state_dict(peft_model).items()}


# ---------------------------------------------------------------------------------------------
# Round 2, client side, and the per-client baselines
# ---------------------------------------------------------------------------------------------


def rebuild_model(base: nn.Module, removed: Sequence[int], adapter: Mapping[str, np.ndarray],
                  lora: LoraSettings) -> nn.Module:
    """The server's compressed model from the client's copy of the base model: remove the
    ``removed`` layers from a copy, attach a LoRA adapter with the same settings and load the
    received tensors into it. ``base`` is not changed.

    Raises:
        ValueError: a removed index outside the model, or adapter tensors whose names or
            shapes differ from the adapter these settings make (names the first mismatch).
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    n = num_layers(base)
    bad = [i for i in removed if not 0 <= int(i) < n]
    if bad or len(set(removed)) != len(removed):
        raise ValueError(f"removed layers {list(removed)}: expected distinct indices in "
                         f"[0, {n})")
    model = copy.deepcopy(base)
    if removed:
        remove_layers(model, sorted(int(i) for i in removed))
    peft_model = add_lora(model, lora)
    expected = get_peft_model_state_dict(peft_model)
    if set(expected) != set(adapter):
        missing, extra = sorted(set(expected) - set(adapter)), sorted(set(adapter) - set(expected))
        raise ValueError(f"adapter tensors do not match the pruned model: missing "
                         f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
                         f"{extra[:3]}{'...' if len(extra) > 3 else ''}")
    state = {}
    for key, value in adapter.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"adapter tensor {key}: shape {tuple(value.shape)}, expected "
                             f"{tuple(expected[key].shape)}")
        if not np.all(np.isfinite(value)):
            raise ValueError(f"adapter tensor {key} holds non-finite values")
        state[key] = torch.as_tensor(np.asarray(value)).to(expected[key].dtype)
    set_peft_model_state_dict(peft_model, state)
    return peft_model


def _accuracy(model: nn.Module, tokenizer: Any, records: Sequence[Mapping[str, Any]],
              config: PPCGPTConfig, fmt: PromptFormat | None) -> dict[str, float]:
    res = task_accuracy(model, tokenizer, records, fmt, batch_size=config.eval_batch_size)
    return {"acc": float(res.acc), "acc_stderr": float(res.acc_stderr),
            "acc_norm": float(res.acc_norm), "n": int(res.n)}


def client_retrain(model: nn.Module, tokenizer: Any, data: ClientData, config: PPCGPTConfig,
                   fmt: PromptFormat | None = None) -> dict[str, Any]:
    """Round 2 on a client: accuracy of the server's model on the private test data
    (``server``, paper "S"), LoRA retraining on the private labelled data with the label loss,
    accuracy again (``client``, paper "C")."""
    start = time.perf_counter()
    before = _accuracy(model, tokenizer, data.test, config, fmt)
    result = retrain_client(model, tokenizer, data.train, config.train_config("client"), fmt=fmt)
    after = _accuracy(result.model, tokenizer, data.test, config, fmt)
    return {"server": before, "client": after, "train_loss_first": result.metrics.loss[0],
            "train_loss_last": result.metrics.loss[-1], "steps": result.metrics.steps,
            "seconds": time.perf_counter() - start}


def dense_accuracy(base: nn.Module, tokenizer: Any, data: ClientData, config: PPCGPTConfig,
                   fmt: PromptFormat | None = None) -> dict[str, Any]:
    """The untrained dense model on the client's test data."""
    return {"client": _accuracy(base, tokenizer, data.test, config, fmt)}


def dense_sft(base: nn.Module, tokenizer: Any, data: ClientData, config: PPCGPTConfig,
              fmt: PromptFormat | None = None) -> dict[str, Any]:
    """DenseSFT baseline: LoRA on a copy of the dense model with the client's labelled data."""
    start = time.perf_counter()
    model = add_lora(copy.deepcopy(base), config.lora())
    result = retrain_client(model, tokenizer, data.train, config.train_config("client"), fmt=fmt)
    return {"client": _accuracy(result.model, tokenizer, data.test, config, fmt),
            "seconds": time.perf_counter() - start}


def plain_c(base: nn.Module, tokenizer: Any, data: ClientData, config: PPCGPTConfig,
            fmt: PromptFormat | None = None) -> dict[str, Any]:
    """Plain-C baseline: the client prunes the dense model with its own labelled data (BI on
    question -> label, or Seq), then LoRA-trains the pruned model on the same data."""
    start = time.perf_counter()
    plan, _ = removal_plan(base, tokenizer, data.train, config.prune_ratio, config.prune_policy,
                           False, config.max_length, fmt)
    model = add_lora(apply_plan(copy.deepcopy(base), plan), config.lora())
    result = retrain_client(model, tokenizer, data.train, config.train_config("client"), fmt=fmt)
    return {"client": _accuracy(result.model, tokenizer, data.test, config, fmt),
            "removed": list(plan.removed), "seconds": time.perf_counter() - start}


def weighted_accuracy(per_client: Sequence[Mapping[str, Any]], key: str) -> float:
    """Accuracy over all clients' test examples (each client weighted by its ``n``)."""
    n = sum(c[key]["n"] for c in per_client)
    if n == 0:
        raise ValueError("no evaluated examples")
    return sum(c[key]["acc"] * c[key]["n"] for c in per_client) / n


def make_backend(config: PPCGPTConfig, model: nn.Module | None = None, tokenizer: Any = None,
                 device: str | torch.device | None = None) -> Any:
    """LLM_syn: an OpenAI-compatible server at ``synth_url`` (serving ``synth_model``), else a
    local model: the given LLM_o ``model`` when ``synth_model`` is empty or names it, or
    ``synth_model`` loaded by spec."""
    from fedcompress.synth.backends import HFBackend, OpenAIBackend

    if config.synth_url:
        return OpenAIBackend(config.synth_url, config.synth_model or config.model,
                             api=config.synth_api, timeout=config.synth_timeout,
                             max_workers=config.synth_workers)
    if model is not None and config.synth_model in ("", config.model):
        return HFBackend(model, tokenizer, batch_size=config.synth_batch_size, name=config.model)
    return HFBackend.load(config.synth_model or config.model, device=device, dtype=config.dtype,
                          batch_size=config.synth_batch_size)


# ---------------------------------------------------------------------------------------------
# The method: server settings and registry entry
# ---------------------------------------------------------------------------------------------

BASELINES = ("dense", "dense-sft", "plain-c")


@dataclass(frozen=True)
class RunSettings(ServerSettings):
    """How the PPC-GPT ServerApp drives a run (server only)."""

    label: ClassVar[str] = "PPC-GPT server"
    baseline_names: ClassVar[tuple[str, ...]] = BASELINES

    baselines: str = setting("dense,dense-sft,plain-c", "Comma-separated: dense, dense-sft, "
                             "plain-c (or none).")
    timeout: float = setting(7200.0, "Seconds to wait for the clients' replies of a round.",
                             gt=0.0)


def summary(report: dict) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The CLI's table of a ``ppcgpt`` report: accuracy before (S) and after (C) retraining
    and, with ``--tasks``, the zero-shot accuracy of LLM_o (``dense``) and of the server's
    model before the clients retrain it (``ppcgpt``)."""
    tasks = accuracy_columns(report["results"])
    rows = [[r["name"], str(r.get("layers", "-")),
             "-" if "acc_server" not in r else f"{r['acc_server']:.3f}",
             "-" if "acc_client" not in r else f"{r['acc_client']:.3f}",
             str(r.get("n_client", "-")), *accuracy_cells(r, tasks)]
            for r in report["results"]]
    synth = report.get("synthetic", {})
    notes = [f"synthetic samples: {synth.get('accepted')}/{synth.get('attempts')} accepted "
             f"({synth.get('backend')}); eps per word {report['config']['eps']}, at most "
             f"{report.get('privacy', {}).get('eps_per_example_max')} per example"] if synth else []
    if tasks:
        notes.append("acc <task>: zero-shot accuracy of the server's models (ppcgpt: after "
                     "distillation, before the clients retrain; dense: LLM_o)")
    return ("fedcompress ppcgpt (accuracy on the clients' private test data)",
            ["name", "layers", "acc server (S)", "acc client (C)", "n",
             *(f"acc {t}" for t in tasks)], rows, notes)


METHOD = Method(
    name="ppcgpt",
    command="ppcgpt",
    help="PPC-GPT on Flower's Simulation Engine: DP-perturbed client text, synthetic CoT data, "
         "Block Influence layer removal, distillation, client retraining; baselines and a "
         "report.",
    settings=(PPCGPTConfig, TaskEvalSettings, RunSettings),
    actions={"query.perturb": "perturb", "train.retrain": "retrain"},
    message_keys={"config": "config", "text": "text", "examples": "examples",
                  "metrics": "metrics", "plan": "plan", "adapter": "adapter"},
    client_module="clients.ppcgpt",
    server_module="server.ppcgpt",
    summary=summary,
)
