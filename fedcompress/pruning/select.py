"""Moved to :mod:`fedcompress.solver.select` (the selection is shared by pruning's scores and
the OBS sweep below both pruning and quantization); this module keeps the old imports working."""

from fedcompress.solver.select import (
    GROUPS,
    block_prune_count,
    check_group,
    check_sparsity,
    parse_nm,
    select_prune_mask,
)

__all__ = ["GROUPS", "block_prune_count", "check_group", "check_sparsity", "parse_nm",
           "select_prune_mask"]
