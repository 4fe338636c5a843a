"""The settings piece of synthetic chain-of-thought data (on the
:class:`fedcompress.config.Settings` base; PPC-GPT's settings class composes it, and its flat
names are ``fedcompress ppcgpt``'s options): the generator LLM_syn, local or an
OpenAI-compatible server, and the budgets of :func:`fedcompress.synth.generate_synthetic`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedcompress.config import Settings, setting

__all__ = ["SynthSettings"]


@dataclass(frozen=True)
class SynthSettings(Settings):
    """LLM_syn and its budgets: synthetic questions, chain-of-thought answers kept when they
    agree, rationales.

    With ``synth_url``, ``synth_timeout`` is seconds per HTTP response and ``synth_workers`` the
    requests in flight (match the server's parallel slots: a CPU server answering 4 long
    prompts at once takes minutes, not seconds)."""

    label: ClassVar[str] = "synthetic CoT data"

    synth_model: str = setting("", "LLM_syn: model spec of the generator (empty: --model); "
                               "with --synth-url the served model name.")
    synth_url: str = setting("", "OpenAI-compatible server for LLM_syn (vLLM, Ollama, TGI), "
                             "e.g. http://localhost:8000/v1.")
    synth_api: str = setting("chat", "API of --synth-url: chat or completions.",
                             choices=("chat", "completions"))
    synth_ratio: float = setting(1.0, "Synthetic samples wanted per client example.", gt=0.0)
    answer_samples: int = setting(3, "Chain-of-thought answers per question (kept when they "
                                  "agree).", ge=1)
    question_tokens: int = setting(128, "Token budget of a synthetic question.", ge=1)
    answer_tokens: int = setting(192, "Token budget of a chain-of-thought answer.", ge=1)
    rationale_tokens: int = setting(96, "Token budget of a rationale.", ge=1)
    synth_batch_size: int = setting(8, "Generation batch size.", ge=1)
    synth_time_limit: float = setting(0.0, "Seconds of generation at most (0: no limit).",
                                      ge=0.0)
    synth_timeout: float = setting(300.0, "Seconds per HTTP response of --synth-url.", gt=0.0)
    synth_workers: int = setting(4, "Requests to --synth-url in flight.", ge=1)
    min_synthetic: int = setting(4, "Fewest accepted synthetic samples to go on with.", ge=1)
