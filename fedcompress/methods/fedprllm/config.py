"""FedPrLLM's settings: what the clients receive, how the server evaluates, how a run is driven.

These classes hold every default of the method: the ``fedcompress prune`` options, the
ServerApp's settings and the ``[tool.flwr.app.config.fedprllm]`` table are derived from them
(``tests/test_methods.py`` checks the table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from fedcompress.config import ServerSettings, Settings, setting
from fedcompress.masks.aggregate import TIE_BREAKS
from fedcompress.masks.robust import DEFAULT_Z, DEFENCES, check_defence
from fedcompress.methods.evaluation import TaskEvalSettings
from fedcompress.privacy.dp_stats import check_public_text, is_digest
from fedcompress.pruning.allocation import PROFILES
from fedcompress.pruning.local import METHODS, NO_PRUNING, STATS_METHODS
from fedcompress.pruning.select import GROUPS, check_group
from fedcompress.quant.config import (
    ACTORDERS,
    QUANT_METHODS,
    SCALE_DTYPES,
    SCHEMES,
    QuantConfig,
)

MODES = ("oneshot", "iterative")
#: What sites send: their masks (the vote of FedPrLLM) or their inputs' statistics (exact).
AGGREGATES = ("votes", "stats", "fedspallm")
WIRES = ("packed", "compressed")
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
#: Weight quantization of statistics mode: none, or a scheme of fedcompress.quant.
QUANT_SCHEMES = ("none", *SCHEMES)
#: GPTQ column orders a saved model can carry (no g_idx since compressed-tensors 0.19).
SAVED_ACTORDERS = tuple(a for a in ACTORDERS if a != "group")


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
class FedPrLLMConfig(Settings):
    """One FedPrLLM run as the clients see it. Defaults: the paper's best recipe on the embedded
    model (Wanda with its own row-wise local comparison, 50%, server layer comparison,
    one-shot, no scaling), 16 iid clients with 4 windows of 256 tokens each."""

    label: ClassVar[str] = "FedPrLLM"

    model: str = setting("smollm2-135m", "Model spec: embedded name, local directory, .gguf "
                         "file or hub id.")
    dtype: str = setting("float32", "Model dtype.", choices=DTYPES)
    method: str = setting("wanda", "Local pruning: magnitude, wanda, ria (relative importance "
                          "times input norm^0.5, Wanda's statistics), sparsegpt, gradient "
                          "(first-order Taylor |W * dL/dW|, one backward pass; one-shot only), "
                          "or none (quantization alone: --quant with --aggregate stats and "
                          "--sparsity 0).", choices=(*METHODS, NO_PRUNING))
    sparsity: float = setting(0.5, "Fraction of weights pruned in each linear layer, in "
                              "[0, 1).", ge=0.0, lt=1.0)
    nm: str = setting("none", "N:M semi-structured pattern, e.g. 2:4 (overrides --sparsity), "
                      "or none.")
    sparsity_profile: str = setting(
        "uniform", "Per-layer sparsity: uniform, or owl (outlier-weighted layerwise sparsity: "
        "each site sends the per-layer outlier ratios of its Wanda scores, the server averages "
        "them and sets each layer's ratio; the global ratio stays --sparsity).",
        choices=PROFILES)
    owl_lambda: float = setting(0.08, "OWL's lambda: layer ratios lie within sparsity +- lambda.",
                                ge=0.0, lt=0.5)
    owl_m: float = setting(5.0, "OWL's M: a score is an outlier above M times its layer's "
                           "mean score.", gt=0.0)
    layer_sparsity: str = setting("", "Per-layer sparsity plan: comma-separated ratios, one per "
                                  "decoder layer, or JSON {\"layers\": [...], \"linears\": "
                                  "{\"3.mlp.up_proj\": 0.4}}; its mean over the prunable "
                                  "weights must be --sparsity (empty: uniform, or set by the "
                                  "server under --sparsity-profile owl).")
    local_group: str = setting("row", "Clients' comparison group: layer, row, column.",
                               choices=GROUPS)
    group: str = setting("layer", "Server's comparison group for the vote: layer, row, "
                         "column.", choices=GROUPS)
    scale: bool = setting(False, "Scale kept weights by (m - votes)/m.")
    tie_break: str = setting("magnitude", "Among equal vote counts prune first: magnitude "
                             "(smaller |W|), random (seeded), index.", choices=TIE_BREAKS)
    defence: str = setting(
        "none", "Robust voting against Byzantine sites: none, trim (drop the trim highest and "
        "lowest votes of every weight), hamming (reject sites far from the majority mask), "
        "both.", choices=DEFENCES)
    trim: int = setting(0, "Votes trimmed per side of every weight (defence trim/both).", ge=0)
    reject_z: float = setting(DEFAULT_Z, "Hamming defence: reject a site farther than median "
                              "+ z robust deviations from the majority mask.", gt=0.0)
    mode: str = setting("oneshot", "oneshot (one round) or iterative (one round per layer).",
                        choices=MODES)
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
    mask_tolerance: float = setting(0.05, "Largest accepted distance of a client's mask "
                                    "sparsity from the target.", ge=0.0, le=1.0)
    wire: str = setting("packed", "Mask wire format: packed (1 bit per weight) or "
                        "compressed (lossless, coded against public reference norms).",
                        choices=WIRES)
    wire_reference: str = setting("wiki", "Compressed wire: public corpus (its validation "
                                  "split) of the reference norms, or none.")
    secagg: bool = setting(False, "Secure aggregation (SecAgg+) of the vote counts: the server "
                           "learns only their sum (bit-packed wire; no Hamming defence: no "
                           "site's mask is visible).")
    secagg_threshold: int = setting(0, "SecAgg+ Shamir threshold: sites needed to unmask the "
                                    "sum (0: ceil(2n/3), and more than (n + 1) / 2, at least "
                                    "2). Each site refuses one below its own minimum (node "
                                    "config secagg-min-fraction, secagg-max-colluders: by "
                                    "default more than (n + 1) / 2, safe against one site "
                                    "colluding with the server).", ge=0)
    secagg_neighbours: int = setting(0, "SecAgg+ masking graph (Bell et al. 2020): each site "
                                     "masks with and shares its secrets among this many "
                                     "neighbours of a Harary graph derived from the sites' "
                                     "fresh keys (even; 0: 2 * ceil(log2 n), 16 sites: 8; "
                                     "n - 1 or more: every other site). Each site refuses one "
                                     "below its own minimum (node config "
                                     "secagg-min-neighbours).", ge=0)
    secagg_frac_bits: int = setting(25, "SecAgg+ of statistics (aggregate stats): fractional "
                                    "bits of their fixed-point encoding in 64-bit lanes (a "
                                    "site's rounding error <= 2^-(f+1); its values must stay "
                                    "below 2^(63-f)/clients in magnitude).", ge=0, le=52)
    dp_epsilon: float = setting(
        0.0, "Statistics mode: differential privacy of each site's statistics for the whole "
        "run (every decoder layer's release composed; 0: no DP). Each site refuses more than "
        "its node config max-epsilon, and no DP unless its allow-no-dp.", ge=0.0)
    dp_delta: float = setting(1e-5, "DP statistics: delta per site for the run (at most its "
                              "node config max-delta).", gt=0.0, lt=1.0)
    dp_placement: str = setting(
        "distributed", "DP statistics: distributed (each site adds Skellam noise to its "
        "fixed-point lanes under SecAgg+, so the sum of any threshold of honest sites carries "
        "the target noise; needs --secagg) or central (the server adds Gaussian noise to the "
        "sites' clipped sum: it is trusted with that sum). A site allows what its node config "
        "dp-placements lists.", choices=("central", "distributed"))
    dp_unit: str = setting("window", "DP statistics: privacy unit (one calibration window).",
                           choices=("window",))
    dp_clip: float = setting(0.0, "DP statistics: clip bound of every input's per-window "
                             "statistic (0: from public text, --dp-clip-quantile of the "
                             "per-window norms of --dp-public-text's validation windows "
                             "through the dense model, per layer and input).", ge=0.0)
    dp_normalize: str = setting(
        "public", "DP statistics: public (each input coordinate divided by its public "
        "root-mean-square, from the same public windows as the clip bounds, before a window's "
        "statistics are clipped and noised, and multiplied back after the noise: free, and every "
        "coordinate then carries signal above the noise) or none (raw statistics: the few "
        "outlier channels take the clip bound and most coordinates sit below the noise).",
        choices=("public", "none"))
    dp_prior: str = setting(
        "shrink", "DP statistics with --dp-normalize public: shrink (the server shrinks each "
        "input's noisy normalized sums toward their mean, the public prior, by the James-Stein "
        "weight of the noise: post-processing, free; where the noise drowns the signal the "
        "pruning falls back to the public scales instead of a random mask), public (toward "
        "public text's own statistics of each layer through the server's model as pruned so "
        "far: a drowned release falls back to pruning on public text, SparseGPT's correlations "
        "included; the server computes them, --dp-public-windows windows) or none.",
        choices=("shrink", "public", "none"))
    dp_clip_quantile: float = setting(0.95, "DP statistics: quantile of the public per-window "
                                      "norms used as the default clip bound.", gt=0.0, le=1.0)
    dp_public_windows: int = setting(32, "DP statistics: public windows the default clip "
                                     "bounds are measured on.", ge=1)
    dp_public_text: str = setting(
        "wiki", "DP statistics: the public text the default clip bounds, the scales and the "
        "public prior come from: a corpus bundled with the package (wiki, shakespeare or code: "
        "its validation split, the same at every party), best the one most like the sites' "
        "text (code for sites holding source code); or 'sha256:<hex>', a file the federation "
        "publishes for a domain no bundled corpus covers, pinned by its SHA-256 (sha256sum "
        "FILE): each site reads it only from the files its node config dp-public-files lists "
        "as public, the server from --dp-public-file. A site refuses anything else: a file the "
        "server named could be the site's own data.")
    dp_public_file: str = setting(
        "", "DP statistics with --dp-public-text sha256:...: the server's copy of the pinned "
        "public file (and the simulated sites'; a deployed site never reads a path the server "
        "sends). Its SHA-256 must be the digest.")
    quant: str = setting(
        "none", "Statistics mode: quantize every linear layer of the decoder layers too, from "
        "the summed Hessians (GPTQ) or without data (rtn), layer by layer, the sites' next "
        "inputs coming from the quantized layer: w4a16 (4-bit integer weights) or w8a16; with "
        "sparsegpt, pruned and quantized jointly; saved in the compressed-tensors format "
        "(pack-quantized).", choices=QUANT_SCHEMES)
    quant_method: str = setting("gptq", "Quantization solver: gptq (error compensation from "
                                "the sites' summed Hessians) or rtn (round to nearest, no "
                                "data).", choices=QUANT_METHODS)
    quant_group_size: int = setting(128, "Quantization: columns sharing a scale (it must "
                                    "divide every layer's input width; 0: one scale per "
                                    "output channel).", ge=0)
    quant_symmetric: bool = setting(True, "Quantization: symmetric (zero point 0) or "
                                    "asymmetric integer grids.")
    quant_actorder: str = setting("static", "GPTQ's column order: none or static (by "
                                  "decreasing Hessian diagonal, scales in the weight's own "
                                  "groups; groups formed in that order need a g_idx, which "
                                  "compressed-tensors no longer saves).",
                                  choices=SAVED_ACTORDERS)
    quant_dampening: float = setting(0.01, "GPTQ: fraction of the Hessian's mean diagonal "
                                     "added to its diagonal.", gt=0.0, lt=1.0)
    quant_block_size: int = setting(128, "GPTQ: columns updated together.", ge=1)
    quant_preserve_zeros: bool = setting(
        False, "Quantization alone (method none): keep the zeros of a weight at least 5% zero "
        "(a model pruned before, e.g. by a recipe's earlier stage: no error is pushed into "
        "them, as earlier llm-compressor releases did; 0.14's GPTQ fills some in. A checkpoint "
        "converted from a quantized GGUF may hold such zeros unpruned).")
    quant_scale_dtype: str = setting("bfloat16", "Quantization: dtype of the scales (the "
                                     "dequantized weights are computed in it, as runtimes do "
                                     "from the saved scales).", choices=SCALE_DTYPES)
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
        if self.method == NO_PRUNING and self.sparsity != 0:
            raise self.invalid("sparsity", "0 with method none (it prunes nothing)")
        if self.quant != "none" and self.aggregate != "stats":
            raise self.invalid("quant", "none with aggregate votes (a quantized layer is "
                               "computed from the sum of the sites' Hessians: use --aggregate "
                               "stats)")
        if self.aggregate == "stats":
            self._validate_stats()
        if self.aggregate == "fedspallm":
            self._validate_fedspallm()
        elif self.fedspallm_layers:
            raise self.invalid("fedspallm_layers", "0 unless aggregate is fedspallm")
        if self.nm not in ("", "none") and (self.sparsity_profile != "uniform"
                                            or self.layer_sparsity):
            raise self.invalid("nm", "none with a per-layer sparsity profile or plan (N:M fixes "
                               "every layer's ratio)")
        try:
            self.prune  # noqa: B018 - validates the N:M pattern and the plan
        except ValueError as err:
            key = "layer_sparsity" if self.layer_sparsity else "nm"
            raise self.invalid(key, f"a valid value ({err})") from None
        if self.min_clients > self.clients:
            raise self.invalid("min_clients", f"at most clients={self.clients} (0: all)")
        if self.attackers > self.clients:
            raise self.invalid("attackers", f"at most clients={self.clients}")
        if (self.attack == "none") != (self.attackers == 0):
            raise self.invalid("attackers", "0 with attack none, and >= 1 with an attack")
        if self.faulty > self.clients:
            raise self.invalid("faulty", f"at most clients={self.clients}")
        if (self.fault == "none") != (self.faulty == 0):
            raise self.invalid("faulty", "0 with fault none, and >= 1 with a fault")
        if self.fault_layer and self.mode != "iterative" and self.aggregate != "stats":
            raise self.invalid("fault_layer", "0 in one-shot mode (one round: the fault starts "
                               "at a decoder layer's round only in iterative mode)")
        if self.fault_layer and self.fault == "none":
            raise self.invalid("fault_layer", "0 with fault none")
        if self.attack != "none" and self.mode == "iterative":
            raise self.invalid("attack", "none in iterative mode (attacks are simulated on the "
                               "one-shot masks)")
        if self.defence in ("trim", "both") and not 1 <= self.trim < self.clients / 2:
            raise self.invalid("trim", f"between 1 and fewer than half of clients="
                               f"{self.clients} with defence {self.defence!r}")
        if self.defence in ("none", "hamming") and self.trim:
            raise self.invalid("trim", f"0 with defence {self.defence!r} (only trim and both "
                               "trim votes)")
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
        if self.dp_epsilon and self.dp_prior != "none" and self.dp_normalize != "public":
            raise self.invalid("dp_prior", "none with dp_normalize none (the prior is the "
                               "public scales' shape: raw statistics have none)")
        try:
            check_public_text(self.dp_public_text)
        except ValueError as err:
            raise self.invalid("dp_public_text", f"a valid public text ({err})") from None
        if self.dp_public_file and not is_digest(self.dp_public_text):
            raise self.invalid("dp_public_file", "'' unless dp_public_text is a file's digest "
                               "('sha256:' and sha256sum FILE's 64 hex digits; a bundled "
                               "corpus needs no file)")
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
                             ("quant", "none")):
            if getattr(self, key) != default:
                raise self.invalid(key, f"{default!r} with aggregate fedspallm (it applies to "
                                   "FedPrLLM's votes or statistics)")

    def neighbours_for(self, sites: int) -> int:
        """The SecAgg+ masking graph's degree over ``sites`` sites (``sites - 1``: complete)."""
        from fedcompress.privacy.secagg_graph import default_neighbours

        return min(sites - 1, self.secagg_neighbours or default_neighbours(sites))

    def threshold_for(self, sites: int) -> int:
        """The SecAgg+ threshold of an aggregation over ``sites`` sites."""
        if self.secagg_threshold:
            return min(self.secagg_threshold, sites)
        # two thirds of the sites, and at least the floor of a site's default policy (one
        # colluder: more than (n + 1) / 2), so that deployed sites accept the default
        return min(sites, max(2, -(-2 * sites // 3), (sites + 1) // 2 + 1))

    @property
    def quant_config(self) -> QuantConfig | None:
        """The quantization recipe (None: no quantization)."""
        if self.quant == "none":
            return None
        return QuantConfig(self.quant, self.quant_method, self.quant_group_size,
                           self.quant_symmetric, self.quant_actorder, self.quant_dampening,
                           self.quant_block_size, scale_dtype=self.quant_scale_dtype,
                           preserve_zeros=self.quant_preserve_zeros)

    @property
    def prune(self):
        from fedcompress.pruning.local import PruneConfig

        return PruneConfig(self.method, self.sparsity, self.local_group, self.nm,
                           self.layer_sparsity, self.onload, self.quant_config)

    @property
    def dp(self) -> bool:
        """Whether the sites' statistics are released with differential privacy."""
        return self.dp_epsilon > 0

    @property
    def server(self) -> ServerConfig:
        return ServerConfig(self.group, self.scale, self.tie_break, self.seed, self.defence,
                            self.trim, self.reject_z)

    @property
    def required_clients(self) -> int:
        return self.min_clients or self.clients


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
