"""PPC-GPT pipeline (fedcompress.methods.ppcgpt) and its Flower apps on tiny models: client data and
perturbation, the server's validation of client text, layer removal + adapter round trip, the
strategy with bad clients, and one real Flower simulation against a stub generator server."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import InProcessFederation, yes_no_generator
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedcompress.data.embeddings import EmbeddingTable
from fedcompress.methods import ppcgpt
from fedcompress.methods.ppcgpt import InvalidClientText, PPCGPTConfig
from fedcompress.models import load_model, num_layers
from fedcompress.privacy.sanitize import Sanitizer, SanitizerConfig
from strategies.ppcgpt import PPCGPT, NotEnoughClientsError


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def config_for(tiny_dir, **kw) -> PPCGPTConfig:
    base = dict(model=tiny_dir, task="strategyqa", clients=3, examples_per_client=4,
                eval_per_client=4, prune_ratio=0.34, server_steps=1, client_steps=1,
                batch_size=2, grad_accum=1, max_length=64, min_synthetic=1,
                synth_batch_size=4)
    base.update(kw)
    return PPCGPTConfig(**base)


def tiny_sanitizer(mechanism="santext") -> Sanitizer:
    rng = np.random.default_rng(0)
    words = ("is the king in city river war year people a of yes no what who which "
             "made first new time").split()
    table = EmbeddingTable(tuple(words), rng.normal(size=(len(words), 4)).astype(np.float32),
                           source="tiny")
    return Sanitizer(table, SanitizerConfig(mechanism=mechanism, top_k=3, candidates=None))


SAMPLES = [{"id": f"s{i}", "question": f"Is the king number {i} in the city?",
            "choices": ["Yes", "No"], "label": i % 2,
            "rationale": "the king was in the city in that year."} for i in range(4)]


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(eps=0.0), "eps"), (dict(eps=float("inf")), "eps"), (dict(prune_ratio=1.0), "prune_ratio"),
    (dict(clients=0), "clients"), (dict(partition="zipf"), "partition"),
    (dict(prune_policy="random"), "prune_policy"), (dict(mechanism="laplace"), "mechanism"),
    (dict(min_clients=5, clients=3), "min_clients"), (dict(lora_dropout=1.0), "lora_dropout"),
])
def test_bad_settings_are_clear_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        PPCGPTConfig(**kw)


def test_settings_from_flat_dict():
    config = PPCGPTConfig.from_dict({"prune-ratio": 0.5, "rationales": "false", "eps": 1,
                                     "server_steps": 2.0})
    assert config.prune_ratio == 0.5 and config.rationales is False
    assert isinstance(config.eps, float) and config.server_steps == 2
    assert PPCGPTConfig.from_dict(config.to_dict()) == config
    assert config.train_config("server").rationale_weight == 0.0
    with pytest.raises(ValueError, match="unknown PPC-GPT setting"):
        PPCGPTConfig.from_dict({"epsilon": 3})


def test_settings_are_composed_of_pieces():
    """Five pieces, each where its subject lives, with the 45 flat settings of the run in piece
    order; each piece's own checks run with the composition; old imports keep working."""
    from fedcompress.distill.settings import CoTDistillSettings
    from fedcompress.layers.settings import BlockInfluenceSettings
    from fedcompress.privacy.settings import TextDPSettings
    from fedcompress.synth.settings import SynthSettings

    pieces = (ppcgpt.PPCGPTFederationSettings, TextDPSettings, SynthSettings,
              BlockInfluenceSettings, CoTDistillSettings)
    assert PPCGPTConfig.pieces() == pieces
    assert PPCGPTConfig.names() == [n for p in pieces for n in p.names()]
    assert len(PPCGPTConfig.names()) == 45 and max(len(p.names()) for p in pieces) <= 20
    assert PPCGPTConfig.owner("top_k") is TextDPSettings
    assert PPCGPTConfig.owner("synth_url") is SynthSettings
    assert PPCGPTConfig.owner("rationales") is CoTDistillSettings
    config = PPCGPTConfig(eps=1.0, lora_r=4, prune_policy="seq", min_clients=2)
    assert config.piece(TextDPSettings) == TextDPSettings(eps=1.0)
    assert config.piece(BlockInfluenceSettings) == BlockInfluenceSettings(prune_policy="seq")
    assert config.piece(CoTDistillSettings).lora() == config.lora() and config.lora().r == 4
    assert config.required_clients == 2
    for make in (ppcgpt.PPCGPTFederationSettings, PPCGPTConfig):  # the piece's own check
        with pytest.raises(ValueError, match="min_clients=5 is invalid: expected at most "
                                             "clients=3"):
            make(clients=3, min_clients=5)
    assert ppcgpt.PRUNE_POLICIES == ("bi", "seq") and ppcgpt.MECHANISMS == ("santext", "custext")
    assert PPCGPTConfig.top_k == 20  # a default as a class attribute, as before


