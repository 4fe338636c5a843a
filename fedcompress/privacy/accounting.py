"""DP-SGD accounting: the noise multiplier for a target (epsilon, delta), and the epsilon spent.

Thin, validated wrappers over ``opacus``' accountants, so every caller (centralized DP fine-tuning,
each site of federated DP-LoRA, the reports) computes the budget the same way:

* :func:`noise_multiplier` is computed ONCE before training, for the planned number of steps at
  the sampling rate ``q = batch_size / n`` (Poisson sampling, as opacus' DP data loader does);
* :func:`epsilon_spent` is what the accountant reports for the steps actually taken (after every
  round of a federated run, for instance); with the planned steps it is ``<= epsilon`` (the
  search stops within ``epsilon_tolerance`` below the target).

Accountants: ``"rdp"`` (Renyi DP, Mironov 2017; opacus' default, a slightly loose upper bound)
and ``"prv"`` (privacy random variables, Gopi et al. 2021; tighter). Both are opacus'.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ACCOUNTANTS",
    "RDP_ALPHAS",
    "Budget",
    "BudgetError",
    "check_budget",
    "epsilon_spent",
    "noise_multiplier",
    "noise_seed",
]

#: Accountants of opacus that fedcompress offers.
ACCOUNTANTS = ("rdp", "prv")

#: Renyi orders of the RDP accountant: opacus' defaults (1.1 .. 63) extended to 1024, so that
#: little noise (a large epsilon, a few steps) still finds its optimal order inside the range
#: (opacus warns and gives a looser bound when the optimum is its largest order).
RDP_ALPHAS = ([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
              + list(range(64, 256, 4)) + list(range(256, 1025, 32)))


def _accountant_kwargs(accountant: str) -> dict[str, Any]:
    return {"alphas": RDP_ALPHAS} if accountant == "rdp" else {}


class BudgetError(ValueError):
    """A privacy budget that is invalid or cannot be reached."""


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_budget(epsilon: float, delta: float) -> None:
    """Raise :class:`BudgetError` unless ``epsilon > 0`` and ``0 < delta < 1`` (finite numbers)."""
    if not _number(epsilon) or epsilon <= 0:
        raise BudgetError(f"epsilon={epsilon!r} is invalid: expected a finite number > 0 (use no "
                          "DP at all for an unbounded budget)")
    if not _number(delta) or not 0 < delta < 1:
        raise BudgetError(f"delta={delta!r} is invalid: expected a number in (0, 1), usually "
                          "below 1/n for n training examples")


def _check_sampling(sample_rate: float, steps: int) -> None:
    if not _number(sample_rate) or not 0 < sample_rate <= 1:
        raise BudgetError(f"sample_rate={sample_rate!r} is invalid: expected a number in (0, 1] "
                          "(batch size / number of examples)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BudgetError(f"steps={steps!r} is invalid: expected an int >= 1")


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise BudgetError(f"accountant={accountant!r} is invalid: expected one of {ACCOUNTANTS}")


def noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int,
                     accountant: str = "rdp", tolerance: float = 0.01) -> float:
    """The smallest noise multiplier ``sigma`` (to ``tolerance`` in epsilon) for which ``steps``
    DP-SGD steps at sampling rate ``sample_rate`` spend at most ``(epsilon, delta)``.

    Raises:
        BudgetError: a bad budget, rate, step count or accountant; or a target no noise
            multiplier reaches (opacus gives up beyond sigma = 2000).
    """
    check_budget(epsilon, delta)
    _check_sampling(sample_rate, steps)
    _check_accountant(accountant)
    return _noise_multiplier(float(epsilon), float(delta), float(sample_rate), int(steps),
                             accountant, float(tolerance))


@functools.lru_cache(maxsize=256)
def _noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int,
                      accountant: str, tolerance: float) -> float:
    """:func:`noise_multiplier`'s search (seconds of opacus' bisection), once per process for
    each checked argument tuple: a deterministic function of public values (a site and the
    server of a run, or the cells of a study, ask the same one many times). Errors are not
    cached."""
    from opacus.accountants.utils import get_noise_multiplier

    try:
        sigma = get_noise_multiplier(target_epsilon=float(epsilon), target_delta=float(delta),
                                     sample_rate=float(sample_rate), steps=int(steps),
                                     accountant=accountant, epsilon_tolerance=tolerance,
                                     **_accountant_kwargs(accountant))
    except ValueError as err:
        raise BudgetError(
            f"no noise multiplier reaches epsilon={epsilon} at delta={delta} with {steps} steps "
            f"at sampling rate {sample_rate:.4g} ({accountant} accountant: {err}); expected a "
            "larger epsilon or delta, fewer steps or a smaller batch") from err
    return float(sigma)


def epsilon_spent(sigma: float, sample_rate: float, steps: int, delta: float,
                  accountant: str = "rdp") -> float:
    """The epsilon the accountant gives ``steps`` steps of noise ``sigma`` at ``sample_rate``
    (0 steps: 0)."""
    if steps == 0:
        return 0.0
    _check_sampling(sample_rate, steps)
    _check_accountant(accountant)
    if not _number(sigma) or sigma <= 0:
        raise BudgetError(f"noise multiplier {sigma!r} is invalid: expected a number > 0")
    if not _number(delta) or not 0 < delta < 1:
        raise BudgetError(f"delta={delta!r} is invalid: expected a number in (0, 1)")
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    acc.history = [(float(sigma), float(sample_rate), int(steps))]
    return float(acc.get_epsilon(delta=float(delta), **_accountant_kwargs(accountant)))


@dataclass(frozen=True)
class Budget:
    """A DP-SGD run's privacy: the target, the noise it planned and what it spent.

    Attributes:
        epsilon: Target epsilon.
        delta: Target delta.
        sigma: Noise multiplier (Gaussian noise std = sigma * max_grad_norm).
        sample_rate: Poisson sampling rate ``q``.
        planned_steps: Steps the noise was computed for.
        steps: Steps taken.
        spent: Epsilon spent after ``steps`` (the accountant's).
        accountant: ``"rdp"`` or ``"prv"``.
        max_grad_norm: Per-example clipping norm ``C``.
    """

    epsilon: float
    delta: float
    sigma: float
    sample_rate: float
    planned_steps: int
    steps: int
    spent: float
    accountant: str
    max_grad_norm: float

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def noise_seed(seed: int | None, *salt: int) -> int:
    """The seed of a DP mechanism's noise, in ``[0, 2**63)``.

    ``None`` (the default everywhere) draws a fresh secret seed from the OS's entropy and returns
    it to the caller only: DP's guarantee assumes nobody knows the noise, and a seed written in a
    report or sent by a server would let its reader replay the noise and subtract it. An int
    gives reproducible noise for research, mixed with ``salt`` (round, site, ...) so that every
    draw differs; the epsilon then holds only against someone who does not know that seed.
    """
    if seed is None:
        return int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"noise seed={seed!r} is invalid: expected None (secret) or an int >= 0")
    state = np.random.SeedSequence([seed, *salt]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))
