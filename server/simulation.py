"""Run fedcompress ServerApps + ClientApps on Flower's Simulation Engine (Ray), in-process."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def simulate(server_app, client_app, num_supernodes: int, num_cpus_per_client: float = 1.0,
             verbose: bool = False) -> None:
    """Run a ServerApp and ``num_supernodes`` virtual ClientApps on Ray; Ray helper processes
    this run leaves behind are stopped."""
    from flwr.simulation import run_simulation

    # Ray workers must not try to reach a hub either, and must find the same model cache.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    backend_config = {
        "client_resources": {"num_cpus": num_cpus_per_client, "num_gpus": 0.0},
        "init_args": {"logging_level": logging.WARNING, "log_to_driver": True,
                      "include_dashboard": False},
    }
    before = _ray_pids()
    try:
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=num_supernodes, backend_config=backend_config,
                       verbose_logging=verbose)
    finally:
        reap_ray_orphans(before)


def simulate_method(name: str, settings: dict, num_cpus_per_client: float = 1.0,
                    verbose: bool = False) -> None:
    """Run method ``name`` of the registry with flat ``settings`` on the Simulation Engine:
    its ServerApp with these settings and the one ClientApp (``clients/app.py``), one virtual
    node per client. Every setting is checked before Ray starts."""
    import importlib

    from clients.app import app as client_app
    from fedcompress.methods import get_method

    method = get_method(name)
    server = importlib.import_module(method.server_module)
    server.check_settings(settings)  # fail on bad settings before Ray starts
    clients = method.parse(settings)[0].clients
    simulate(server.make_app(settings), client_app, clients, num_cpus_per_client, verbose)


def _ray_pids() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        text = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        if text.startswith("ray::") or "/ray/" in text:
            pids.add(proc.info["pid"])
    return pids


def reap_ray_orphans(before: set[int], grace: float = 3.0) -> list[int]:
    """Kill Ray helper processes that this run started and that outlived it as orphans
    (``ray.shutdown`` can leave a dashboard/runtime-env agent behind). Processes of another
    live Ray instance keep their parent and are not touched."""
    import time

    import psutil

    time.sleep(grace)
    killed = []
    for pid in _ray_pids() - before:
        try:
            proc = psutil.Process(pid)
            if proc.ppid() == 1:
                proc.kill()
                killed.append(pid)
        except psutil.NoSuchProcess:
            continue
    if killed:
        logger.info("stopped %d leftover Ray process(es): %s", len(killed), killed)
    return killed
