"""FedPrLLM server strategies (a package being split along its seams; the code lives in
:mod:`strategies.fedprllm.oneshot` for now)."""

from strategies.fedprllm.oneshot import (
    FedPrLLM,
    IterativeFedPrLLM,
    NotEnoughClientsError,
    SecureFedPrLLM,
    SecureIterativeFedPrLLM,
    SecureStatsFedPrLLM,
    StatsFedPrLLM,
    make_strategy,
)

__all__ = ["FedPrLLM", "IterativeFedPrLLM", "NotEnoughClientsError", "SecureFedPrLLM",
           "SecureIterativeFedPrLLM", "SecureStatsFedPrLLM", "StatsFedPrLLM", "make_strategy"]
