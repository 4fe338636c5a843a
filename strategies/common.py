"""What every fedcompress strategy shares: waiting for nodes, the not-enough-clients outcome."""

from __future__ import annotations

import time

from flwr.serverapp import Grid


class NotEnoughClientsError(RuntimeError):
    """Fewer valid client replies (or connected nodes) than the run requires."""


def wait_for_nodes(grid: Grid, wanted: int, required: int, node_wait: float) -> list[int]:
    """The first ``wanted`` connected nodes (sorted ids: the same nodes every round), waiting up
    to ``node_wait`` seconds for them to connect; fewer than ``required`` is an error."""
    deadline = time.monotonic() + node_wait
    while len(nodes := sorted(grid.get_node_ids())) < wanted:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(nodes) < required:
        raise NotEnoughClientsError(f"{len(nodes)} nodes connected, the run needs {required}")
    return nodes[:wanted]
