"""Shared fixtures: tiny random models built from configs, a tiny tokenizer, offline hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

# Nothing in the test suite may reach a model or dataset hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# `make test` runs the suite in two pytest-xdist workers (one per core of the 2-core reference
# machine): each worker's torch computes on one thread, so the two do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

#: The test files that take longest (measured: pytest's junit times), longest first. Under
#: xdist (`make test`: `--dist loadfile --no-loadscope-reorder`, a file runs whole in one worker,
#: files handed out in collection order) they are collected first, so that neither worker ends
#: with a long file to run alone while the other is idle.
SLOW_FILES_FIRST = (  # seconds of a file's tests, `make test` of 2026-12-06 (--durations)
    "tests/test_deploy.py",                    # 449 (one worker's share: started first)
    "tests/test_faults_simulation.py",         # 185
    "tests/test_bench_flower.py",              # 168 (four simulations, measured alone)
    "tests/test_flwr_run.py",                  # 132 without its refusal (now in test_deploy)
    "tests/test_fedprllm.py",                  # 85
    "tests/test_integration.py",               # 81
    "tests/test_personalized.py",              # 77
    "tests/test_privytune.py",                 # 70
    "tests/test_stats_mode.py",                # 37
    "tests/test_ppcgpt.py",                    # 34
    "tests/test_ray_cluster.py",               # 33
    "tests/test_bench.py",                     # 26
    "tests/test_simulation_start.py",          # 25
    "tests/test_reproducible.py",              # 24
    "tests/test_site_startup.py",              # 24
    "tests/test_eval_tasks.py",                # 23
    "tests/adversarial/test_ledger.py",        # 22
    "tests/adversarial/test_policy_attacks.py",  # 21
)



def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a server a test starts, chosen OUTSIDE the kernel's
    ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``). A port the kernel hands out
    for ``bind(0)`` is an ephemeral one, which any process's outgoing connection may take between
    this check and the server's own bind ("address already in use"); below the range only
    another listener can."""
    import random
    import socket

    try:
        low, _high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(500):
        port = pick.randrange(10000, max(10001, low))
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in 10000-{low - 1} after 500 tries")

def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable

TINY_VOCAB = 128


def tiny_config(model_type: str, n_layers: int = 4):
    """A tiny config of a supported architecture (random weights, seconds to build)."""
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=32, num_attention_heads=4,
                  num_hidden_layers=n_layers, max_position_embeddings=128)
    if model_type == "llama":
        return tf.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if model_type == "qwen2":
        return tf.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common)
    if model_type == "mistral":
        return tf.MistralConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if model_type == "gemma3_text":
        return tf.Gemma3TextConfig(intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                   sliding_window=16, **common)
    if model_type == "opt":
        return tf.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **common)
    if model_type == "gpt2":
        return tf.GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_head=4, n_layer=n_layers,
                             n_positions=128, bos_token_id=1, eos_token_id=2)
    if model_type == "bert":
        return tf.BertConfig(intermediate_size=64, **common)
    raise ValueError(model_type)