# -- client data and perturbation ----------------------------------------------------------------
@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_client_data_is_disjoint_and_seeded(tiny_dir, partition):
    config = config_for(tiny_dir, partition=partition, alpha=0.5, examples_per_client=0,
                        eval_per_client=0)
    parts = [ppcgpt.client_data(config, p) for p in range(3)]
    train_ids = [{r["id"] for r in d.train} for d in parts]
    test_ids = [{r["id"] for r in d.test} for d in parts]
    assert not (train_ids[0] & train_ids[1]) and not (test_ids[1] & test_ids[2])
    assert sum(map(len, train_ids)) == len(ppcgpt.load_task("strategyqa", "train"))
    again = ppcgpt.client_data(config, 1)
    assert [r["id"] for r in again.train] == [r["id"] for r in parts[1].train]
    small = ppcgpt.client_data(config_for(tiny_dir), 0)
    assert len(small.train) == 4 and len(small.test) == 4


def test_client_data_errors(tiny_dir):
    with pytest.raises(ValueError, match="outside"):
        ppcgpt.client_data(config_for(tiny_dir), 3)
    with pytest.raises(ValueError, match="training examples"):
        ppcgpt.client_data(config_for(tiny_dir, examples_per_client=10_000), 0)


def test_perturbation_sends_no_labels_and_counts_the_budget():
    sanitizer = tiny_sanitizer()
    records = [{"id": "secret-1", "question": "Is the king in the city?",
                "choices": ["Yes", "No"], "label": 0},
               {"id": "secret-2", "question": "Who made the river?", "choices": ["Yes", "No"],
                "label": 1}]
    examples, budget = ppcgpt.perturb_records(records, sanitizer, eps=2.0, seed=0, prefix="c0")
    assert [e["id"] for e in examples] == ["c0-0", "c0-1"]
    assert all(set(e) == {"id", "question", "choices"} for e in examples)
    assert all(e["choices"] == ["Yes", "No"] for e in examples)  # closed label set: public
    assert not budget["choices_perturbed"]
    assert budget["perturbed"] == 10 and budget["words"] == 10  # 6 + 4 words, all perturbed
    assert budget["eps_per_example_max"] == pytest.approx(12.0)  # 6 words x eps 2
    again, _ = ppcgpt.perturb_records(records, sanitizer, eps=2.0, seed=0, prefix="c0")
    assert again == examples
    # Open choices (they differ between examples) are private text: perturbed and counted.
    records[1]["choices"] = ["the king", "the people"]
    examples, budget = ppcgpt.perturb_records(records, sanitizer, eps=2.0, seed=0)
    assert budget["choices_perturbed"] and budget["perturbed"] == 10 + 2 + 4  # yes no, 2 x 2


# -- the server's validation of client text ------------------------------------------------------
def test_parse_perturbed_round_trip():
    examples = [{"id": "a", "question": "q?", "choices": ["x", "y"]}]
    assert ppcgpt.parse_perturbed(json.dumps(examples)) == examples


