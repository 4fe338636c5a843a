"""Loading a whole model by spec (:func:`~fedcompress.models.loading.load_model`, in eval mode,
or its onloaded skeleton), and importing an architecture's modeling code apart from reading its
weights (:func:`~fedcompress.models.loading.import_model_code`)."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from fedcompress.models.adapter import ModelAdapter, num_layers
from fedcompress.models.common import UnknownModelError, default_device, parse_dtype
from fedcompress.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, _converted_dir
from fedcompress.models.onload import onload_model
from fedcompress.models.spec import ENCODER_TYPES, LoadedModel, resolve_model_spec

logger = logging.getLogger(__name__)


def import_model_code(spec: str) -> None:
    """Import transformers and the modeling code of ``spec``'s architecture (named by its
    ``config.json``; no weight is read), so that a caller can time the Python imports apart from
    :func:`load_model`'s reading. A spec that is not yet a transformers directory on disk (a
    GGUF still to convert, a hub id): transformers only."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    path = Path(spec).expanduser()
    if spec in EMBEDDED_MODELS:
        folder = (_converted_dir(spec) if EMBEDDED_MODELS[spec].layout == "gguf" else None)
    else:
        folder = path if path.is_dir() else None
    if folder is None or not (folder / "config.json").is_file():
        return
    config = AutoConfig.from_pretrained(folder)
    mapping = MODEL_MAPPING if config.model_type in ENCODER_TYPES else MODEL_FOR_CAUSAL_LM_MAPPING
    with contextlib.suppress(KeyError, ValueError):  # an architecture transformers lacks
        mapping[type(config)]  # imports the architecture's modeling module


def load_model(
    spec: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    onload: bool = False,
) -> LoadedModel:
    """Load a model and its tokenizer by spec (see :mod:`fedcompress.models`), in eval mode.

    ``onload``: a skeleton instead (:func:`~fedcompress.models.onload.onload_model`): the
    decoder layers stay on the meta device and the calibration walker reads them one at a time
    from the safetensors files.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    if onload:
        return onload_model(spec, device, dtype)
    start = time.perf_counter()
    source, path, converted = resolve_model_spec(spec)
    torch_dtype = parse_dtype(dtype)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        if source == "hub":
            raise UnknownModelError(
                f"could not load {spec!r} from the Hugging Face hub ({err}). Hub models need the "
                "internet; offline, pass a local directory, a .gguf file or an embedded model "
                f"({', '.join(EMBEDDED_MODELS)})"
            ) from err
        raise
    auto = AutoModel if config.model_type in ENCODER_TYPES else AutoModelForCausalLM
    # The weights stay memory-mapped from the safetensors files when they are stored in
    # ``dtype`` and the device is the CPU (transformers maps them, no copy); another dtype casts.
    model = auto.from_pretrained(path, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.to(device or default_device())
    model.eval()
    ModelAdapter(model)  # fail early on an architecture the adapter cannot handle
    seconds = time.perf_counter() - start
    logger.info("loaded %s (%s) from %s in %.1fs", spec, source, path, seconds)
    return LoadedModel(model, tokenizer, spec, source, path, converted, seconds,
                       info={"model_type": config.model_type,
                             "num_layers": num_layers(model),
                             "parameters": sum(p.numel() for p in model.parameters())})
