"""Federated personalized pruning's ClientApp handlers (a site): its unit classes, its masks at
the server's plan, and its own personalized model.

The one ClientApp of the FAB (``clients/app.py``) calls these for the message types the method
declares (``fedcompress.methods.personalize.METHOD.actions``):

* ``query.classify``: Alg. 1 on this site's calibration windows; only the class of each unit
  leaves (``classes``: one uint8 code per unit, in model order); the site keeps them in its
  Flower context state for the last round.
* ``train.plan_masks``: the global plan (``plan``); the site's local Wanda masks at it
  (bit-packed, ``masks``) and, only when a baseline needs them, at the uniform ratio: sent for
  the uniform FedPrLLM vote (``uniform``), kept in the context state as the local-only model.
* ``query.personalize``: this site's plan and the global masks of every layer outside its
  personalized units (``shared``), and the uniform vote's masks (``uniform``); the site prunes
  its personalized layers with local masks in one walker pass, scores every model on its
  held-out windows, and sends back only the scores. Its personalized masks never leave. With
  the guard (``guard = "heldout"``, the default) the site keeps the better of its
  personalized model and uniform FedPrLLM by those held-out scores and says which
  (``kept_fedprllm``, ``kept``: the kept model's perplexity, chosen on the same windows, so an
  optimistic figure; the two models' own scores are sent too).

The dense model is loaded once per process (cached) and never mutated.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from clients.common import cached_model, site_partition, with_data_path
from fedcompress.layers.personalized import CLASSES, classify_units, units_of
from fedcompress.methods import personalize as pz
from fedcompress.methods.fedprllm.federated import decode_masks, encode_masks, expected_shapes
from fedcompress.pruning.allocation import SparsityPlan
from fedcompress.pruning.local import (
    apply_masks,
    layer_sizes,
    local_masks,
    sparsity_report,
)

logger = logging.getLogger(__name__)

STATE = "personalize"
LOCAL = "personalize-local"  # this site's own masks at the uniform ratio (local-only)


@functools.lru_cache(maxsize=4)
def _windows(config: pz.PersonalizeConfig, data_path: str | None):
    _, tokenizer = cached_model(config.model, config.dtype)
    return pz.site_windows(config, tokenizer, data_path)


def _setup(message: Message, context: Context):
    config = pz.PersonalizeConfig.from_dict(dict(message.content["config"]))
    partition = site_partition(context, config.clients)
    model, _ = cached_model(config.model, config.dtype)
    calib, held = with_data_path(context, lambda path: _windows(config, path))
    return config, partition, model, calib[partition], held[partition]


def classify(message: Message, context: Context) -> Message:
    """Alg. 1 on this site's windows; only the classes are sent."""
    config, partition, model, calib, _ = _setup(message, context)
    start = time.perf_counter()
    result = classify_units(model, calib, config.classify_config(partition))
    codes = np.array([CLASSES.index(result.classes[u]) for u in result.units], dtype=np.uint8)
    context.state[STATE] = ArrayRecord({"classes": Array(codes)})
    return Message(RecordDict({
        "classes": ArrayRecord({"classes": Array(codes)}),
        "metrics": MetricRecord({"seconds": time.perf_counter() - start,
                                 "threshold": result.threshold, "partition": partition,
                                 **{c: n for c, n in result.counts().items()}})}),
        reply_to=message)


def plan_masks(message: Message, context: Context) -> Message:
    """This site's local Wanda masks at the global plan and, when a baseline needs them, at the
    uniform ratio (sent for the uniform FedPrLLM vote; kept in the context state as the
    local-only model: one pass serves both)."""
    config, partition, model, calib, _ = _setup(message, context)
    start = time.perf_counter()
    plan = message.content["plan"]
    content = RecordDict()
    wanted = [("masks", str(plan["layer_sparsity"]))]
    if plan.get("uniform", False) or plan.get("local-only", False):
        wanted.append(("uniform", ""))
    for key, layer_sparsity in wanted:
        result = local_masks(model, calib, config.prune_config(layer_sparsity),
                             batch_size=config.batch_size)
        record = ArrayRecord({k: Array(v) for k, v in encode_masks(result.masks).items()})
        if key == "masks" or plan.get("uniform", False):
            content[key] = record
        if key == "uniform" and plan.get("local-only", False):
            context.state[LOCAL] = record
    content["metrics"] = MetricRecord({"seconds": time.perf_counter() - start,
                                       "partition": partition})
    return Message(content, reply_to=message)


