"""A site's start-up per message (clients/startup.py): lazy imports on the ClientApp path, the
model memory-mapped from the site's safetensors cache, the tokenized calibration corpus kept in
the site's cache, and the import / load / compute split in every reply and in the server's
report. (The deployed sites' split, with Flower's runtime, is checked in tests/test_deploy.py.)"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import InProcessFederation

from fedcompress.data.calibration import tokenize_corpus, tokenizer_fingerprint
from fedcompress.data.corpora import Document

REPO = Path(__file__).resolve().parents[1]
#: Never needed by a FedPrLLM site's messages: none may be imported on its path.
NOT_ON_THE_SITE_PATH = ("lm_eval", "datasets", "peft", "opacus", "matplotlib",
                        "fedcompress.masks._kernels")

# One site in a fresh process, as a SuperNode's flwr-clientapp runs it: the ClientApp module,
# then a warm-up query and the masks through `app` (what Flower calls), then what got imported.
SITE = r"""
import hashlib, json, sys
from clients.app import app
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedcompress.methods.fedprllm.config import FedPrLLMConfig
from strategies.common import settings_record

after_app = sorted(sys.modules)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
config = FedPrLLMConfig(model=sys.argv[1], clients=2, samples_per_client=2, seqlen=16,
                        batch_size=2)
context = Context(run_id=1, node_id=100, node_config={"partition-id": 0, "num-partitions": 2,
                  "site-mode": "simulation"}, state=RecordDict(), run_config={}, series_id=0)
replies = []
for kind in ("query.warmup", "train.masks"):
    reply = app(Message(RecordDict({"config": settings_record(config)}), 100, kind), context)
    replies.append(dict(reply.content["metrics"]))
    if "masks" in reply.content:
        replies[-1]["masks_sha256"] = hashlib.sha256(b"".join(
            a.numpy().tobytes() for _, a in sorted(reply.content["masks"].items()))).hexdigest()
print(json.dumps({"replies": replies, "after_app": after_app, "after": sorted(sys.modules)}))
"""


def _site_process(model_dir: str, cache: Path) -> dict:
    env = {**os.environ, "FEDCOMPRESS_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", SITE, model_dir], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def site(tiny_dir, tmp_path_factory):
    """Two fresh site processes one after the other on one site cache: the first tokenizes the
    site's corpus, the second finds it."""
    cache = tmp_path_factory.mktemp("site-cache")
    first = _site_process(tiny_dir, cache)
    streams = sorted((cache / "tokens").glob("*.npy"))
    mtimes = [p.stat().st_mtime_ns for p in streams]
    second = _site_process(tiny_dir, cache)
    return {"first": first, "second": second, "streams": streams, "mtimes": mtimes}


def test_clientapp_path_imports_nothing_a_site_does_not_need(site):
    """The ClientApp module imports neither transformers (a SecAgg stage needs no model) nor
    numba; a site's FedPrLLM messages import none of the evaluation, data-hub, fine-tuning or
    plotting libraries nor the server's vote kernels (numba comes with the site's own compiled
    selection, fedcompress.solver.radix, at its first mask)."""
    for run in (site["first"], site["second"]):
        after_app, after = set(run["after_app"]), set(run["after"])
        assert "transformers" not in after_app and "numba" not in after_app
        assert "transformers" in after  # the model's messages load it
        assert "fedcompress.solver.radix" in after
        assert not after & set(NOT_ON_THE_SITE_PATH), sorted(after & set(NOT_ON_THE_SITE_PATH))


