"""`flwr run .` end to end: Flower's own runtime (a local SuperLink in simulation mode, started by
`flwr run`) builds the FAB from pyproject.toml, runs the one ServerApp and ClientApp of the FAB
with the method the run config names on a tiny local model, and the run writes report.json.
Every process the run started (SuperLink, SuperExec, flwr-simulation, Ray) is stopped by PID
afterwards.

Where each runtime is tested per method (one test per pair, no two doing the same work): FedPrLLM
under `flwr run` here (with SecAgg+, whose path holds the plain vote's), the peer FedSpaLLM against
an aggregation computed by hand (a run-config key of another method is refused by the deployed
runtime, in ``tests/test_deploy.py``); the plain vote under the Simulation Engine in
``tests/test_fedprllm.py``; PPC-GPT, PrunePrivyTune and personalized pruning under the Simulation
Engine in their own test files (``simulate_method``, the runtime `flwr run` starts too, with the
same ClientApp and ServerApp objects); every method deployed from the same FAB with `flwr run` in
``tests/test_deploy.py``, each compared with the in-process pipeline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
CLIENTS = 3


def _started_by(flwr_home: Path, before: set[int]) -> list:
    """Processes of the local SuperLink that `flwr run` started for this FLWR_HOME: the SuperLink
    (found by its log file under FLWR_HOME), its descendants, and every process left in their
    sessions (SuperLink and SuperExec each start a new session; Ray's processes live in the
    SuperExec's, and Ray actors can be orphaned to PID 1 there). Only PIDs new since ``before``."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []  # None when unreadable (e.g. a zombie)
        if proc.info["pid"] not in before and any(str(flwr_home) in part for part in cmd) \
                and any(part.endswith("flower-superlink") for part in cmd):
            roots.append(proc)
    found = {}
    for root in roots:
        try:
            found[root.pid] = root
            found.update({child.pid: child for child in root.children(recursive=True)})
        except psutil.Error:
            continue
    sessions = set()
    for pid in list(found):
        try:
            sessions.add(os.getsid(pid))
        except ProcessLookupError:
            continue
    for proc in psutil.process_iter(["pid"]):
        pid = proc.info["pid"]
        if pid in before or pid in found:
            continue
        try:
            if os.getsid(pid) in sessions:
                found[pid] = proc
        except ProcessLookupError:
            continue
    return list(found.values())


def _alive(procs: list) -> list:
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _stop(flwr_home: Path, before: set[int], grace: float = 15.0) -> list:
    """SIGTERM the SuperLink (its SuperExec follows), then SIGKILL whatever of ours is left."""
    import psutil

    procs = _started_by(flwr_home, before)
    for proc in procs:
        try:
            if any(part.endswith("flower-superlink") for part in proc.cmdline()):
                proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
    deadline = time.monotonic() + grace
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    # Processes started meanwhile (e.g. a Ray helper) are found again by session.
    procs = list({p.pid: p for p in procs + _started_by(flwr_home, before)}.values())
    for proc in _alive(procs):
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(_alive(procs), timeout=10)
    return _alive(procs + _started_by(flwr_home, before))


@pytest.fixture
def tiny_model_dir(tmp_path):
    """The tiny llama of the other FedPrLLM tests, saved with its tokenizer."""
    from conftest import build_tiny_model, build_tiny_tokenizer

    path = tmp_path / "tiny-llama"
    build_tiny_model("llama", n_layers=3).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def flwr_env(tmp_path):
    """A private FLWR_HOME with the `local` simulation connection, and private SuperLink ports
    (never a SuperLink someone else started). Yields the environment; stops the processes."""
    import psutil

    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    env = dict(os.environ)
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    })
    before = set(psutil.pids())
    try:
        yield env
    finally:
        left = _stop(home, before)
        assert left == [], f"processes left running: {[(p.pid, p.name()) for p in left]}"


