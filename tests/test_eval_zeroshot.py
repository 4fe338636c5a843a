"""Unit tests of fedcompress.eval.zeroshot (lm-eval on an in-memory tiny model, offline)."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import fedcompress.data
from fedcompress.data.tasks import load_task
from fedcompress.eval import (
    DEFAULT_PROMPT,
    EmptyTaskError,
    TaskFormatError,
    TaskResult,
    UnknownSplitError,
    UnknownTaskError,
    zero_shot,
)

CORPUS = [
    "Question: What is the capital of France?\nAnswer: Paris",
    "Question: What do plants need to grow?\nAnswer: sunlight and water",
    "The quick brown fox jumps over the lazy dog.",
    "Water boils at one hundred degrees. Ice melts when it is warm.",
    "Cats, dogs, birds and fish are animals. Red, blue and green are colors.",
]

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "water", "the dog", "blue"]),
    ("What do plants need to grow?", ["sunlight and water", "ice", "a cat"]),
    ("Which one is an animal?", ["fish", "red", "Paris"]),
    ("Which one is a color?", ["green", "dog"]),
    ("When does ice melt?", ["when it is warm", "when it is cold", "never", "at night"]),
    ("At what temperature does water boil?", ["one hundred degrees", "zero degrees"]),
    ("What does the fox jump over?", ["the lazy dog", "the moon", "water"]),
    ("Which one can fly?", ["birds", "fish", "stones"]),
]


def build_tokenizer(pad: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # LLaMA-style: the tokenizer prepends BOS by default (lm-eval keeps that default).
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    extra = {"pad_token": "<pad>"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", **extra)


def build_model(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def make_records(labels: list[int] | None = None) -> list[dict[str, Any]]:
    return [
        {
            "id": f"q{i}",
            "question": q,
            "choices": list(c),
            "label": 0 if labels is None else labels[i],
        }
        for i, (q, c) in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return build_model(len(tokenizer))


def manual_loglikelihoods(model, tokenizer, question: str, choices: list[str]) -> list[float]:
    """Log-likelihood of " " + choice after the prompt, computed with the model directly."""
    context = DEFAULT_PROMPT.replace("{{question}}", question)
    lls = []
    with torch.no_grad():
        for choice in choices:
            whole = tokenizer(context + " " + choice).input_ids
            n_ctx = len(tokenizer(context).input_ids)
            cont = torch.tensor(whole[n_ctx:])
            logits = model(torch.tensor([whole[:-1]])).logits[0].float()
            logp = torch.log_softmax(logits[-len(cont) :], dim=-1)
            lls.append(logp.gather(-1, cont.unsqueeze(-1)).sum().item())
    return lls


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ---------------------------------------------------------------------------- results
def test_result_fields_on_random_model(model, tokenizer) -> None:
    records = make_records()
    out = zero_shot(model, tokenizer, {"toy": {"test": records}}, batch_size=4, progress=False)
    assert list(out) == ["toy"]
    res = out["toy"]
    assert isinstance(res, TaskResult)
    assert res.n == len(records)
    assert 0.0 <= res.acc <= 1.0 and 0.0 <= res.acc_norm <= 1.0
    assert res.acc_stderr >= 0.0 and res.acc_norm_stderr >= 0.0
    expected_chance = sum(1 / len(c) for _, c in QUESTIONS) / len(QUESTIONS)
    assert res.chance == pytest.approx(expected_chance, abs=1e-12)


def test_accuracy_equals_manual_argmax(model, tokenizer) -> None:
    # Rig the labels from the model's own log-likelihoods: the best choice for 6 questions, the
    # worst for 2, so lm-eval must report exactly 6/8; acc_norm is checked the same way.
    lls = [manual_loglikelihoods(model, tokenizer, q, c) for q, c in QUESTIONS]
    best = [argmax(ll) for ll in lls]
    worst = [min(range(len(ll)), key=ll.__getitem__) for ll in lls]
    assert all(b != w for b, w in zip(best, worst, strict=True))
    labels = best[:6] + worst[6:]
    records = make_records(labels)
    norm_pred = [
        argmax([x / len(ch) for x, ch in zip(ll, c, strict=True)])
        for ll, (_, c) in zip(lls, QUESTIONS, strict=True)
    ]
    expected_norm = sum(p == y for p, y in zip(norm_pred, labels, strict=True)) / len(labels)

    res = zero_shot(model, tokenizer, {"rigged": {"test": records}}, progress=False)["rigged"]
    assert res.acc == pytest.approx(6 / 8)
    assert res.acc_norm == pytest.approx(expected_norm)


def test_batch_size_does_not_change_accuracy(model, tokenizer) -> None:
    tasks = {"toy": {"test": make_records([i % 2 for i in range(len(QUESTIONS))])}}
    one = zero_shot(model, tokenizer, tasks, batch_size=1, progress=False)["toy"]
    many = zero_shot(model, tokenizer, tasks, batch_size=16, progress=True)["toy"]
    assert (one.acc, one.acc_norm, one.n) == (many.acc, many.acc_norm, many.n)


def test_limit_names_and_order(model, tokenizer) -> None:
    tasks = {
        "alpha": {"test": make_records()},
        "beta task/v2": {"test": make_records(), "train": make_records()},
        "gamma": {"test": make_records()},
    }
    out = zero_shot(
        model, tokenizer, tasks, names=["gamma", "beta task/v2"], limit=3, progress=False
    )
    assert list(out) == ["gamma", "beta task/v2"]
    for res in out.values():
        assert res.n == 3
        assert res.chance == pytest.approx((1 / 4 + 1 / 3 + 1 / 3) / 3)


def test_other_split_and_few_shot(model, tokenizer) -> None:
    tasks = {"toy": {"validation": make_records(), "train": make_records()}}
    res = zero_shot(model, tokenizer, tasks, split="validation", limit=4, progress=False)
    assert res["toy"].n == 4
    few = zero_shot(model, tokenizer, tasks, split="validation", num_fewshot=2, progress=False)
    assert few["toy"].n == len(QUESTIONS)
    with pytest.raises(UnknownSplitError, match="few-shot split"):
        zero_shot(model, tokenizer, {"toy": {"test": make_records()}}, num_fewshot=1)


def test_records_read_from_a_task_directory(model, tokenizer, tmp_path) -> None:
    # Task files are read by the data layer (the CLI's path); zero_shot takes its records as is.
    # Invalid JSON lines are tested in test_data_tasks.py::test_invalid_json_names_file_and_line.
    task_dir = tmp_path / "toy"
    task_dir.mkdir()
    (task_dir / "test.jsonl").write_text(
        "\n".join(json.dumps(r) for r in make_records()) + "\n", encoding="utf-8"
    )
    tasks = {"toy": {"test": load_task(str(task_dir), "test")}}
    assert tasks == {"toy": {"test": make_records()}}
    res = zero_shot(model, tokenizer, tasks, limit=5, progress=False)
    assert res["toy"].n == 5
    with pytest.raises(UnknownTaskError, match=r"\['nope'\].*\['toy'\]"):
        zero_shot(model, tokenizer, tasks, names=["nope"])


# ---------------------------------------------------------------------------- side effects
def test_runs_without_network_and_restores_offline_state(model, tokenizer, monkeypatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    # Start from an "online" configuration (conftest turns the hub off for the whole session):
    # zero_shot itself must switch everything offline, and restore it afterwards.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    hub_before = huggingface_hub.constants.HF_HUB_OFFLINE
    ds_before = datasets.config.HF_HUB_OFFLINE

    res = zero_shot(model, tokenizer, {"toy": {"test": make_records()}}, progress=False)
    assert res["toy"].n == len(QUESTIONS)
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ
    assert huggingface_hub.constants.HF_HUB_OFFLINE == hub_before
    assert datasets.config.HF_HUB_OFFLINE == ds_before


def test_model_and_tokenizer_are_not_mutated() -> None:
    tokenizer = build_tokenizer(pad=False)
    model = build_model(len(tokenizer))
    model.train()
    model.model.layers[1].eval()
    flags = {name: m.training for name, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = zero_shot(model, tokenizer, {"toy": {"test": make_records()}}, progress=False)
    assert res["toy"].n == len(QUESTIONS)
    assert tokenizer.pad_token is None
    assert {name: m.training for name, m in model.named_modules()} == flags
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------- errors
def test_task_errors_are_the_data_layers() -> None:
    assert UnknownTaskError is fedcompress.data.UnknownTaskError
    assert UnknownSplitError is fedcompress.data.UnknownSplitError
    assert EmptyTaskError is fedcompress.data.EmptyTaskError
    assert TaskFormatError is fedcompress.data.TaskFormatError
    for cls in (UnknownTaskError, UnknownSplitError, EmptyTaskError, TaskFormatError):
        assert issubclass(cls, ValueError)


def test_unknown_task_and_split(model, tokenizer) -> None:
    tasks = {"toy": {"test": make_records()}}
    with pytest.raises(UnknownTaskError, match=r"\['other'\].*available: \['toy'\]"):
        zero_shot(model, tokenizer, tasks, names=["other"])
    with pytest.raises(UnknownSplitError, match=r"'toy' has no split 'dev'.*\['test'\]"):
        zero_shot(model, tokenizer, tasks, split="dev")


def test_empty_records(model, tokenizer) -> None:
    with pytest.raises(EmptyTaskError, match="'toy' has no records"):
        zero_shot(model, tokenizer, {"toy": {"test": []}})
    with pytest.raises(EmptyTaskError, match="no tasks"):
        zero_shot(model, tokenizer, {})


@pytest.mark.parametrize(
    ("change", "record_id", "field"),
    [
        ({"label": None}, "q3", "label"),
        ({"label": 7}, "q3", "label"),
        ({"label": True}, "q3", "label"),
        ({"choices": "green"}, "q3", "choices"),
        ({"choices": ["only one"]}, "q3", "choices"),
        ({"choices": ["green", "  "]}, "q3", "choices"),
        ({"choices": ["green", 3]}, "q3", "choices"),
        ({"question": 5}, "q3", "question"),
        ({"question": " "}, "q3", "question"),
        ({"id": 3}, "#3", "id"),
        ({"id": "q0"}, "q0", "id"),  # duplicate
    ],
)
def test_malformed_record_names_id_and_field(
    model, tokenizer, change: dict[str, Any], record_id: str, field: str
) -> None:
    records = make_records()
    records[3] = {**records[3], **change}
    with pytest.raises(TaskFormatError) as info:
        zero_shot(model, tokenizer, {"toy": {"test": records}})
    assert info.value.task == "toy"
    assert info.value.record_id == record_id
    assert info.value.field == field
    assert f"id={record_id!r}" in str(info.value) and f"field {field!r}" in str(info.value)


def test_missing_field(model, tokenizer) -> None:
    records = make_records()
    del records[2]["choices"]
    with pytest.raises(TaskFormatError, match=r"id='q2': field 'choices' is missing"):
        zero_shot(model, tokenizer, {"toy": {"test": records}})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit": 0}, "limit"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_fewshot": -1}, "num_fewshot"),
    ],
)
def test_bad_arguments(model, tokenizer, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zero_shot(model, tokenizer, {"toy": {"test": make_records()}}, **kwargs)
