"""Synthetic multiple-choice QA data for PPC-GPT (paper §3.3, App. B). No Flower import.

* :mod:`~fedcompress.synth.prompts`: the paper's three prompts (question, answer, rationale) and
  their rendering (chat template of an instruct model, or plain text).
* :mod:`~fedcompress.synth.parse`: robust parsers of generator output; every rejection has a
  reason (:class:`~fedcompress.synth.parse.Rejection`).
* :mod:`~fedcompress.synth.backends`: generators: a local ``transformers`` model
  (:class:`~fedcompress.synth.backends.HFBackend`) or an OpenAI-compatible HTTP server
  (:class:`~fedcompress.synth.backends.OpenAIBackend`).
* :mod:`~fedcompress.synth.generate`: the pipeline (question -> agreeing answers -> rationale),
  its statistics and JSONL files.
"""

from fedcompress.synth.backends import Backend, Failed, HFBackend, OpenAIBackend
from fedcompress.synth.generate import (
    STAGES,
    SynthConfig,
    SyntheticSample,
    SynthResult,
    SynthStats,
    attempts_per_example,
    generate_synthetic,
    load_jsonl,
    save_jsonl,
)
from fedcompress.synth.parse import (
    ParsedQuestion,
    Rejected,
    Rejection,
    parse_answer,
    parse_question,
    parse_rationale,
)
from fedcompress.synth.prompts import (
    PPC_GPT_PROMPTS,
    PromptSet,
    answer_prompt,
    question_prompt,
    rationale_prompt,
    render_prompt,
)

__all__ = [
    "PPC_GPT_PROMPTS",
    "STAGES",
    "Backend",
    "Failed",
    "HFBackend",
    "OpenAIBackend",
    "ParsedQuestion",
    "PromptSet",
    "Rejected",
    "Rejection",
    "SynthConfig",
    "SynthResult",
    "SynthStats",
    "SyntheticSample",
    "answer_prompt",
    "attempts_per_example",
    "generate_synthetic",
    "load_jsonl",
    "parse_answer",
    "parse_question",
    "parse_rationale",
    "question_prompt",
    "rationale_prompt",
    "render_prompt",
    "save_jsonl",
]