def _only_run_status(flwr: str, env: dict, log: str) -> str:
    """The status of the one run the SuperLink knows (`flwr run --stream` exits 0 even when
    the run fails: ask the SuperLink)."""
    ls = subprocess.run([flwr, "ls", "--format", "json"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)
    runs = json.loads(ls.stdout)["runs"]
    assert len(runs) == 1, f"{runs}\n{log[-4000:]}"
    if not runs[0]["status"].startswith("finished:"):
        pytest.fail(f"run not finished: {runs}\n{log[-4000:]}")
    return runs[0]["status"]


def _run_completed(run_config: str, env: dict) -> str:
    """`flwr run .` of FedPrLLM's app with ``run_config`` on :data:`CLIENTS` simulated
    SuperNodes, checked to have completed; its log."""
    flwr = str(Path(sys.executable).parent / "flwr")
    proc = subprocess.run(
        [flwr, "run", ".", "--federation-config",
         f"num-supernodes={CLIENTS} client-resources-num-cpus=1",
         "--run-config", run_config, "--stream"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert _only_run_status(flwr, env, log) == "finished:completed"
    return log


@pytest.mark.simulation
def test_flwr_run_fedprllm_over_secagg(tiny_model_dir, flwr_env, tmp_path):
    """The quick start's `flwr run .` of FedPrLLM, with SecAgg+ (its four rounds: keys, shares,
    masked vectors, unmasking): the plain vote's path is a subset of it, run under the
    Simulation Engine in tests/test_fedprllm.py and deployed in tests/test_deploy.py."""
    out = tmp_path / "out"
    run_config = " ".join(f"fedprllm.{item}" for item in (
        f'model="{tiny_model_dir}"', f"clients={CLIENTS}", "samples-per-client=2", "seqlen=16",
        "batch-size=2", "eval-seqlen=16", "eval-windows=4", f'out="{out}"', 'device="cpu"',
        'baselines="dense"', "secagg=true"))
    _run_completed(run_config, flwr_env)

    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    assert [r["name"] for r in report["results"]] == ["dense", "fedprllm-oneshot-layer"]
    fed = report["results"][1]
    assert fed["valid_clients"] == CLIENTS and fed["rounds"] == 4
    assert abs(fed["sparsity"] - 0.5) < 1e-3
    assert (out / "model" / "config.json").exists()
    # 3 sites: digits of base 4 (32 weights per word) plus the keys and shares
    assert report["secagg"]["sum"]["bits_per_weight_up"] == 2
    assert fed["bits_per_weight_up"] > 2


def _hand_fedspallm(holders: list[tuple[np.ndarray, np.ndarray]], sparsity: float
                    ) -> np.ndarray:
    """FedSpaLLM's aggregation of one weight matrix by hand, from the paper's words: each
    weight the mean of the values of the sites that kept it (0 if none did), then the mask
    expanded over the whole matrix: the weights the most sites pruned go first, among equal
    counts the smallest averaged magnitude, then the lowest index, until the target share is
    pruned. ``holders``: each site's (pruned mask, its weight matrix)."""
    shape = holders[0][0].shape
    total = np.zeros(shape)
    keepers = np.zeros(shape, dtype=np.int64)
    for pruned, weight in holders:
        total += np.where(pruned, 0.0, weight.astype(np.float64))
        keepers += ~pruned
    average = np.divide(total, keepers, out=np.zeros(shape), where=keepers > 0)
    average = average.astype(np.float32)
    pruners = (len(holders) - keepers).reshape(-1)
    order = np.lexsort((np.arange(pruners.size), np.abs(average).reshape(-1), -pruners))
    out = average.reshape(-1).copy()
    out[order[:int(sparsity * pruners.size)]] = 0.0
    return out.reshape(shape)


@pytest.mark.simulation
def test_flwr_run_fedspallm_equals_a_hand_computed_aggregation(tiny_model_dir, flwr_env,
                                                                tmp_path):
    """FedSpaLLM under `flwr run`: each site's SparseGPT release over the layers the server
    dealt it, recomputed here from its own windows, aggregated by hand
    (:func:`_hand_fedspallm`), is the saved model's every linear weight."""
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
    from fedcompress.models import ModelAdapter, load_model, weight_matrix
    from fedcompress.pruning.local import PruneConfig, local_masks

    out = tmp_path / "out"
    settings = dict(clients=CLIENTS, samples_per_client=2, seqlen=16, batch_size=2,
                    method="sparsegpt", aggregate="fedspallm", fedspallm_layers=2)
    run_config = " ".join(f"fedprllm.{item}" for item in (
        f'model="{tiny_model_dir}"', f"clients={CLIENTS}", "samples-per-client=2", "seqlen=16",
        "batch-size=2", "eval-seqlen=16", "eval-windows=4", f'out="{out}"', 'device="cpu"',
        'baselines="dense"', 'method="sparsegpt"', 'aggregate="fedspallm"',
        "fedspallm-layers=2", 'save-dtype="float32"'))
    _run_completed(run_config, flwr_env)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["rejected"] == []
    assert [r["name"] for r in report["results"]] == ["dense", "fedspallm-layer"]

    partition = {m["node"]: int(m["partition"]) for m in report["clients"]}
    layers_of = {int(n): v for n, v in report["fedspallm_layers"].items()}
    assert sorted(layers_of) == sorted(partition) and len(partition) == CLIENTS
    assert sorted({i for v in layers_of.values() for i in v}) == [0, 1, 2]
    held = [sum(i in v for v in layers_of.values()) for i in range(3)]
    assert max(held) >= 2  # some layer is averaged over several sites
    loaded = load_model(str(tiny_model_dir), device="cpu")
    config = FedPrLLMConfig(model=str(tiny_model_dir), **settings)
    windows = federation_windows(loaded.tokenizer, config)[0]
    sites = {}
    for node in sorted(partition):  # each site's own SparseGPT pass, its other layers dense
        ratios = ",".join("0.5" if i in layers_of[node] else "0" for i in range(3))
        result = local_masks(loaded.model, windows[partition[node]],
                             PruneConfig("sparsegpt", 0.5, "row", layer_sparsity=ratios),
                             batch_size=2, keep_weights=True)
        sites[node] = result
    saved = load_model(str(out / "model"), device="cpu").model
    for i, layer in enumerate(ModelAdapter(saved).layers):
        for name, module in ModelAdapter.linear_layers(layer).items():
            holders = [(sites[n].masks[i][name].numpy(), sites[n].weights[i][name].numpy())
                       for n in sorted(sites) if i in layers_of[n]]
            want = _hand_fedspallm(holders, 0.5)
            got = weight_matrix(module).detach().numpy()
            assert np.array_equal(got == 0, want == 0), (i, name)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{i} {name}")
