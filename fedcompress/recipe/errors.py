"""The one error of a recipe, and the check every part of it shares: no unknown field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class RecipeError(ValueError):
    """A recipe fedcompress cannot apply as written: names the field (its path in the recipe)
    and what was expected. Nothing of a recipe is ignored: a field fedcompress does not
    implement is refused here."""


def refuse_unknown(args: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Refuse every key of ``args`` outside ``known``, naming them and what is known."""
    known = tuple(known)
    unknown = sorted(str(k) for k in args if k not in known)
    if unknown:
        raise RecipeError(f"{where}: {', '.join(unknown)} "
                          f"{'is' if len(unknown) == 1 else 'are'} not implemented by "
                          f"fedcompress: expected some of {', '.join(sorted(known))}")