@pytest.mark.parametrize("payload, message", [
    ("{not json", "not JSON"), ('{"a": 1}', "dict"), ("[]", "empty"), ("[1]", "int"),
    ('[{"id": "a", "question": "q", "choices": ["x", "y"], "label": 0}]', "carries a label"),
    ('[{"id": "a", "question": "q", "choices": ["x", "y"]},'
     ' {"id": "a", "question": "q", "choices": ["x", "y"]}]', "repeated"),
    ('[{"id": "a", "question": " ", "choices": ["x", "y"]}]', "question"),
    ('[{"id": "a", "question": "q", "choices": ["x"]}]', "choices"),
    ('[{"id": "a", "question": "q", "choices": ["x", 3]}]', "choices"),
    (json.dumps([{"id": "a", "question": "q" * 5000, "choices": ["x", "y"]}]), "characters"),
])
def test_garbage_client_text_is_a_clear_error(payload, message):
    with pytest.raises(InvalidClientText, match=message):
        ppcgpt.parse_perturbed(payload)


# -- server compression and the client's rebuilt model ------------------------------------------
@pytest.mark.parametrize("policy, rationales", [("bi", True), ("bi", False), ("seq", True)])
def test_compress_removes_layers_of_a_copy(tiny_dir, tiny, policy, rationales):
    config = config_for(tiny_dir, prune_policy=policy, rationales=rationales)
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    comp = ppcgpt.compress(tiny.model, tiny.tokenizer, SAMPLES, config)
    assert num_layers(tiny.model) == 3 and len(comp.plan.removed) == 1
    assert all(torch.equal(before[k], v) for k, v in tiny.model.state_dict().items())
    assert num_layers(comp.model.get_base_model()) == 2
    if policy == "seq":
        assert comp.plan.removed == (2,) and comp.importance is None
    else:
        assert comp.importance.method == ("block_influence:label+rationale" if rationales
                                          else "block_influence")
    assert comp.train_metrics["steps"] == 1
    assert ("rationale" in comp.train_metrics["task_loss"]) == rationales


def test_client_rebuilds_the_servers_model_exactly(tiny_dir, tiny):
    config = config_for(tiny_dir, server_steps=2, lr=1e-2)
    comp = ppcgpt.compress(tiny.model, tiny.tokenizer, SAMPLES, config)
    arrays = ppcgpt.adapter_arrays(comp.model)
    assert any(np.abs(a).sum() > 0 for k, a in arrays.items() if "lora_B" in k)  # trained
    rebuilt = ppcgpt.rebuild_model(tiny.model, list(comp.plan.removed), arrays, config.lora())
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    comp.model.eval(), rebuilt.eval()
    with torch.no_grad():
        assert torch.allclose(comp.model(ids).logits, rebuilt(ids).logits, atol=1e-6)
    assert num_layers(tiny.model) == 3


def test_rebuild_rejects_a_mismatched_adapter(tiny_dir, tiny):
    config = config_for(tiny_dir, server_retrain=False)
    comp = ppcgpt.compress(tiny.model, tiny.tokenizer, SAMPLES, config)
    arrays = ppcgpt.adapter_arrays(comp.model)
    with pytest.raises(ValueError, match="removed layers"):
        ppcgpt.rebuild_model(tiny.model, [7], arrays, config.lora())
    with pytest.raises(ValueError, match="do not match"):  # a layer index the adapter lacks
        ppcgpt.rebuild_model(tiny.model, [], arrays, config.lora())
    key = next(iter(arrays))
    bad = {**arrays, key: arrays[key][:, :1]}
    with pytest.raises(ValueError, match="shape"):
        ppcgpt.rebuild_model(tiny.model, list(comp.plan.removed), bad, config.lora())
    bad = {**arrays, key: np.full_like(arrays[key], np.nan)}
    with pytest.raises(ValueError, match="non-finite"):
        ppcgpt.rebuild_model(tiny.model, list(comp.plan.removed), bad, config.lora())


# -- the Flower apps in process: bad clients ----------------------------------------------------
class Federation(InProcessFederation):
    app = "clients.app"


@pytest.fixture
def tiny_glove(monkeypatch):
    """The clients' sanitizer over a tiny table (the real GloVe one is used under Ray)."""
    monkeypatch.setattr(ppcgpt, "sanitizer_for", lambda *a: tiny_sanitizer())


def _reply(node: int, content: RecordDict, action: str) -> Message:
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node,
                                             message_type=action))


