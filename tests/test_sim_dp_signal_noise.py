"""simulations/dp_signal_noise.py on the tiny model: one record per budget, epsilon and
normalization, signal against noise growing with epsilon and with the windows, masks flipped
in [0, 1], and a clear error for a bad budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def sim():
    path = Path(__file__).resolve().parents[1] / "simulations" / "dp_signal_noise.py"
    spec = importlib.util.spec_from_file_location("sim_dp_signal_noise", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_signal_noise_records(sim, tiny_dir, corpus, tmp_path):
    out = tmp_path / "out"
    sim.main(["--model", tiny_dir, "--calib-text", corpus, "--budgets", "2x2", "2x8",
              "--epsilons", "2", "16", "--clip-quantiles", "0.95", "0.5", "--sample", "4",
              "--seqlen", "16", "--batch-size", "2",
              "--plot-budget", "2x8", "--plot-epsilon", "16", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    records = {(r["budget"], r["epsilon"], (r["normalize"], r["prior"]), r["clip_quantile"]): r
               for r in report["results"]}
    assert len(records) == 2 * 2 * 3 * 2
    for (budget, eps, norm, q), r in records.items():
        assert r["windows"] == {"2x2": 4, "2x8": 16}[budget]
        assert 0 <= r["flipped"] <= 1 and 0 <= r["clipped"] <= 1
        assert len(r["layers"]) == 3  # every decoder layer of the tiny llama
        # more epsilon, less noise; more windows, more signal (the noise is the same)
        if eps == 2:
            assert records[budget, 16.0, norm, q]["median_snr"] > r["median_snr"]
        if q == 0.5:  # a lower bound clips more windows
            assert r["clipped"] >= records[budget, eps, norm, 0.95]["clipped"]
        if budget == "2x2":
            assert records["2x8", eps, norm, q]["median_snr"] == pytest.approx(
                4 * r["median_snr"], rel=1e-6)
    assert (out / "signal_noise.png").stat().st_size > 0
    assert "Signal against noise" in (out / "report.md").read_text()


def test_bad_budget_is_refused(sim):
    with pytest.raises(SystemExit):
        sim.main(["--budgets", "16by4"])
