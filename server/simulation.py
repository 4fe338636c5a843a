"""Run a FedPrLLM ServerApp + ClientApps on Flower's Simulation Engine (Ray), in-process."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def simulate_fedprllm(settings: dict, num_cpus_per_client: float = 1.0,
                      verbose: bool = False) -> None:
    """``settings``: flat FedPrLLM settings (see ``server.fedprllm.split_settings``)."""
    from flwr.simulation import run_simulation

    from clients.fedprllm import app as client_app
    from server.fedprllm import check_settings, make_app, split_settings

    check_settings(settings)  # fail on bad settings before Ray starts
    config, _, _ = split_settings(settings)
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
    run_simulation(server_app=make_app(settings), client_app=client_app,
                   num_supernodes=config.clients, backend_config=backend_config,
                   verbose_logging=verbose)
