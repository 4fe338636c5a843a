"""Privacy: leakage analyses of shared masks (and, later, sanitizers, DP training, attacks)."""
