"""What a model spec names: an embedded model, a ``.gguf`` file, a local directory or a hub
id (:func:`~fedcompress.models.spec.resolve_model_spec`), and what loading one gives
(:class:`~fedcompress.models.spec.LoadedModel`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from fedcompress.models.common import UnknownModelError
from fedcompress.models.embedded import EMBEDDED_MODELS, embedded_model_dir, gguf_model_dir

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
