"""Benchmark sweeps of aggregation strategies: plan, run (resumable), tables and plots."""
