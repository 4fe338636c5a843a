"""Calibration windows on a tiny character-level tokenizer built in a fixture (no downloads)."""

from __future__ import annotations

import string

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from fedcompress.data import (
    Document,
    EmptyCorpusError,
    InvalidParameterError,
    NotEnoughTokensError,
    calibration_windows,
    corpus_text,
    load_corpus,
    mixed_calibration_windows,
    sample_windows,
    tokenize_corpus,
)

BOS_ID = 1


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of string.printable; [UNK] otherwise; a BOS post-processor.

    The post-processor adds BOS when special tokens are requested, so the tests can check that
    calibration never asks for them.
    """
    vocab = {"[UNK]": 0, "[BOS]": BOS_ID}
    for char in sorted(set(string.printable)):
        vocab.setdefault(char, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", BOS_ID)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]")


def docs_of(*texts: str) -> list[Document]:
    return [Document(id=f"d{i}", title=None, text=t, source="test") for i, t in enumerate(texts)]


DOCS = docs_of(
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.\nSphinx of black quartz, judge my vow.",
    "How vexingly quick daft zebras jump!",
)


def test_tokenize_corpus_is_the_joined_text_without_special_tokens(tokenizer) -> None:
    ids = tokenize_corpus(tokenizer, DOCS)
    text = corpus_text(DOCS)
    assert ids.dtype == torch.long and ids.ndim == 1
    assert ids.numel() == len(text)  # character-level: one token per character, no BOS
    assert ids[0].item() != BOS_ID
    assert tokenizer.decode(ids.tolist()).replace(" ", "") == text.replace(" ", "")


def test_windows_shape_dtype_vocab_and_slices(tokenizer) -> None:
    windows = calibration_windows(tokenizer, DOCS, n=16, seqlen=10, seed=0)
    assert windows.shape == (16, 10) and windows.dtype == torch.long
    assert int(windows.min()) >= 0 and int(windows.max()) < len(tokenizer)
    assert not (windows == BOS_ID).any()
    stream = tokenize_corpus(tokenizer, DOCS).tolist()
    for row in windows.tolist():
        starts = [i for i in range(len(stream) - 10 + 1) if stream[i:i + 10] == row]
        assert starts and min(starts) <= len(stream) - 10 - 1  # a real slice, start <= len-seqlen-1


def test_windows_deterministic_per_seed_and_different_across_seeds(tokenizer) -> None:
    a = calibration_windows(tokenizer, DOCS, n=8, seqlen=12, seed=3)
    b = calibration_windows(tokenizer, DOCS, n=8, seqlen=12, seed=3)
    c = calibration_windows(tokenizer, DOCS, n=8, seqlen=12, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_windows_do_not_use_global_rngs(tokenizer) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    a = calibration_windows(tokenizer, DOCS, n=8, seqlen=12, seed=5)
    torch.manual_seed(123)
    np.random.seed(123)
    b = calibration_windows(tokenizer, DOCS, n=8, seqlen=12, seed=5)
    assert torch.equal(a, b)


def test_sample_windows_start_range_is_wanda_s() -> None:
    stream = torch.arange(12)
    windows = sample_windows(stream, n=2000, seqlen=10, rng=np.random.default_rng(0))
    starts = set(windows[:, 0].tolist())
    assert starts == {0, 1}  # uniform over [0, len - seqlen - 1]
    assert torch.equal(windows[0], torch.arange(windows[0, 0].item(), windows[0, 0].item() + 10))


def test_corpus_needs_seqlen_plus_one_tokens(tokenizer) -> None:
    docs = docs_of("abcdefghij")  # 10 tokens
    assert calibration_windows(tokenizer, docs, n=1, seqlen=9, seed=0).shape == (1, 9)
    with pytest.raises(NotEnoughTokensError, match=r"has 10 tokens.*seqlen=10.*at least 11"):
        calibration_windows(tokenizer, docs, n=1, seqlen=10, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"n": 0}, "n must be a positive integer, got 0"),
        ({"n": -3}, "n must be a positive integer, got -3"),
        ({"n": 2.0}, "n must be a positive integer, got 2.0"),
        ({"n": True}, "n must be a positive integer, got True"),
        ({"seqlen": 0}, "seqlen must be a positive integer, got 0"),
        ({"seed": -1}, "seed must be a non-negative integer, got -1"),
    ],
)
def test_invalid_parameters(tokenizer, kwargs: dict, pattern: str) -> None:
    arguments = {"n": 2, "seqlen": 4, "seed": 0} | kwargs
    with pytest.raises(InvalidParameterError, match=pattern):
        calibration_windows(tokenizer, DOCS, **arguments)


def test_empty_docs_are_an_error(tokenizer) -> None:
    with pytest.raises(EmptyCorpusError):
        calibration_windows(tokenizer, [], n=1, seqlen=4, seed=0)


def test_mixed_windows_label_each_row_with_its_source(tokenizer) -> None:
    a_docs = docs_of("a" * 50)
    b_docs = docs_of("b" * 50)
    windows, sources = mixed_calibration_windows(
        tokenizer, {"a": a_docs, "b": b_docs}, n_per_source={"a": 3, "b": 5}, seqlen=8, seed=0
    )
    assert windows.shape == (8, 8)
    assert sources == ["a"] * 3 + ["b"] * 5
    a_id, b_id = tokenizer.convert_tokens_to_ids(["a", "b"])
    for row, source in zip(windows.tolist(), sources, strict=True):
        assert set(row) == {a_id if source == "a" else b_id}


def test_mixed_windows_per_source_stream_is_order_independent(tokenizer) -> None:
    x = docs_of(corpus_text(DOCS))
    y = docs_of("Jackdaws love my big sphinx of quartz. " * 3)
    first, labels1 = mixed_calibration_windows(tokenizer, {"x": x, "y": y}, 4, 10, seed=1)
    second, labels2 = mixed_calibration_windows(tokenizer, {"y": y, "x": x}, 4, 10, seed=1)
    alone, _ = mixed_calibration_windows(tokenizer, {"x": x}, 4, 10, seed=1)
    assert torch.equal(first[:4], second[4:]) and torch.equal(first[4:], second[:4])
    assert torch.equal(first[:4], alone)
    assert labels1 == ["x"] * 4 + ["y"] * 4 and labels2 == ["y"] * 4 + ["x"] * 4


def test_mixed_windows_errors_name_the_source(tokenizer) -> None:
    with pytest.raises(NotEnoughTokensError, match="source 'short'"):
        mixed_calibration_windows(
            tokenizer, {"long": DOCS, "short": docs_of("abc")}, 1, 10, seed=0
        )
    with pytest.raises(InvalidParameterError, match="expected exactly the sources"):
        mixed_calibration_windows(tokenizer, {"a": DOCS}, {"b": 1}, 4, seed=0)
    with pytest.raises(InvalidParameterError, match="at least one corpus"):
        mixed_calibration_windows(tokenizer, {}, 1, 4, seed=0)


def test_windows_from_bundled_corpora(tokenizer) -> None:
    sources = {name: load_corpus(name, "validation") for name in ("wiki", "shakespeare")}
    windows, labels = mixed_calibration_windows(tokenizer, sources, 4, 64, seed=0)
    assert windows.shape == (8, 64)
    assert labels == ["wiki"] * 4 + ["shakespeare"] * 4
    assert int(windows.max()) < len(tokenizer)