def build_tiny_model(model_type: str, n_layers: int = 4, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(model_type, n_layers)
    cls = tf.BertModel if model_type == "bert" else tf.AutoModelForCausalLM
    model = cls(config) if cls is tf.BertModel else cls.from_config(config)
    return model.eval()


@pytest.fixture
def tiny_model():
    """Factory: ``tiny_model("llama", n_layers=4)``."""
    return build_tiny_model


def build_tiny_tokenizer():
    """A word-level tokenizer over a small fixed vocabulary, with bos/eos/pad/unk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ("the a of and to in is was for on with as by at from that it his her they this "
             "king queen river city war year people first time new made who which were had "
             "but not be or an are have one their been has more after also two other into "
             "over only its when than most some would there out about can up may "
             "what so no if all my your our we you he she him them me us do did does said "
             ). split()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(words)) + list(".,;:!?'\"()-"))}
    assert len(vocab) <= TINY_VOCAB
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


@pytest.fixture
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def fedcompress_cache(tmp_path, monkeypatch):
    """An empty, private FEDCOMPRESS_CACHE."""
    monkeypatch.setenv("FEDCOMPRESS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from fedcompress.models import load_model

    return load_model("smollm2-135m", device="cpu")


def save_tiny_llama(tmp_path_factory, n_layers: int = 3) -> str:
    """A tiny ``n_layers`` llama saved with the tiny tokenizer (a model spec for load_model)."""
    path = tmp_path_factory.mktemp(f"tiny-llama-{n_layers}")
    build_tiny_model("llama", n_layers=n_layers).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny 3-layer llama with the tiny tokenizer (a model spec for load_model)."""
    return save_tiny_llama(tmp_path_factory)


class _OpenAIStub:
    """A local OpenAI-compatible chat server whose replies come from ``reply(prompt, i)``."""

    def __init__(self, reply):
        import http.server
        import threading

        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                import json

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with stub.lock:
                    stub.calls += 1
                    texts = [reply(prompt, stub.calls * 100 + i) for i in range(body.get("n", 1))]
                data = json.dumps({"choices": [
                    {"index": i, "message": {"role": "assistant", "content": t}}
                    for i, t in enumerate(texts)]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.lock = threading.Lock()
        self.calls = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def yes_no_generator(prompt: str, i: int) -> str:
    """Scripted LLM_syn for PPC-GPT's three prompts: a new Yes/No question (distinct per call),
    the answer A, a rationale."""
    if "CREATED QUESTION" in prompt:
        return (f"CREATED QUESTION AND CHOICES:\nQuestion: Is the king number {i} in the city?"
                "\nChoices: ['Yes', 'No']")
    if "FINAL ANSWER" in prompt:
        return "SOLUTION: the king is in the city.\nFINAL ANSWER: A"
    return "the king was in the city in that year. <end>"


@pytest.fixture
def openai_stub():
    """Factory: ``with openai_stub(reply) as stub: stub.url``."""
    return _OpenAIStub


class InProcessFederation:
    """A ClientApp's messages handled in-process (no Ray): a node per partition, each with its
    own Flower context state. Subclasses name the ClientApp module in ``app``."""

    app = ""

    #: the sites' own node config beyond their partition: by default simulated sites (this
    #: harness plays the Simulation Engine) whose ledgers live in this federation's temporary
    #: folder; a test of a deployed site sets ``{"site-mode": "deployment", ...}``
    site_config: dict = {"site-mode": "simulation"}

    def __init__(self, n: int):
        import tempfile

        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.state = tempfile.TemporaryDirectory(prefix="fedcompress-test-state-")
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i,
                                          node_config={"partition-id": i, "num-partitions": n,
                                                       "state-dir": f"{self.state.name}/site-{i}",
                                                       **self.site_config},
                                          state=RecordDict(), run_config={}, series_id=0)
                         for i in range(n)}

    def get_node_ids(self):
        return list(self.contexts)

    #: True: an exception in the ClientApp becomes an error reply, as Flower's runtimes do
    #: (default False: it propagates, so a test sees the traceback)
    errors_as_replies = False

    def send_and_receive(self, messages, timeout=None):
        import importlib

        from flwr.app import Error, Message

        module = importlib.import_module(self.app)
        replies = []
        for msg in messages:
            context = self.contexts[msg.metadata.dst_node_id]
            app = module.app
            if hasattr(module, "local_app") and "site-agent" not in context.node_config:
                # no agent named: this harness plays the site's agent, the operations
                # in process as an agent (and a simulated site) runs them (clients.app refuses a
                # deployed site without an agent)
                app = module.local_app()
            try:
                replies.append(app(msg, context))
            except Exception as err:
                if not self.errors_as_replies:
                    raise
                replies.append(Message(Error(code=2, reason=f"{type(err).__name__}: {err}"),
                                       reply_to=msg))
        return replies


def ppcgpt_tiny_settings(model_dir, synth_url: str, out, clients: int = 2) -> dict:
    """Small PPC-GPT settings on the tiny model (as tests/test_ppcgpt.py), sequential
    generation requests so the scripted generator answers in the same order every run."""
    return dict(model=str(model_dir), task="strategyqa", clients=clients, examples_per_client=4,
                eval_per_client=4, prune_ratio=0.34, server_steps=1, client_steps=1,
                batch_size=2, grad_accum=1, max_length=64, min_synthetic=1,
                synth_batch_size=4, synth_url=synth_url, synth_model="stub", synth_workers=1,
                out=str(out), device="cpu", baselines="dense", noise_seed=0)


def ppcgpt_in_process(settings: dict) -> dict:
    """The PPC-GPT ServerApp's pipeline with the one ClientApp's handlers called in this
    process (no Flower runtime): the reference a Flower run must equal."""
    import json
    from pathlib import Path

    from server.ppcgpt import run

    class Federation(InProcessFederation):
        app = "clients.app"

    run(Federation(settings["clients"]), settings)
    return json.loads((Path(settings["out"]) / "report.json").read_text())


def same_ppcgpt_result(report: dict, reference: dict) -> None:
    """Two PPC-GPT reports agree on everything a run decides: the synthetic data, the removed
    layers, every client's accuracy before and after retraining, the baselines."""
    assert report["status"] == reference["status"] == "ok"
    timing = ("wall_seconds", "stage_seconds")
    assert ({k: v for k, v in report["synthetic"].items() if k not in timing}
            == {k: v for k, v in reference["synthetic"].items() if k not in timing})
    assert report["compression"]["plan"] == reference["compression"]["plan"]
    keys = ("name", "layers", "removed", "acc_server", "acc_client", "n_server", "n_client")
    for got, want in zip(report["results"], reference["results"], strict=True):
        assert {k: got.get(k) for k in keys} == {k: want.get(k) for k in keys}
        for a, b in zip(got["per_client"], want["per_client"], strict=True):
            assert a["partition"] == b["partition"]
            assert (a.get("server"), a["client"]) == (b.get("server"), b["client"])


TINY_TASK_WORDS = ("the a of and to in is was for on with as by at from that it his her they this "
                   "river city war year people first time new made who which were had").split()


def build_tiny_task(root) -> str:
    """A JSONL classification task whose labels (king / queen) are words of the tiny vocabulary;
    texts of 24 words (long enough for the extraction attack's prefix). Returns the folder."""
    import json
    import random
    from pathlib import Path

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", 48), ("validation", 16), ("test", 16)):
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(n):
                label = i % 2
                words = [rng.choice(TINY_TASK_WORDS) for _ in range(23)]
                words.insert(rng.randrange(24), ("king", "queen")[label])
                f.write(json.dumps({"id": f"t-{split}-{i}", "question": " ".join(words),
                                    "choices": ["king", "queen"], "label": label}) + "\n")
    return str(root)


def privytune_tiny_settings(model_dir, task_dir, out, clients: int = 2, **extra) -> dict:
    """Small PrunePrivyTune settings on the tiny model and task (2 rounds, DP at epsilon 8, the
    DP noise seeded so that two runtimes can be compared)."""
    return {"model": str(model_dir), "task": str(task_dir), "clients": clients, "rounds": 2,
            "batch_size": 8, "lr": 1e-2, "similarity_texts": 8, "max_length": 32,
            "attack_samples": 2, "ratio": 0.34, "similarity_source": "sites", "out": str(out),
            "device": "cpu", "dp_noise_seed": 0, **extra}


def privytune_in_process(settings: dict) -> dict:
    """The PrunePrivyTune ServerApp's pipeline with the one ClientApp's handlers called in this
    process (no Flower runtime): the reference a Flower run must equal."""
    import json
    from pathlib import Path

    from server.privytune import run

    class Federation(InProcessFederation):
        app = "clients.app"

    run(Federation(settings["clients"]), settings)
    return json.loads((Path(settings["out"]) / "report.json").read_text())


def same_privytune_result(report: dict, reference: dict) -> None:
    """Two PrunePrivyTune reports agree on what a run decides: the removal plan, every site's
    epsilon after every round, the accuracy of each result (the audit's scores within float
    noise)."""
    assert report["status"] == reference["status"] == "ok"
    assert report["removal"]["plan"] == reference["removal"]["plan"]
    sites = sorted((m["round"], m["partition"], m.get("epsilon_spent"), m["num-examples"])
                   for m in report["sites"])
    assert sites == sorted((m["round"], m["partition"], m.get("epsilon_spent"),
                            m["num-examples"]) for m in reference["sites"])
    keys = ("name", "layers", "removed", "accuracy", "epsilon_spent_max")
    for got, want in zip(report["results"], reference["results"], strict=True):
        assert {k: got.get(k) for k in keys} == {k: want.get(k) for k in keys}
        if "auc" in want:
            assert got["auc"] == pytest.approx(want["auc"], abs=1e-6)


def write_site_keys(folder, n: int) -> tuple[list[Path], Path]:
    """``n`` sites' node-auth style P-384 keys (OpenSSH, mode 0600, as ``ssh-keygen`` writes
    them) and the folder ``folder/peers`` of their public keys: ``(private paths, peers)``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    peers = folder / "peers"
    peers.mkdir(parents=True)
    paths = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        private = folder / f"site-{i}"
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
        private.chmod(0o600)
        (peers / f"site-{i}.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
        paths.append(private)
    return paths, peers


def load_tool(name: str, folder: str = "tools"):
    """A maintainer script of ``tools/`` (or another ``folder`` of the repository, e.g.
    ``simulations``; not part of the package) imported as module ``name``."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def personalize_tiny_settings(model_dir, out, clients: int = 3, **extra) -> dict:
    """Small personalized-pruning settings on the tiny model (iid sites, 6 draws of 2 units)."""
    return {"model": str(model_dir), "clients": clients, "samples_per_client": 2, "seqlen": 16,
            "batch_size": 2, "k": 2, "max_iter": 6, "partition": "iid", "sparsity": 0.5,
            "out": str(out), "device": "cpu", **extra}


def personalize_in_process(settings: dict, node_configs: list[dict] | None = None) -> dict:
    """The personalized-pruning ServerApp's pipeline with the one ClientApp's handlers called in
    this process (no Flower runtime): the reference a Flower run must equal. ``node_configs``:
    each site's node config (a deployed site's ``data-path``)."""
    import json
    from pathlib import Path

    from server.personalize import run

    class Federation(InProcessFederation):
        app = "clients.app"

        def __init__(self, n: int):
            super().__init__(n)
            for context, node_config in zip(self.contexts.values(), node_configs or []):
                # the site's data, not its state folder: the reference keeps its own ledger
                context.node_config.update({k: v for k, v in node_config.items()
                                            if k != "state-dir"})

    run(Federation(settings["clients"]), settings)
    return json.loads((Path(settings["out"]) / "report.json").read_text())


def same_personalize_result(report: dict, reference: dict) -> None:
    """Two personalized-pruning reports agree on what a run decides: the class counts, the
    global plan, every site's perplexities."""
    assert report["status"] == reference["status"] == "ok"
    assert report["classes"]["counts"] == reference["classes"]["counts"]
    assert report["global_plan"] == reference["global_plan"]
    keys = ("site", "personalized", "fedprllm", "local-only", "dense")
    for got, want in zip(report["results"], reference["results"], strict=True):
        assert {k: got.get(k) for k in keys} == pytest.approx({k: want.get(k) for k in keys},
                                                              rel=1e-5)


# -- bench studies on the tiny model ------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file of random words (the bench studies' calibration and evaluation text)."""
    words = ("the king of the city was in the war and the queen had a river . "
             "people made it in the first year , but who were they ? ").split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words, 60)) for _ in range(40)))
    return str(path)


