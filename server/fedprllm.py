"""FedPrLLM ServerApp: the whole pipeline of one run.

Broadcast the pruning config, collect and validate the clients' masks (one round, or one round
per layer), vote, prune the global model, evaluate it next to the dense model and the baselines,
save the pruned model with ``save_pretrained``, and write ``report.json``/``report.md``.

``app`` reads its settings from the Flower run config (``flwr run . --run-config ...``);
:func:`make_app` builds an app around settings given in Python (the ``fedcompress prune`` CLI).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

# Imported here, at module level, on purpose. `flwr run` (simulation runtime) imports this module
# in its ServerApp thread while its main thread imports the ClientApp module, which imports
# transformers. transformers replaces itself in sys.modules (a lazy module) at the end of its
# import, and a thread that meets it half-imported is handed the stale module object: a
# `from transformers import AutoConfig` there fails with ImportError (Flower exit code 607).
# An `import transformers` statement waits for the import to complete, so after this line every
# `from transformers import ...` in this thread (e.g. in fedcompress.models) sees the real module.
import transformers  # noqa: F401
from flwr.app import ArrayRecord
from flwr.serverapp import Grid, ServerApp

from fedcompress.pruning.experiment import EvalConfig, prepare_experiment
from fedcompress.pruning.federated import (
    FedPrLLMConfig, ServerConfig, expected_shapes, public_reference_wire)
from fedcompress.report import RunReport
from server.common import make_server_app
from strategies.fedprllm import make_strategy

logger = logging.getLogger(__name__)

EVAL_KEYS = ("eval_text", "eval_split", "eval_seqlen", "eval_windows")
SERVER_KEYS = ("out", "device", "baselines", "variants", "save_model", "timeout")
SERVER_DEFAULTS = {"out": "runs/prune", "device": "auto",
                   "baselines": "dense,centralized,local-only", "variants": "configured",
                   "save_model": True, "timeout": 3600.0}


def split_settings(settings: dict) -> tuple[FedPrLLMConfig, EvalConfig, dict]:
    """Flat settings (CLI or run config, keys with ``-`` or ``_``) -> the three configs."""
    flat = {k.replace("-", "_"): v for k, v in settings.items()}
    evals = {k: flat.pop(k) for k in EVAL_KEYS if k in flat}
    server = dict(SERVER_DEFAULTS)
    server.update({k: flat.pop(k) for k in SERVER_KEYS if k in flat})
    eval_config = EvalConfig(**{k: type(getattr(EvalConfig, k))(v) for k, v in evals.items()})
    return FedPrLLMConfig.from_dict(flat), eval_config, server


def check_settings(settings: dict) -> None:
    """Every setting valid, before any model is loaded or any engine started."""
    config, _, server = split_settings(settings)
    server_variants(config, server["variants"])
    unknown = set(str(server["baselines"]).split(",")) - {"", "dense", "centralized", "local-only"}
    if unknown:
        raise ValueError(f"unknown baseline(s) {sorted(unknown)}: expected some of dense, "
                         "centralized, local-only (or none)")


def server_variants(config: FedPrLLMConfig, which: str) -> list[ServerConfig]:
    """``configured``: the run's server variant; ``all``: every group x scaling (one-shot)."""
    if which == "configured" or config.mode == "iterative":
        return [config.server]
    if which != "all":
        raise ValueError(f"variants {which!r}: expected 'configured' or 'all'")
    return [ServerConfig(group, scale, config.tie_break, config.seed)
            for group in ("layer", "row", "column") for scale in (False, True)]


def run_fedprllm(grid: Grid, settings: dict) -> RunReport:
    config, eval_config, server = split_settings(settings)
    out = Path(server["out"])
    report = RunReport(out, "prune", {**config.to_dict(), **eval_config.to_dict(), **server},
                       seeds={"seed": config.seed})
    try:
        with report.phase("setup"):
            device = None if server["device"] in ("", "auto") else server["device"]
            exp = prepare_experiment(config, eval_config, device=device)
        report.extra["model"] = {"spec": exp.loaded.spec, **exp.loaded.info}
        baselines = [b for b in str(server["baselines"]).split(",") if b]
        if "dense" in baselines:
            with report.phase("eval"):
                report.add_result(exp.evaluate("dense", exp.model))

        with report.phase("wire_reference"):
            reference = public_reference_wire(exp.model, exp.tokenizer, config)
        strategy = make_strategy(config, exp.model, reference)
        with report.phase("engine_startup"):
            startup = strategy.warmup(grid, timeout=float(server["timeout"]))
        start = time.perf_counter()
        with report.phase("federated_pruning"):
            strategy.start(grid, ArrayRecord(), num_rounds=strategy.num_rounds,
                           timeout=float(server["timeout"]))
        fed_seconds = time.perf_counter() - start
        client_seconds = [m["seconds"] for m in strategy.client_metrics]
        # Measured bytes of the valid replies (all rounds), per client.
        senders = {m["node"] for m in strategy.client_metrics}
        up = sum(int(m.get("bytes_up", 0)) for m in strategy.client_metrics) // max(
            len(senders), 1)
        comm = {"rounds": strategy.num_rounds, "clients": config.clients, "wire": config.wire,
                "bits_per_weight_up": 8 * up / max(sum(
                    math.prod(shape) for shape in expected_shapes(exp.model).values()), 1),
                "valid_clients": config.clients - len({r["node"] for r in strategy.rejected}),
                "bytes_up_per_client": up,
                "bytes_down_per_client": strategy.bytes_down // max(config.clients, 1),
                "federated_seconds": fed_seconds, "startup_seconds": startup,
                "client_seconds_mean": sum(client_seconds) / max(len(client_seconds), 1)}
        report.extra["rejected"] = strategy.rejected
        report.extra["client_startup_seconds"] = strategy.warmup_seconds
        report.extra["clients"] = strategy.client_metrics

        for variant in server_variants(config, server["variants"]):
            model = exp.fresh_copy()
            with report.phase("aggregate"):
                strategy.prune(model, variant)
            with report.phase("eval"):
                report.add_result(exp.evaluate(
                    f"fedprllm-{config.mode}-{variant.label}", model, **comm,
                    server_group=variant.group, scale=variant.scale))
            if server["save_model"] and variant == config.server:
                with report.phase("save"):
                    model.save_pretrained(out / "model")
                    exp.tokenizer.save_pretrained(out / "model")
            del model

        if "centralized" in baselines:
            with report.phase("centralized"):
                model, seconds = exp.centralized()
            with report.phase("eval"):
                report.add_result(exp.evaluate("centralized", model, prune_seconds=seconds))
        if "local-only" in baselines:
            with report.phase("local_only"):
                model, seconds = exp.local_only(0)
            with report.phase("eval"):
                report.add_result(exp.evaluate("local-only", model, prune_seconds=seconds,
                                               client=0))
    except BaseException:
        report.finish("failed")
        raise
    report.finish("ok")
    return report


def make_app(settings: dict | None = None) -> ServerApp:
    return make_server_app(run_fedprllm, settings)


app = make_app()
