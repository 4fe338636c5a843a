"""One orchestration path: a bench cell runs the strategies and ClientApp of ``fedcompress
prune`` (an in-process grid instead of Ray), so on the tiny model its masks and perplexity equal
a Flower simulation's, for one-shot votes, the iterative mode, statistics mode and FedSpaLLM.

Two sites: their sums (vote counts, statistics, FedSpaLLM's weights) are the same in either
order, and the Simulation Engine's node ids, whose order decides the sites' order, are random.
The sites compute on one thread here, as a Ray actor of one CPU does (``site_threads=1``).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_bench, write_bench_config

from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from fedcompress.methods.fedprllm.experiment import EvalConfig, prepare_experiment
from fedcompress.models import load_model

BASE = dict(clients=2, samples_per_client=2, seqlen=16, batch_size=2)
EVAL = dict(eval_seqlen=16, eval_windows=2)
KINDS = {
    "oneshot": dict(group="row"),
    "iterative": dict(mode="iterative"),
    "stats": dict(aggregate="stats"),
    "fedspallm": dict(method="sparsegpt", aggregate="fedspallm"),
}


@pytest.mark.simulation
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bench_cell_equals_fedcompress_prune(tiny_dir, tmp_path, kind):
    from server.bench import InProcessFederation
    from server.simulation import simulate_method

    settings = {"model": tiny_dir, **BASE, **KINDS[kind]}
    sim = tmp_path / "sim"
    simulate_method("fedprllm", {**settings, **EVAL, "out": str(sim), "device": "cpu",
                                 "baselines": "none"})
    report = json.loads((sim / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    (flower,) = report["results"]

    # the bench: the cell's record, resumed from results.jsonl like every cell
    out = tmp_path / "bench"
    config = {"bench": {**BASE, **EVAL, "model": tiny_dir}, "study": {kind: KINDS[kind]}}
    done = run_bench(write_bench_config(tmp_path, config), out, progress=False, site_threads=1)
    assert done.status == "ok"
    (record,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["name"] == flower["name"]
    assert record["perplexity"] == flower["perplexity"]
    assert record["sparsity_per_layer"] == flower["sparsity_per_layer"]
    assert record["rounds"] == flower["rounds"]

    # the very weights: the bench's vote prunes the model the simulation saved
    config = FedPrLLMConfig.from_dict(settings)
    exp = prepare_experiment(config, EvalConfig(**EVAL))
    run = InProcessFederation(threads=1).run(exp, [config], tmp_path / "direct")
    model = exp.fresh_copy()
    run.strategy.prune(model, config.server)
    saved = load_model(str(sim / "model"), device="cpu").model
    for (key, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), key
    run.close()