def test_bad_client_text_is_left_out(tiny_dir, tiny_glove, caplog):
    config = config_for(tiny_dir, min_clients=2)
    strategy = PPCGPT(config)
    grid = Federation(3)
    real = grid.send_and_receive
    grid.send_and_receive = lambda messages, timeout=None: [
        _reply(r.metadata.src_node_id, RecordDict({"text": ConfigRecord(
            {"examples": "[garbage"})}), "query.perturb") if i == 1 else r
        for i, r in enumerate(real(messages))]
    examples = strategy.collect_text(grid, timeout=60)
    assert len(examples) == 2 * 4 and len({e["id"] for e in examples}) == 8
    rejected = strategy.outcome.rejected
    assert rejected[0]["node"] == 101 and "not JSON" in rejected[0]["reason"]
    assert "left out" in caplog.text
    strategy = PPCGPT(config_for(tiny_dir))  # min_clients 0: all three needed
    with pytest.raises(NotEnoughClientsError, match="2 valid client replies"):
        strategy.collect_text(grid, timeout=60)


def test_round_two_in_process_and_bad_metrics(tiny_dir, tiny, tiny_glove):
    config = config_for(tiny_dir, min_clients=2)
    comp = ppcgpt.compress(tiny.model, tiny.tokenizer, SAMPLES, config)
    strategy = PPCGPT(config)
    strategy.set_model(list(comp.plan.removed), ppcgpt.adapter_arrays(comp.model))
    grid = Federation(3)
    replies = grid.send_and_receive(strategy.configure_train(1, ArrayRecord(), ConfigRecord(),
                                                             grid))
    good = dict(replies[0].content["metrics"])
    assert 0 <= good["server_acc"] <= 1 and good["client_n"] == 4 and good["steps"] == 1
    replies[2] = _reply(102, RecordDict({"metrics": MetricRecord({**good, "client_acc": 7.0})}),
                        "train.retrain")
    strategy.aggregate_train(1, replies)
    assert len(strategy.outcome.client_metrics) == 2
    assert "outside [0, 1]" in strategy.outcome.rejected[0]["reason"]


# -- a real Flower simulation (Ray) --------------------------------------------------------------
@pytest.mark.simulation
def test_flower_simulation_end_to_end(tiny_dir, tmp_path, openai_stub):
    import psutil

    from server.simulation import _ray_pids, simulate_method

    before = _ray_pids()
    out = tmp_path / "ppcgpt"
    with openai_stub(yes_no_generator) as stub:
        settings = dict(config_for(tiny_dir, clients=2).to_dict(), synth_url=stub.url,
                        synth_model="stub", out=str(out), device="cpu",
                        baselines="dense,dense-sft,plain-c", save_dtype="bfloat16")
        simulate_method("ppcgpt", settings)
    orphans = [p for p in _ray_pids() - before if psutil.pid_exists(p)
               and psutil.Process(p).ppid() == 1 and psutil.Process(p).status() != "zombie"]
    assert orphans == [], "the simulation left Ray processes behind"
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    assert [r["name"] for r in report["results"]] == ["ppcgpt", "dense", "dense-sft", "plain-c"]
    fed = report["results"][0]
    assert fed["layers"] == 2 and fed["n_client"] == 8 and 0 <= fed["acc_client"] <= 1
    assert len(fed["per_client"]) == 2 and fed["bytes_up_per_client"] > 0
    synth = report["synthetic"]
    assert synth["attempts"] == 8 and synth["accepted"] == 8  # ratio 1: 2 clients x 4 examples
    assert report["privacy"]["eps_per_word"] == 3.0
    assert report["results"][3]["layers"] == 2 and report["results"][1]["layers"] == 3
    saved = load_model(str(out / "model"), device="cpu").model
    assert num_layers(saved) == 2
    size = report["model_size"]  # 2 of 3 layers, in bfloat16 (asked) from a float32 input
    assert (size["dtype"], size["dense_dtype"]) == ("bfloat16", "float32")
    assert 0.5 * 2 / 3 < size["ratio"] < 0.5  # the embeddings are in every layer count
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "synthetic").is_dir()