def _unpack(record: ArrayRecord, model, plan: SparsityPlan) -> dict[str, torch.Tensor]:
    payload = {k: a.numpy() for k, a in record.items()}
    shapes = expected_shapes(model)
    unknown = sorted(set(payload) - set(shapes))
    if unknown:
        raise ValueError(f"masks for unknown layers {unknown[:3]}")
    return decode_masks(payload, {k: shapes[k] for k in payload}, plan, tolerance=0.02)


def personalize(message: Message, context: Context) -> Message:
    """This site's personalized model (local masks on its personalized layers, the shared masks
    elsewhere) and the baselines, scored on its held-out windows."""
    config, partition, model, calib, held = _setup(message, context)
    if STATE not in context.state:
        raise RuntimeError("this site holds no unit classes: did it miss the classify round?")
    start = time.perf_counter()
    plan = SparsityPlan.from_text(str(message.content["plan"]["layer_sparsity"]),
                                  config.sparsity)
    codes = context.state[STATE]["classes"].numpy()
    units = units_of(model, config.granularity)
    if len(codes) != len(units):
        raise ValueError(f"{len(codes)} stored unit classes for {len(units)} units")
    personal = {lin for (unit, lins), code in zip(units.items(), codes)
                if CLASSES[int(code)] == "personalized" for lin in lins}
    shared = _unpack(message.content["shared"], model, plan)
    expected = {f"layers.{k}" for k in layer_sizes(model)} - {f"layers.{k}" for k in personal}
    if set(shared) != expected:
        raise ValueError(f"shared masks for {len(shared)} layers, expected every layer outside "
                         f"this site's {len(personal)} personalized ones ({len(expected)})")
    data_path = context.node_config.get("data-path")
    # a single file serves every split (fedcompress.data.corpora): its "held-out" windows are
    # cut from the training text; a directory with train and test files keeps them apart
    separate = data_path is None or Path(str(data_path)).is_dir()
    if not separate:
        logger.warning("data-path %s is one file: the held-out windows come from the same "
                       "text as the calibration windows (give a directory with train.jsonl "
                       "and test.jsonl)", data_path)
    metrics: dict = {"partition": partition, "personal_linears": len(personal),
                     "heldout_separate": int(separate)}
    models = {"personalized": pz.site_masks(model, calib, plan, shared, "row",
                                            config.batch_size, config.importance)}
    if "uniform" in message.content:
        uniform = _unpack(message.content["uniform"], model, SparsityPlan(config.sparsity))
        models["fedprllm"] = pz.masks_by_layer_list(uniform, model)
    if message.content["plan"].get("local-only", False):
        if LOCAL not in context.state:
            raise RuntimeError("local-only asked, but this site kept no masks at the uniform "
                               "ratio: did it miss the masks round?")
        own = _unpack(context.state[LOCAL], model, SparsityPlan(config.sparsity))
        models["local-only"] = pz.masks_by_layer_list(own, model)
    for name, masks in models.items():
        pruned = apply_masks(copy.deepcopy(model), masks)
        metrics[name] = pz.windows_perplexity(pruned, held, config.batch_size)
        metrics[f"sparsity_{name}"] = sparsity_report(pruned)["overall"]
        del pruned
    if config.guard != "off":
        if "fedprllm" not in metrics:
            raise RuntimeError("the guard compares the personalized model with uniform "
                               "FedPrLLM, but the server sent no uniform masks")
        kept, why = pz.guard_choice(metrics)
        metrics["kept_fedprllm"] = int(kept == "fedprllm")
        metrics["kept"] = metrics[kept]
        logger.info("site %d keeps its %s model: %s", partition, kept, why)
    if message.content["plan"].get("dense", False):
        metrics["dense"] = pz.windows_perplexity(model, held, config.batch_size)
    metrics["seconds"] = time.perf_counter() - start
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)