def write_bench_config(folder, config) -> str:
    """``config`` written as ``folder/bench.toml`` (a bench config); its path."""
    import tomli_w

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench.toml"
    path.write_text(tomli_w.dumps(config))
    return str(path)


#: A site agent's start-up: it imports torch and transformers (longer on a loaded machine).
AGENT_START_TIMEOUT = 240.0


class Agent:
    """A ``fedcompress site-agent --config FILE`` process of its own session, stopped by PID
    (the site agent's tests, the deployed SuperNodes of tests/test_deploy.py): the socket
    ``path`` is the config's ``socket``. ``wait=False``: return once started;
    :meth:`wait_ready` before sending it messages."""

    #: the command's arguments after ``fedcompress`` and the line of its log that says it serves
    command = ("site-agent", "--config", "{config}")
    ready = "site agent ready"

    def __init__(self, path: Path, cache: Path, log: Path, env: dict | None = None,
                 wait: bool = True, config: Path | None = None):
        self.path, self.log_path = path, log
        env = {**(env or os.environ), "FEDCOMPRESS_CACHE": str(cache)}
        args = [a.format(path=path, config=config) for a in self.command]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "fedcompress"), *args], stdout=out,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        while self.ready not in self.log():
            assert self.proc.poll() is None, f"agent exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def run_bench(config_path, out=None, overrides=None, device=None, progress=True,
              dry_run=False, site_threads=None):
    """``fedcompress bench``'s run (the command composes the same): the bench's FedPrLLM cells
    through the ServerApp's strategies on the in-process grid (``server/bench.py``)."""
    from fedcompress.bench.run import run_bench as plan_and_run
    from server.bench import InProcessFederation

    return plan_and_run(config_path, out, overrides, device, progress, dry_run,
                        federation=InProcessFederation(threads=site_threads))
