"""Bench studies of kind ``network`` (simulated time from the cells' measured bytes, rounds and
seconds) and ``leakage`` (resumable cells), planned, resumed and reported with the sweeps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_bench, write_bench_config

from fedcompress.bench import network as net
from fedcompress.bench.studies import network_rows
from fedcompress.bench.sweep import BenchConfigError, Cell, Study, plan


def _config(model: str, corpus: str) -> dict:
    bench = {"model": model, "seqlen": 16, "batch_size": 2, "eval_seqlen": 16,
             "eval_windows": 2, "clients": 2, "samples_per_client": 1, "sparsity": 0.5}
    return {"bench": bench, "study": {
        "vote": {"mode": ["oneshot", "iterative"], "group": "layer"},
        "wire": {"wire": ["packed", "compressed"], "group": "layer"},
        "network": {"kind": "network", "studies": ["vote", "wire"],
                    "profiles": ["datacenter", "edge"], "stragglers": [0.0, 0.5]},
        "leakage": {"kind": "leakage", "title": "Leakage, tiny", "layers": 2, "clients": 3,
                    "samples_per_client": 2, "replacements": 2, "half_overlap": 1,
                    "nonmembers": 2, "calib_text": corpus}}}


@pytest.fixture(scope="module")
def bench(tiny_dir, corpus, tmp_path_factory):
    """One bench of the tiny llama with a vote, a wire, a network and a leakage study."""
    root = tmp_path_factory.mktemp("bench")
    config = _config(tiny_dir, corpus)
    out = root / "out"
    report = run_bench(write_bench_config(root, config), out, progress=False)
    return config, root, out, report


def test_the_plan_of_network_and_leakage_studies(tiny_dir, corpus):
    studies = {s.name: s for s in plan(_config(tiny_dir, corpus))}
    network, leakage = studies["network"], studies["leakage"]
    assert network.kind == "network" and leakage.kind == "leakage"
    # the FedPrLLM cells of the vote and wire studies, once each (one-shot packed is shared)
    assert len(network.cells) == 3 and all(c.kind == "fedprllm" for c in network.cells)
    assert {"mode", "wire"} <= set(network.swept)
    (cell,) = leakage.cells
    settings = dict(cell.client)
    # [bench] settings that mean the same apply (model, seqlen, sparsity), the study's win
    assert (settings["clients"], settings["seqlen"], settings["layers"]) == (3, 16, 2)
    # the compressed wire shares the bit-packed cells' client masks, not their vote
    wire = [c for c in studies["wire"].cells]
    assert wire[0].client_id == wire[1].client_id and wire[0].vote_id != wire[1].vote_id

    bad = _config(tiny_dir, corpus)
    bad["study"]["leakage"]["group"] = "row"
    with pytest.raises(BenchConfigError, match="local_group"):
        plan(bad)
    bad = _config(tiny_dir, corpus)
    bad["study"]["network"]["studies"] = ["nope"]
    with pytest.raises(BenchConfigError, match="'nope'"):
        plan(bad)
    bad = _config(tiny_dir, corpus)
    bad["study"]["network"]["profiles"] = ["moon"]
    with pytest.raises(BenchConfigError, match="moon"):
        plan(bad)
    bad = _config(tiny_dir, corpus)
    bad["study"]["network"]["sparsity"] = 0.3
    with pytest.raises(BenchConfigError, match="takes no cell settings"):
        plan(bad)
    bad = _config(tiny_dir, corpus)
    bad["study"]["vote"]["wire"] = "compressed"
    with pytest.raises(BenchConfigError, match="one-shot cells only"):
        plan(bad)


def test_network_time_is_the_network_modules_arithmetic():
    """Exact numbers on a hand-made record: edge (100 ms, 10 Mbps), 4 clients, 1 MB up, 2 s of
    compute, 0.5 s at the server; half the clients straggle (bandwidth / 2, compute x 2)."""
    cell = Cell("fedprllm", (("mode", "oneshot"), ("clients", 4)), (("group", "layer"),))
    study = Study("n", "n", {}, [], [], "profile", [cell], kind="network",
                  options={"profiles": ["edge"], "stragglers": [0.0, 0.5],
                           "straggler_transfer": 2.0, "straggler_compute": 2.0,
                           "straggler_seed": 0})
    record = {"status": "ok", "mode": "oneshot", "clients": 4, "rounds": 1,
              "bytes_up_per_client": 1_000_000, "client_seconds_mean": 2.0,
              "count_seconds": 0.25, "aggregate_seconds": 0.25}
    fast, slow = network_rows(study, {cell.id: record})
    assert fast["seconds"]["edge"] == pytest.approx(0.1 + 2.0 + 0.1 + 0.8 + 0.5, rel=1e-12)
    assert slow["seconds"]["edge"] == pytest.approx(0.1 + 4.0 + 0.1 + 1.6 + 0.5, rel=1e-12)
    assert slow["slow_clients"] == 2 and slow["rounds"] == 1 and slow["bytes_up"] == 1e6


def test_network_study_simulates_the_cells_measured_bytes_and_seconds(bench):
    config, _, out, report = bench
    assert report.status == "ok"
    data = json.loads((out / "report.json").read_text())
    meta = data["studies"]["network"]
    assert meta["kind"] == "network" and meta["options"]["profiles"] == ["datacenter", "edge"]
    records = {r["id"]: r for r in data["results"]}
    study = {s.name: s for s in plan(config)}["network"]
    rows = network_rows(study, records)
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        r = records[row["cell"]]
        if r["mode"] == "oneshot":  # one round: the cell's bytes, client and server seconds
            schedule = net.Schedule("one-shot", [int(round(r["bytes_up_per_client"]))],
                                    [r.get("bytes_down_per_client", 0)],
                                    [r["client_seconds_mean"]
                                     + r.get("wire_encode_seconds_mean", 0.0)])
            server = (r["count_seconds"] + r["aggregate_seconds"]
                      + r.get("wire_decode_seconds_total", 0.0) + r.get("reference_seconds", 0.0))
        else:  # one round per decoder layer, the measured per-layer bytes and seconds
            assert r["rounds"] == 3 == len(r["layer_bytes_up_per_client"])
            schedule = net.Schedule("iterative", r["layer_bytes_up_per_client"],
                                    r["layer_bytes_down_per_client"],
                                    r["layer_client_seconds_mean"])
            server = sum(r["layer_server_seconds"]) / 3
        stragglers = net.Stragglers(row["stragglers"], 2.0, 2.0, 0)
        for profile in ("datacenter", "edge"):
            expected = net.simulate(schedule, 2, profile, stragglers, server).total_seconds
            assert row["seconds"][profile] == pytest.approx(expected, rel=1e-12)
    compressed = next(r for r in records.values() if r.get("wire") == "compressed")
    packed = next(r for r in records.values() if r.get("wire") == "packed"
                  and r.get("mode") == "oneshot")
    # the compressed wire's bytes are measured (its payloads), not the bit-packed size
    assert compressed["wire_bytes_up"] and compressed["bytes_down_per_client"] > 0
    assert compressed["bytes_up_per_client"] == np.mean(compressed["wire_bytes_up"])
    assert compressed["perplexity"] == packed["perplexity"]  # the same masks, the same vote
    md = (out / "report.md").read_text()
    assert "| edge s |" in md and "Simulated end-to-end seconds" in md
    assert "| layer, compressed wire |" in md  # the server's cost per wire format
    assert (out / "network-network.png").exists()


def test_leakage_study_is_a_resumable_cell(bench, monkeypatch):
    config, root, out, _ = bench
    lines = (out / "results.jsonl").read_text().splitlines()
    leakage = [json.loads(line) for line in lines if json.loads(line)["kind"] == "leakage"]
    assert len(leakage) == 1
    record = leakage[0]
    assert record["status"] == "ok" and record["measured_layers"] == 2
    assert record["leakage"]["hamming"]["same_windows"]["mean"] == 0.0  # deterministic
    assert record["auc_knows_rest"] == 1.0
    md = (out / "report.md").read_text()
    assert "#### (b) Hamming distances" in md and "#### (d) Membership inference" in md
    assert "disjoint windows (all client pairs)" in md and (out / "leakage-leakage.png").exists()

    # A rerun finds every cell finished: nothing is measured again.
    import fedcompress.bench.leakage as experiment

    def boom(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr(experiment, "measure", boom)
    monkeypatch.setattr("fedcompress.methods.fedprllm.experiment.local_masks", boom)
    again = run_bench(write_bench_config(root, config), out, progress=False)
    assert again.status == "ok"
    assert (out / "results.jsonl").read_text().splitlines() == lines


def test_dry_run_shows_the_plan_of_every_kind(tiny_dir, corpus, tmp_path):
    from typer.testing import CliRunner

    from fedcompress.cli import app

    path = write_bench_config(tmp_path, _config(tiny_dir, corpus))
    result = CliRunner().invoke(app, ["bench", path, "--out", str(tmp_path / "out"),
                                      "--dry-run", "--no-progress"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["status"] == "planned" and data["plan"] == {"cells": 4, "pending": 4}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| datacenter s | edge s |" in md and "pending" in md
    assert "Leakage, tiny" in md and "No cell has finished yet" in md
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_report_page_renders_network_and_leakage_tables(bench):
    from fedcompress.report_html import render_run

    _, _, out, _ = bench
    page = render_run(out)
    assert "<h3>Leakage, tiny</h3>" in page and "<h4>(c) Sensitivity</h4>" in page
    assert "H(client mask | another client&#x27;s mask)" in page or (
        "H(client mask | another client's mask)" in page)
    assert "datacenter s" in page and "edge s" in page
    data = json.loads((out / "report.json").read_text())
    records = {r["id"]: r for r in data["results"]}
    study = {s.name: s for s in plan(_config(*_model_corpus(data)))}["network"]
    for row in network_rows(study, records):
        assert f"{row['seconds']['edge']:.4g}" in page  # the table's numbers, from report.json


def _model_corpus(data: dict) -> tuple[str, str]:
    return data["config"]["bench"]["model"], data["config"]["study"]["leakage"]["calib_text"]