def test_every_reply_carries_its_startup_split(site):
    """The first reply of a process carries its imports and loading, the next one only what it
    added (nothing: model and windows are cached in the process), each its compute; no Flower
    runtime share outside a flwr-clientapp process."""
    for run in (site["first"], site["second"]):
        warmup, masks = run["replies"]
        for reply in (warmup, masks):
            assert reply["client_startup_seconds"] == pytest.approx(
                reply["startup_import_seconds"] + reply["startup_load_seconds"], abs=1e-9)
            assert reply["compute_seconds"] >= 0 and "startup_runtime_seconds" not in reply
        assert warmup["startup_import_seconds"] > 0.1  # torch, transformers, the model's code
        assert warmup["startup_load_seconds"] > 0  # the model and the windows
        assert warmup["startup_load_seconds"] <= warmup["seconds"] + 1e-6  # its _setup
        assert masks["startup_load_seconds"] == 0.0
        # the handler module, imported already: a dictionary lookup (relative to the first
        # import, so that a loaded machine's preemptions cannot fail it)
        assert masks["startup_import_seconds"] < 0.5 * warmup["startup_import_seconds"]
        assert masks["compute_seconds"] >= masks["seconds"] - 1e-6 > 0


def test_site_keeps_its_tokenized_corpus_private_and_reuses_it(site):
    """The first process writes the site's token stream (readable by its user only), the second
    reads it (unchanged) and cuts the same windows: the same masks, bit for bit."""
    assert len(site["streams"]) == 1
    path = site["streams"][0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.stat().st_mtime_ns for p in site["streams"]] == site["mtimes"]
    ids = np.load(path)
    assert ids.dtype == np.int64 and ids.ndim == 1 and ids.size > 16
    first, second = (run["replies"][1] for run in (site["first"], site["second"]))
    assert first["masks_sha256"] == second["masks_sha256"]


# -- the token cache -----------------------------------------------------------------------------
DOCS = [Document(f"d{i}", None, "the king and the queen of the river city were at war " * 20,
                 "t") for i in range(3)]


def _forget_streams(monkeypatch) -> None:
    """This process's streams in memory, emptied for one test (as in a new process)."""
    from collections import OrderedDict

    from fedcompress.data import calibration

    monkeypatch.setattr(calibration, "_streams", OrderedDict())


def _no_tokenizing(*args, **kwargs):
    raise AssertionError("tokenized again")


def test_token_cache_gives_the_same_ids_and_is_read_back(tiny_tokenizer, tmp_path, monkeypatch):
    _forget_streams(monkeypatch)
    plain = tokenize_corpus(tiny_tokenizer, DOCS)
    cached = tokenize_corpus(tiny_tokenizer, DOCS, tmp_path)  # from memory, saved there
    assert cached.dtype == plain.dtype == torch.long and torch.equal(cached, plain)
    assert len(list(tmp_path.glob("*.npy"))) == 1

    _forget_streams(monkeypatch)  # a new process: only the folder holds the stream
    monkeypatch.setattr(type(tiny_tokenizer), "__call__", _no_tokenizing)
    assert torch.equal(tokenize_corpus(tiny_tokenizer, DOCS, tmp_path), plain)


