"""The vote's settings: how the server turns the sites' masks into the global mask.

A piece of a method's settings (:class:`fedcompress.config.Settings`): FedPrLLM's vote
(one-shot or iterative), its comparison group, scaling and tie-break, robust voting against
Byzantine sites, and the masks' wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting
from fedcompress.masks.aggregate import TIE_BREAKS
from fedcompress.masks.robust import DEFAULT_Z, DEFENCES
from fedcompress.solver.select import GROUPS

MODES = ("oneshot", "iterative")
WIRES = ("packed", "compressed")


@dataclass(frozen=True)
class VoteSettings(Settings):
    """FedPrLLM's vote over the sites' masks."""

    label: ClassVar[str] = "vote"

    mode: str = setting("oneshot", "oneshot (one round) or iterative (one round per layer).",
                        choices=MODES)
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
    mask_tolerance: float = setting(0.05, "Largest accepted distance of a client's mask "
                                    "sparsity from the target.", ge=0.0, le=1.0)
    wire: str = setting("packed", "Mask wire format: packed (1 bit per weight) or "
                        "compressed (lossless, coded against public reference norms).",
                        choices=WIRES)
    wire_reference: str = setting("wiki", "Compressed wire: public corpus (its validation "
                                  "split) of the reference norms, or none.")

    def validate(self) -> None:
        if self.defence in ("none", "hamming") and self.trim:
            raise self.invalid("trim", f"0 with defence {self.defence!r} (only trim and both "
                               "trim votes)")
