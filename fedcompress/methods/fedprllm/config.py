"""FedPrLLM's settings: what the clients receive, how the server evaluates, how a run is driven.

These classes hold every default of the method: the ``fedcompress prune`` options, the
ServerApp's settings and the ``[tool.flwr.app.config.fedprllm]`` table are derived from them
(``tests/test_methods.py`` checks the table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from fedcompress.config import FederationBase, ServerSettings, Settings, setting
from fedcompress.masks.aggregate import TIE_BREAKS
from fedcompress.masks.robust import DEFAULT_Z, check_defence
from fedcompress.masks.settings import MODES, WIRES, VoteSettings  # noqa: F401 (public names)
from fedcompress.methods.evaluation import TaskEvalSettings
from fedcompress.privacy.settings import DPStatsSettings, SecAggSettings
from fedcompress.pruning.local import NO_PRUNING, STATS_METHODS
from fedcompress.pruning.scores import SPARSEGPT_BLOCKSIZE, SPARSEGPT_PERCDAMP
from fedcompress.pruning.settings import PruningSettings
from fedcompress.quant.settings import (  # noqa: F401 (this module's public names)
    QUANT_SCHEMES,
    SAVED_ACTORDERS,
    QuantSettings,
)
from fedcompress.recipe.plan import DEFAULT_PIPELINE, PIPELINES
from fedcompress.solver.select import check_group

#: What sites send: their masks (the vote of FedPrLLM) or their inputs' statistics (exact).
AGGREGATES = ("votes", "stats", "fedspallm")
PARTITIONS = ("iid", "dirichlet")
#: FedPrLLM's partitions: also one text per site (``sources``).
SITE_PARTITIONS = (*PARTITIONS, "sources")
DTYPES = ("float32", "bfloat16", "float16")
#: rtn: with --quant, the same recipe with round-to-nearest in place of GPTQ (no data)
BASELINES = ("dense", "centralized", "local-only", "rtn")
VARIANTS = ("configured", "all")
#: Byzantine site models of the simulation (:mod:`fedcompress.methods.fedprllm.attacks`).
ATTACKS = ("none", "random", "inverted", "keep", "collude", "sparsity")
#: Faults a simulation can inject at sites (``clients/fedprllm.py``).
FAULTS = ("none", "error", "corrupt", "slow", "kill")


@dataclass(frozen=True)
class ServerConfig:
    """A server variant: how the server turns vote counts into the global mask."""

    group: str = "layer"
    scale: bool = False
    tie_break: str = "magnitude"
    seed: int = 0
    defence: str = "none"
    trim: int = 0
    reject_z: float = DEFAULT_Z

    def __post_init__(self):
        check_group(self.group)
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"unknown tie-break {self.tie_break!r}: expected one of "
                             f"{', '.join(TIE_BREAKS)}")
        check_defence(self.defence)
        trims = self.defence in ("trim", "both")
        if isinstance(self.trim, bool) or not isinstance(self.trim, int) or self.trim < 0 \
                or (trims and self.trim == 0):
            raise ValueError(f"trim={self.trim!r} is invalid: expected an int >= 1 with "
                             f"defence {self.defence!r}" if trims else
                             f"trim={self.trim!r} is invalid: expected an int >= 0")
        if not (isinstance(self.reject_z, (int, float)) and 0 < self.reject_z < float("inf")):
            raise ValueError(f"reject_z={self.reject_z!r} is invalid: expected a number > 0")

    def replace_defence(self, defence: str) -> ServerConfig:
        return replace(self, defence=defence)

    @property
    def trims(self) -> int:
        """Votes trimmed per side of every weight (0 unless the defence trims)."""
        return self.trim if self.defence in ("trim", "both") else 0

    @property
    def rejects(self) -> bool:
        return self.defence in ("hamming", "both")

    @property
    def label(self) -> str:
        robust = {"none": "", "trim": f"+trim{self.trim}", "hamming": "+hamming",
                  "both": f"+hamming+trim{self.trim}"}[self.defence]
        return f"{self.group}{'+scale' if self.scale else ''}{robust}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FederationSettings(FederationBase):
    """The federation: the model, the sites and their calibration windows."""

    label: ClassVar[str] = "federation"

    model: str = setting("smollm2-135m", "Model spec: embedded name, local directory, .gguf "
                         "file or hub id.")
    dtype: str = setting("float32", "Model dtype.", choices=DTYPES)
    clients: int = setting(16, "Number of clients.", ge=1)
    samples_per_client: int = setting(4, "Calibration windows per client.", ge=1)
    seqlen: int = setting(256, "Tokens per calibration window.", ge=2)
    partition: str = setting("iid", "iid or dirichlet (of one corpus, or label skew over "
                             "'+'-joined corpora), or sources (one text per site: --calib-text "
                             "joins --clients texts with '+').", choices=SITE_PARTITIONS)
    alpha: float = setting(1.0, "Dirichlet concentration.", gt=0.0)
    seed: int = setting(0, "Seed of every random choice.", ge=0)
    calib_text: str = setting("wiki", "Calibration corpus: bundled name, hub name or "
                              ".txt/.jsonl file ('+' joins several).")
    calib_split: str = setting("train", "Split of the calibration corpus.")
    batch_size: int = setting(4, "Windows per forward.", ge=1)
    onload: bool = setting(False, "Sequential onloading: the pruning passes (sites, the "
                           "centralized baseline) read one decoder layer at a time from the "
                           "model's safetensors files, so memory holds one layer, the "
                           "activations and the embeddings (mapped) instead of the whole "
                           "model; the same masks. Needs a local safetensors model (embedded, "
                           ".gguf, a folder, or a hub id in the local cache); not with the "
                           "gradient method.")
    min_clients: int = setting(0, "Fewest valid clients to go on with (0: all).", ge=0)


@dataclass(frozen=True)
class AggregationSettings(Settings):
    """What the sites send and how the server aggregates it: FedPrLLM's votes (their masks;
    :class:`~fedcompress.masks.settings.VoteSettings`), statistics (exact) or FedSpaLLM."""

    label: ClassVar[str] = "aggregation"

    aggregate: str = setting(
        "votes", "What sites send: votes (their local masks; the server votes: FedPrLLM) or "
        "stats (per decoder layer, the sums of their inputs' statistics for wanda or "
        "sparsegpt; the server prunes exactly as centralized pruning on the union of the "
        "sites' windows, one round per layer; --mode, --group and --scale apply to votes) or "
        "fedspallm (FedSpaLLM, the peer system: each site runs sparsegpt on the decoder layers "
        "the server assigns it and sends their masks and kept weights; the server averages each "
        "weight over the sites that kept it and expands the mask to the exact sparsity within "
        "--group; one round).",
        choices=AGGREGATES)
    fedspallm_layers: int = setting(0, "FedSpaLLM: decoder layers each site prunes (what its "
                                    "resources allow; 0: every layer). The server deals every "
                                    "layer to some site, then fills each site's budget at "
                                    "random (seeded by --seed).", ge=0)

    def validate(self) -> None:
        if self.fedspallm_layers and self.aggregate != "fedspallm":
            raise self.invalid("fedspallm_layers", "0 unless aggregate is fedspallm")


@dataclass(frozen=True)
class SimulationSettings(Settings):
    """Simulation only: Byzantine sites and injected faults (a deployed site refuses them)."""

    label: ClassVar[str] = "simulation"

    attack: str = setting("none", "Simulation: Byzantine sites' mask (random, inverted: prune "
                          "the highest scores, keep: prune nothing, collude: one inverted "
                          "mask from every attacker, sparsity: lie about the sparsity).",
                          choices=ATTACKS)
    attackers: int = setting(0, "Simulation: how many sites attack (partitions 0 .. n-1).",
                             ge=0)
    fault: str = setting("none", "Simulation: injected fault of the faulty sites: error (the "
                         "ClientApp raises), corrupt (a truncated payload), slow (replies after "
                         "fault-seconds: past the round timeout, its reply is lost), kill (the "
                         "ClientApp process dies, os._exit(1), as a crashed or OOM-killed "
                         "process).", choices=FAULTS)
    faulty: int = setting(0, "Simulation: how many sites fail (the last partitions).", ge=0)
    fault_seconds: float = setting(30.0, "Simulation: delay of a slow site.", ge=0.0)
    fault_layer: int = setting(0, "Simulation: the faulty sites fail from the round of this "
                               "decoder layer on (iterative mode; 0: from the first round; "
                               "one-shot: 0).", ge=0)

    def validate(self) -> None:
        if (self.attack == "none") != (self.attackers == 0):
            raise self.invalid("attackers", "0 with attack none, and >= 1 with an attack")
        if (self.fault == "none") != (self.faulty == 0):
            raise self.invalid("faulty", "0 with fault none, and >= 1 with a fault")
        if self.fault_layer and self.fault == "none":
            raise self.invalid("fault_layer", "0 with fault none")


@dataclass(frozen=True)
class FedPrLLMConfig(FederationSettings, PruningSettings, AggregationSettings, VoteSettings,
                     QuantSettings, SecAggSettings, DPStatsSettings, SimulationSettings):
    """One FedPrLLM run as the clients see it. Defaults: the paper's best recipe on the embedded
    model (Wanda with its own row-wise local comparison, 50%, server layer comparison,
    one-shot, no scaling), 16 iid clients with 4 windows of 256 tokens each.

    The composition of eight pieces (:meth:`~fedcompress.config.Settings.pieces`), each with
    its own fields and checks; this class adds the checks across them. Its flat keys are the
    pieces' (``FedPrLLMConfig(clients=8, sparsity=0.6)``, ``config.piece(PruningSettings)``).
    """

    label: ClassVar[str] = "FedPrLLM"

    def validate(self) -> None:
        if self.quant != "none" and self.aggregate != "stats":
            raise self.invalid("quant", "none with aggregate votes (a quantized layer is "
                               "computed from the sum of the sites' Hessians: use --aggregate "
                               "stats)")
        if self.aggregate == "stats":
            self._validate_stats()
        if self.aggregate == "fedspallm":
            self._validate_fedspallm()
        if self.method == "sparsegpt" and self.quant != "none" and self.quant_method == "gptq":
            for key, quant_key in (("sparsegpt_block_size", "quant_block_size"),
                                   ("sparsegpt_dampening", "quant_dampening")):
                if getattr(self, key) != getattr(self, quant_key):
                    raise self.invalid(key, f"{quant_key}={getattr(self, quant_key)!r} with "
                                       "quant gptq (SparseGPT with GPTQ is one sweep: one block "
                                       "size, one dampening)")
        try:
            self.prune  # noqa: B018 - validates the N:M pattern and the plan
        except ValueError as err:
            key = "layer_sparsity" if self.layer_sparsity else "nm"
            raise self.invalid(key, f"a valid value ({err})") from None
        if self.attackers > self.clients:
            raise self.invalid("attackers", f"at most clients={self.clients}")
        if self.faulty > self.clients:
            raise self.invalid("faulty", f"at most clients={self.clients}")
        if self.fault_layer and self.mode != "iterative" and self.aggregate != "stats":
            raise self.invalid("fault_layer", "0 in one-shot mode (one round: the fault starts "
                               "at a decoder layer's round only in iterative mode)")
        if self.attack != "none" and self.mode == "iterative":
            raise self.invalid("attack", "none in iterative mode (attacks are simulated on the "
                               "one-shot masks)")
        if self.defence in ("trim", "both") and not 1 <= self.trim < self.clients / 2:
            raise self.invalid("trim", f"between 1 and fewer than half of clients="
                               f"{self.clients} with defence {self.defence!r}")
        if self.secagg:
            if self.defence in ("hamming", "both"):
                raise self.invalid("defence", "none or trim with secagg (the server sees only "
                                   "the sum: no site's distance to the majority)")
            if self.wire != "packed":
                raise self.invalid("wire", "packed with secagg (the sites send masked lanes)")
            if self.clients < 2:
                raise self.invalid("clients", "at least 2 with secagg")
            if not 0 <= self.secagg_threshold <= self.clients or self.secagg_threshold == 1:
                raise self.invalid("secagg_threshold", f"0 or 2..clients={self.clients}")
            if self.secagg_neighbours and self.secagg_neighbours < self.clients - 1 \
                    and self.secagg_neighbours % 2:
                raise self.invalid("secagg_neighbours", "0, an even degree, or at least "
                                   f"clients - 1 = {self.clients - 1} (every other site)")
        if self.dp_epsilon and self.aggregate != "stats":
            raise self.invalid("dp_epsilon", "0 with aggregate votes (a mask cannot be made "
                               "private cheaply: DP applies to statistics mode)")
        if self.dp_epsilon and self.dp_placement == "distributed" and not self.secagg:
            raise self.invalid("dp_placement", "central without secagg (distributed noise "
                               "protects a site only inside the SecAgg+ sum)")
        if self.onload and self.method == "gradient":
            raise self.invalid("onload", "false with the gradient method (its scores need a "
                               "backward pass through the whole model)")
        if self.method == "gradient" and self.mode == "iterative":
            raise self.invalid("method", "magnitude, wanda or sparsegpt in iterative mode (the "
                               "gradient scores need the whole model's backward pass, not one "
                               "layer's inputs)")
        if (self.method == "gradient" and self.wire == "compressed"
                and self.wire_reference != "none"):
            raise self.invalid("wire_reference", "none with the gradient method (the reference "
                               "column norms walk layers pruned by the local method)")

    def _validate_stats(self) -> None:
        """Statistics mode: what does not apply to it is refused, not ignored."""
        if self.method not in (*STATS_METHODS, NO_PRUNING):
            raise self.invalid("method", "wanda, ria, sparsegpt or none with aggregate stats "
                               "(their statistics are sums over tokens; magnitude needs no data)")
        if self.method == NO_PRUNING and self.quant_config is None:
            raise self.invalid("method", "wanda or sparsegpt without --quant (none prunes "
                               "nothing: it is quantization alone)")
        if self.method == NO_PRUNING and self.quant_method != "gptq":
            raise self.invalid("quant_method", "gptq with method none in statistics mode "
                               "(round to nearest needs no data: it is the rtn baseline)")
        for key, default in (("group", "layer"), ("scale", False), ("defence", "none"),
                             ("attack", "none"), ("wire", "packed")):
            if getattr(self, key) != default:
                raise self.invalid(key, f"{default!r} with aggregate stats (it applies to "
                                   "votes; the statistics' comparison group is --local-group)")

    def _validate_fedspallm(self) -> None:
        """FedSpaLLM: sparsegpt, one uniform sparsity, one plain round; the rest is refused,
        not ignored."""
        if self.method != "sparsegpt":
            raise self.invalid("method", "sparsegpt with aggregate fedspallm (the sites send "
                               "SparseGPT's updated weights)")
        one_sparsity = "with aggregate fedspallm (its mask expansion reaches one sparsity per "
        for key, wrong in (("nm", self.nm not in ("", "none")),
                           ("sparsity_profile", self.sparsity_profile != "uniform"),
                           ("layer_sparsity", bool(self.layer_sparsity))):
            if wrong:
                raise self.invalid(key, f"its default {one_sparsity}comparison group)")
        for key, default in (("mode", "oneshot"), ("scale", False), ("defence", "none"),
                             ("attack", "none"), ("secagg", False), ("wire", "packed"),
                             ("quant", "none"), ("sparsegpt_block_size", SPARSEGPT_BLOCKSIZE),
                             ("sparsegpt_dampening", SPARSEGPT_PERCDAMP)):
            if getattr(self, key) != default:
                raise self.invalid(key, f"{default!r} with aggregate fedspallm (it applies to "
                                   "FedPrLLM's votes or statistics)")

    @property
    def prune(self):
        from fedcompress.pruning.local import PruneConfig

        return PruneConfig(self.method, self.sparsity, self.local_group, self.nm,
                           self.layer_sparsity, self.onload, self.quant_config,
                           self.sparsegpt_block_size, self.sparsegpt_dampening)

    @property
    def server(self) -> ServerConfig:
        return ServerConfig(self.group, self.scale, self.tie_break, self.seed, self.defence,
                            self.trim, self.reject_z)


@dataclass(frozen=True)
class EvalConfig(TaskEvalSettings):
    """Where and how pruned models are evaluated (server only): perplexity on a corpus and,
    with ``tasks``, zero-shot accuracy (the settings every method shares)."""

    label: ClassVar[str] = "FedPrLLM evaluation"

    eval_text: str = setting("wiki", "Evaluation corpus (as --calib-text).")
    eval_split: str = setting("test", "Split of the evaluation corpus.")
    eval_seqlen: int = setting(256, "Evaluation window.", ge=2)
    eval_windows: int = setting(0, "Evaluate on the first N windows (0: the whole split).",
                                ge=0)


@dataclass(frozen=True)
class RunSettings(ServerSettings):
    """How the FedPrLLM ServerApp drives a run (server only)."""

    label: ClassVar[str] = "FedPrLLM server"
    baseline_names: ClassVar[tuple[str, ...]] = BASELINES

    baselines: str = setting("dense,centralized,local-only", "Comma-separated: dense, "
                             "centralized, local-only, rtn (with --quant: round to nearest in "
                             "place of GPTQ, no data) (or none).")
    variants: str = setting("configured", "Server variants evaluated from the same one-shot "
                            "masks: configured or all (3 groups x scaling).", choices=VARIANTS)
    resume: bool = setting(False, "Iterative mode: continue an interrupted run from OUT/"
                           "checkpoint (every aggregated layer is saved there as it completes).")
    recipe: str = setting("", "Recipe file (llm-compressor's format, YAML or JSON): its "
                          "modifiers set the pruning and quantization settings (leave those "
                          "at their defaults). prune, flwr run and a bench study carry out one "
                          "pass; compress runs a recipe's stages in order (empty: none).")
    pipeline: str = setting(DEFAULT_PIPELINE, "How a recipe's stage with a pruning and a "
                            "quantization modifier runs: independent (each in a pass of its "
                            "own, llm-compressor's oneshot default) or joint (both in one pass: "
                            "SparseGPT with GPTQ in one sweep, as --quant).", choices=PIPELINES)
