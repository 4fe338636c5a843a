"""The private Ray instance of a simulation is started before Flower's engine, and started
again when Ray's local node does not register within Ray's fixed 30 s (a loaded machine):
``server.simulation.start_private_ray``."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from server.simulation import RAY_NODE_STARTUP_TIMEOUT, start_private_ray

psutil = pytest.importorskip("psutil")
ray = pytest.importorskip("ray")

TIMEOUT = Exception(f"{RAY_NODE_STARTUP_TIMEOUT}. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


class FakeInit:
    """``ray.init`` failing with ``failures`` (in order), then succeeding; records its calls."""

    def __init__(self, *failures: BaseException):
        self.failures = list(failures)
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.failures:
            raise self.failures.pop(0)


@pytest.fixture
def fake_init(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored at the end

    def install(*failures):
        init = FakeInit(*failures)
        monkeypatch.setattr(ray, "init", init)
        return init

    return install


def _chained_timeout() -> BaseException:
    """The timeout as Flower would see it: raised from Ray's node, re-raised by a caller."""
    try:
        try:
            raise TIMEOUT
        except Exception as err:
            raise RuntimeError("ray.init failed") from err
    except RuntimeError as outer:
        return outer


def test_a_node_timeout_is_retried_once_and_logged(fake_init, caplog):
    init = fake_init(_chained_timeout())
    with caplog.at_level(logging.WARNING, "server.simulation"):
        start_private_ray({"address": "local", "include_dashboard": False})
    assert len(init.calls) == 2
    assert init.calls[0] == init.calls[1]
    assert init.calls[1]["address"] == "local"
    assert init.calls[1]["runtime_env"]["env_vars"]["PYTHONPATH"] == os.environ["PYTHONPATH"]
    assert "timed out during startup (start 1 of 2" in caplog.text


def test_any_other_failure_is_raised_at_once(fake_init):
    init = fake_init(ValueError("bad init argument"))
    with pytest.raises(ValueError, match="bad init argument"):
        start_private_ray({"address": "local"})
    assert len(init.calls) == 1


def test_a_timeout_at_every_start_is_a_clear_error(fake_init):
    init = fake_init(TIMEOUT, TIMEOUT, TIMEOUT)
    with pytest.raises(RuntimeError, match=r"timed out 2 time\(s\).*is the machine loaded") \
            as info:
        start_private_ray({"address": "local"})
    assert len(init.calls) == 2
    assert info.value.__cause__ is TIMEOUT


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True, "2"])
def test_attempts_must_be_a_positive_integer(attempts):
    with pytest.raises(ValueError, match=f"attempts={attempts!r}: expected an integer >= 1"):
        start_private_ray({"address": "local"}, attempts)


def test_workers_get_the_drivers_path_once(fake_init, monkeypatch):
    """As Flower's RayBackend does: the driver's sys.path, then the PYTHONPATH it had."""
    monkeypatch.setenv("PYTHONPATH", "/opt/site-code")
    init = fake_init()
    start_private_ray({"address": "local"})
    expected = os.pathsep.join([*sys.path, "/opt/site-code"])
    assert init.calls[0]["runtime_env"] == {"env_vars": {"PYTHONPATH": expected}}
    assert os.environ["PYTHONPATH"] == expected


@pytest.mark.simulation
def test_a_simulation_whose_first_ray_start_times_out_runs_and_leaves_nothing(
        tmp_path, tmp_path_factory, monkeypatch):
    """A real run whose first Ray start does start Ray's processes and then times out (the
    failure a loaded machine gives): they are stopped, Ray starts again, the run completes,
    and no Ray process outlives it."""
    from conftest import save_tiny_llama

    from server.simulation import _ray_pids, simulate_method

    real_init = ray.init
    calls = []

    def init_that_times_out_once(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            real_init(**kwargs)  # Ray's GCS, raylet and workers are up ...
            raise TIMEOUT  # ... and the node is reported as not registered
        return real_init(**kwargs)

    monkeypatch.setattr(ray, "init", init_that_times_out_once)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    before = _ray_pids()
    model = save_tiny_llama(tmp_path_factory, n_layers=2)
    out = tmp_path / "run"
    simulate_method("fedprllm", dict(model=model, clients=2, samples_per_client=2, seqlen=16,
                                     batch_size=2, eval_seqlen=16, eval_windows=2, out=str(out),
                                     device="cpu", baselines="none"))
    assert len(calls) == 2
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok"
    # this run's: this process's descendants, or orphans (another xdist worker's Ray
    # processes are its own children)
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    left = [p for p in _ray_pids() - before if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            and (p in ours or psutil.Process(p).ppid() == 1)]
    assert left == [], [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]
    assert not ray.is_initialized()


class _Actor:
    """An actor handle whose ``terminate`` task must not be submitted."""

    class _Task:
        def remote(self):
            raise AssertionError("the terminate task was submitted")

    terminate = _Task()


def test_a_runs_actors_are_killed_without_a_task_and_the_pool_is_restored(monkeypatch):
    """Flower's end of a run submits each actor's terminate task, whose retry can reach a
    stopping raylet and end the driver process: within the block the actors are killed with
    ``ray.kill`` (no restart, no task) instead; after it, Flower's own method is back."""
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    from server.simulation import actors_killed_at_the_end

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append((actor,
                                                                              no_restart)))
    pool = type("Pool", (), {})()
    pool.pool = [_Actor(), _Actor()]
    original = BasicActorPool.terminate_all_actors
    with actors_killed_at_the_end():
        BasicActorPool.terminate_all_actors(pool)
    assert killed == [(pool.pool[0], True), (pool.pool[1], True)]
    assert BasicActorPool.terminate_all_actors is original
    with pytest.raises(AssertionError, match="terminate task was submitted"):
        BasicActorPool.terminate_all_actors(pool)