def test_a_process_tokenizes_a_corpus_once_and_hands_out_copies(tiny_tokenizer, monkeypatch):
    """The same text and tokenizer again: the stream kept in memory, not tokenized again; each
    caller's tensor is its own; beyond MEMORY_STREAMS others, the least recent is tokenized
    again."""
    from fedcompress.data import calibration

    _forget_streams(monkeypatch)
    first = tokenize_corpus(tiny_tokenizer, DOCS)
    with monkeypatch.context() as patched:
        patched.setattr(type(tiny_tokenizer), "__call__", _no_tokenizing)
        again = tokenize_corpus(tiny_tokenizer, DOCS)
        assert torch.equal(again, first)
        again.zero_()
        assert torch.equal(tokenize_corpus(tiny_tokenizer, DOCS), first)
    for i in range(calibration.MEMORY_STREAMS):
        tokenize_corpus(tiny_tokenizer, [Document("x", None, f"the river {i} " * 10, "t")])
    calls = []
    real = type(tiny_tokenizer).__call__
    monkeypatch.setattr(type(tiny_tokenizer), "__call__",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(tokenize_corpus(tiny_tokenizer, DOCS), first) and calls == [1]


def test_token_cache_never_serves_a_stale_stream(tiny_tokenizer, tmp_path, monkeypatch):
    """Other text or another tokenizer: another key; a damaged file: never read while the
    process holds the stream, tokenized again and rewritten by a process that does not."""
    from conftest import build_tiny_tokenizer

    tokenize_corpus(tiny_tokenizer, DOCS, tmp_path)
    edited = [*DOCS[:2], Document("d2", None, DOCS[2].text + " queen", "t")]
    assert torch.equal(tokenize_corpus(tiny_tokenizer, edited, tmp_path),
                       tokenize_corpus(tiny_tokenizer, edited))
    assert len(list(tmp_path.glob("*.npy"))) == 2

    same, other = build_tiny_tokenizer(), build_tiny_tokenizer()
    other.add_tokens(["kingdom"])
    assert tokenizer_fingerprint(same) == tokenizer_fingerprint(tiny_tokenizer)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_tokenizer)

    damaged = tmp_path / "damaged"
    tokenize_corpus(tiny_tokenizer, DOCS, damaged)
    (path,) = damaged.glob("*.npy")
    path.write_bytes(b"not a stream")
    assert torch.equal(tokenize_corpus(tiny_tokenizer, DOCS, damaged),
                       tokenize_corpus(tiny_tokenizer, DOCS))
    _forget_streams(monkeypatch)  # a new process
    assert torch.equal(tokenize_corpus(tiny_tokenizer, DOCS, damaged),
                       tokenize_corpus(tiny_tokenizer, DOCS))
    assert np.array_equal(np.load(path), tokenize_corpus(tiny_tokenizer, DOCS).numpy())


def test_tokenizer_without_a_backend_is_not_cached(tmp_path, monkeypatch):
    _forget_streams(monkeypatch)

    class Slow:
        def __call__(self, text, **kwargs):
            return {"input_ids": [1, 2, 3]}

    assert tokenizer_fingerprint(Slow()) is None
    assert tokenize_corpus(Slow(), DOCS, tmp_path).tolist() == [1, 2, 3]
    assert list(tmp_path.iterdir()) == []
    from fedcompress.data import calibration

    assert calibration._streams == {}  # nor kept in memory


# -- the model, memory-mapped -------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_site_model_is_memory_mapped_from_its_safetensors(tiny_dir):
    """Every weight of the site's model lies in a mapping of its safetensors file: no copy."""
    from clients.common import cached_model

    model, _ = cached_model(tiny_dir, "float32")
    files = {str(p.resolve()) for p in Path(tiny_dir).glob("*.safetensors")}
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in files:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            spans.append((start, end))
    params = list(model.parameters())
    mapped = [p for p in params if any(a <= p.data_ptr() < b for a, b in spans)]
    assert spans and len(mapped) == len(params)


# -- the server's report -------------------------------------------------------------------------
class Federation(InProcessFederation):
    app = "clients.app"


def test_server_report_has_each_sites_split(tiny_dir, tmp_path, fedcompress_cache):
    from server.fedprllm import run

    out = tmp_path / "run"
    run(Federation(3), dict(model=tiny_dir, clients=3, samples_per_client=2, seqlen=16,
                            batch_size=2, eval_seqlen=16, eval_windows=2, out=str(out),
                            device="cpu", baselines="", save_model=False))
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok", report.get("error")
    split = report["client_startup"]
    nodes = sorted({c["node"] for c in report["clients"]})
    assert len(nodes) == 3
    for stage in ("warmup", "masks"):
        records = [r for r in split if r["stage"] == stage]
        assert sorted(r["node"] for r in records) == nodes
        for r in records:
            assert {"startup_import_seconds", "startup_load_seconds", "compute_seconds",
                    "client_startup_seconds"} <= set(r)
            assert r["client_startup_seconds"] == pytest.approx(
                r["startup_import_seconds"] + r["startup_load_seconds"], abs=1e-9)
    warmups = [r for r in split if r["stage"] == "warmup"]
    assert report["client_startup_seconds"] == [r["client_startup_seconds"] for r in warmups]
    for client in report["clients"]:  # the round's own records carry it too
        assert "compute_seconds" in client and "startup_load_seconds" in client
    assert "## Site start-up per message" in (out / "report.md").read_text()
