"""fedcompress: privacy-preserving, federated compression of language models, on Flower.

``from fedcompress import compress``: a recipe over a simulated federation in one call
(:func:`fedcompress.api.compress`, imported on first use: a site's ClientApp that imports a
module of the package does not load the API's dependencies).
"""

from typing import Any

__all__ = ["compress"]


def __getattr__(name: str) -> Any:
    if name == "compress":
        from fedcompress.api import compress

        return compress
    raise AttributeError(f"module 'fedcompress' has no attribute {name!r}")
