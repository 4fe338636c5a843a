"""Errors of the text sanitizer and the validation helpers of its settings."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import numpy as np


class SanitizeError(ValueError):
    """Bad input or configuration of the sanitizer."""


class OOVError(SanitizeError):
    """A word is not in the embedding table and the policy is ``'error'``.

    Attributes:
        word: the word as written in the text.
        offset: its character offset in the text (or stream); ``None`` outside a text.
    """

    def __init__(self, word: str, offset: int | None = None) -> None:
        if offset is None:
            super().__init__(f"word {word!r} is not in the embedding table")
        else:
            super().__init__(f"word {word!r} at character {offset} is not in the embedding "
                             "table (out-of-vocabulary policy 'error'; use 'random' to replace "
                             "such words)")
        self.word = word
        self.offset = offset


class InputEncodingError(SanitizeError):
    """Bytes given to the sanitizer are not valid UTF-8."""


def _enum(cls: type[StrEnum], value: object, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise SanitizeError(f"{name} must be one of {choices}, got {value!r}") from None


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise SanitizeError(f"{name} must be an integer >= {minimum}, got {value!r}")
