"""Privacy's settings: secure aggregation (SecAgg+), differential privacy of statistics, the
sites' text perturbation (PPC-GPT), DP-SGD fine-tuning and the extraction audit (PrunePrivyTune).

Pieces of a method's settings (:class:`fedcompress.config.Settings`). What the server asks
here is what a site checks against its own policy (:mod:`fedcompress.privacy.policy`): a
site takes no bound a guarantee depends on from these settings alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.privacy.accounting import ACCOUNTANTS
from fedcompress.privacy.dp_stats import check_public_text, is_digest

#: What DP fine-tuning trains (:mod:`fedcompress.privacy.finetune`): LoRA adapters (+ a new
#: head) or every weight.
MODES = ("lora", "full")


@dataclass(frozen=True)
class SecAggSettings(Settings):
    """SecAgg+ of the vote counts or of the statistics."""

    label: ClassVar[str] = "secure aggregation"

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


@dataclass(frozen=True)
class DPStatsSettings(Settings):
    """Differential privacy of the sites' statistics (statistics mode)."""

    label: ClassVar[str] = "differential privacy"

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

    def validate(self) -> None:
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

    @property
    def dp(self) -> bool:
        """Whether the sites' statistics are released with differential privacy."""
        return self.dp_epsilon > 0


#: The exponential mechanisms of the sites' word-level text perturbation.
MECHANISMS = ("santext", "custext")


@dataclass(frozen=True)
class TextDPSettings(Settings):
    """The sites' text perturbation by the exponential mechanism (word-level DP,
    :mod:`fedcompress.privacy.sanitize`). A site never releases an out-of-vocabulary word: it is
    replaced by a uniform candidate (the sanitizer's ``oov='random'``; ``keep`` is not
    reachable from here)."""

    label: ClassVar[str] = "text perturbation (exponential mechanism)"

    eps: float = setting(3.0, "DP budget per perturbed word (exponential mechanism).", gt=0.0)
    noise_seed: int = setting(-1, "Seed of the clients' perturbation draws: -1 (default) a "
                              "fresh secret seed per client and run (OS entropy, never "
                              "recorded or sent); >= 0 reproducible draws, mixed with the "
                              "client's partition (research only: the eps then does not hold "
                              "against anyone who knows it).", ge=-1)
    mechanism: str = setting("custext", "santext or custext.", choices=MECHANISMS)
    top_k: int = setting(20, "CusText group size.", ge=2)
    keep_stopwords: bool = setting(False, "Release English stop words in the clear "
                                   "(CusText+; opt-in). Out-of-vocabulary words are always "
                                   "replaced.")


@dataclass(frozen=True)
class DPSGDSettings(Settings):
    """Fine-tuning with DP-SGD (LoRA, "W + LR", or every weight, "Train") and its accountant
    (:mod:`fedcompress.privacy.finetune`): per-example clipping, Gaussian noise set to reach
    ``(epsilon, dp_delta)``."""

    label: ClassVar[str] = "DP-SGD fine-tuning"

    mode: str = setting("lora", "lora (W + LR) or full (Train).", choices=MODES)
    epsilon: float = setting(8.0, "DP-SGD target epsilon per site (0: no DP).", ge=0.0)
    dp_delta: float = setting(1e-5, "DP-SGD target delta, in (0, 1).", gt=0.0, lt=1.0)
    max_grad_norm: float = setting(1.0, "Per-example clipping norm C.", gt=0.0)
    accountant: str = setting("rdp", "Privacy accountant.", choices=ACCOUNTANTS)
    dp_noise_seed: int = setting(-1, "Seed of the sites' DP-SGD noise: -1 (default) a fresh "
                                 "secret seed per run (OS entropy, never recorded or sent); "
                                 ">= 0 reproducible noise, mixed with each site's and round's "
                                 "seed (research only: the epsilon then does not hold against "
                                 "anyone who knows it).", ge=-1)
    batch_size: int = setting(16, "Examples per step (under DP: the expected Poisson batch).",
                              ge=1)
    physical_batch: int = setting(32, "Most examples per forward/backward pass; a larger batch "
                                  "is processed in chunks for one step (bounds the memory of "
                                  "DP's per-example gradients; 0: the whole batch).", ge=0)
    lr: float = setting(1e-3, "AdamW learning rate of LoRA (and of the new head).", gt=0.0)
    full_lr: float = setting(5e-5, "AdamW learning rate of full fine-tuning (mode full): every "
                             "pretrained weight moves, so a smaller rate.", gt=0.0)
    lora_r: int = setting(8, "LoRA rank.", ge=1)
    lora_alpha: int = setting(16, "LoRA alpha.", ge=1)

    @property
    def private(self) -> bool:
        return self.epsilon > 0

    def noise_note(self) -> str | None:
        """What the report says about the sites' DP-SGD noise (None without DP)."""
        if not self.private:
            return None
        if self.dp_noise_seed < 0:
            return "secret (fresh OS entropy per run, never recorded or sent)"
        return (f"reproducible from dp_noise_seed={self.dp_noise_seed}: the epsilon does NOT "
                "hold against anyone who knows it (research only)")


@dataclass(frozen=True)
class ExtractionAttackSettings(Settings):
    """The training-data extraction audit of a fine-tuned model
    (:mod:`fedcompress.privacy.extraction`)."""

    label: ClassVar[str] = "extraction attack"

    attack_samples: int = setting(32, "Members (and non-members) per site attacked by the "
                                  "extraction audit (0: no attack).", ge=0)
