"""Corpus loading: bundled, local files, hub loaders (datasets.load_dataset patched), errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from fedcompress.data import (
    BUNDLED_CORPORA,
    HUB_CORPORA,
    CorpusFormatError,
    DataError,
    Document,
    EmptyCorpusError,
    UnknownCorpusError,
    UnknownSplitError,
    corpora,
    corpus_text,
    load_corpus,
)


class FakeDataset:
    """The slice of a datasets.Dataset the loaders use: column access and row slicing."""

    def __init__(self, columns: dict[str, list[str]]) -> None:
        self.columns = columns

    def __getitem__(self, key: str | slice) -> Any:
        if isinstance(key, slice):
            return {name: values[key] for name, values in self.columns.items()}
        return self.columns[key]


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Patch datasets.load_dataset; record calls; return data keyed by the dataset asked for."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def load_dataset(*args: Any, **kwargs: Any) -> FakeDataset:
        calls.append((args, kwargs))
        split = kwargs["split"]
        if args[0] == "wikitext":
            return FakeDataset({"text": ["", f" = {split} title = \n", "", " body line \n"]})
        if args[0] == "allenai/c4":
            return FakeDataset({"text": [f"{split} doc {i}" for i in range(1200)]})
        if args[0] == "ptb_text_only":
            return FakeDataset({"sentence": ["a b c", "d e <unk>", "f"]})
        raise AssertionError(f"unexpected dataset {args}")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_wikitext2_keeps_rows_and_joins_with_blank_lines(fake_hub: list) -> None:
    docs = load_corpus("wikitext2", "test")
    assert fake_hub == [(("wikitext", "wikitext-2-raw-v1"), {"split": "test"})]
    assert len(docs) == 4  # empty rows are kept: the joined text must equal Wanda's
    assert corpus_text(docs) == "\n\n".join(["", " = test title = \n", "", " body line \n"])
    assert {d.source for d in docs} == {"wikitext2"}


def test_c4_uses_wanda_shards(fake_hub: list) -> None:
    train = load_corpus("c4", "train")
    validation = load_corpus("c4", "validation")
    assert fake_hub[0] == (
        ("allenai/c4",),
        {"data_files": {"train": "en/c4-train.00000-of-01024.json.gz"}, "split": "train"},
    )
    assert fake_hub[1] == (
        ("allenai/c4",),
        {"data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"},
         "split": "validation"},
    )
    assert len(train) == 1200
    assert corpus_text(train) == "\n\n".join(f"train doc {i}" for i in range(1200))
    # validation: Wanda's first 1100 records joined with one space, as ONE document
    assert len(validation) == 1
    assert corpus_text(validation) == " ".join(f"validation doc {i}" for i in range(1100))


def test_ptb_joins_sentences_with_spaces(fake_hub: list) -> None:
    docs = load_corpus("ptb", "validation")
    assert fake_hub == [(("ptb_text_only", "penn_treebank"), {"split": "validation"})]
    assert corpus_text(docs) == "a b c d e <unk> f"


def test_hub_split_checked_before_any_download(fake_hub: list) -> None:
    with pytest.raises(UnknownSplitError, match=r"'c4' has no split 'test'.*'train', 'validation'"):
        load_corpus("c4", "test")
    assert fake_hub == []


def test_hub_corpus_with_no_text_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *a, **k: FakeDataset({"text": ["", ""]})
    )
    with pytest.raises(EmptyCorpusError, match="'wikitext2' split 'train'"):
        load_corpus("wikitext2", "train")


@pytest.mark.parametrize("name", BUNDLED_CORPORA)
def test_bundled_corpora_load_without_network(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("bundled corpora must not touch the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    docs = load_corpus(name, "validation")
    assert docs and all(isinstance(d, Document) for d in docs)


def test_unknown_corpus_lists_the_available_ones() -> None:
    with pytest.raises(UnknownCorpusError) as info:
        load_corpus("wikitext103", "test")
    message = str(info.value)
    assert "'wikitext103'" in message
    for name in [*BUNDLED_CORPORA, *HUB_CORPORA]:
        assert repr(name) in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, DataError)


def test_unknown_split_of_bundled_corpus() -> None:
    with pytest.raises(UnknownSplitError, match=r"'wiki' has no split 'dev'.*'validation'"):
        load_corpus("wiki", "dev")


def test_local_txt_documents_are_separated_by_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("\n\nFirst doc\nline two\n\n  \nSecond doc\r\n\r\nThird\n\n\n", "utf-8")
    docs = load_corpus(str(path), "train")
    assert [d.text for d in docs] == ["First doc\nline two", "Second doc", "Third"]
    assert [d.id for d in docs] == ["notes-0", "notes-1", "notes-2"]
    assert docs[0].source == str(path)


def test_local_txt_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 ok\nna\u00efve\n".encode("utf-8")
                     + "\u00e9t\u00e9\n".encode("latin-1"))
    with pytest.raises(CorpusFormatError, match=r"latin1\.txt.*not UTF-8.*0xe9.*line 3"):
        load_corpus(str(path), "train")


def test_local_jsonl_reads_text_id_title(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [{"id": "a", "title": "T", "text": "alpha"}, {"text": "beta"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n", "utf-8")
    docs = load_corpus(str(path), "test")
    assert docs == [
        Document(id="a", title="T", text="alpha", source=str(path)),
        Document(id="c-1", title=None, text="beta", source=str(path)),
    ]


def test_local_directory_selects_split_file(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("one\n\ntwo\n", "utf-8")
    (tmp_path / "test.jsonl").write_text(json.dumps({"text": "three"}) + "\n", "utf-8")
    assert [d.text for d in load_corpus(str(tmp_path), "train")] == ["one", "two"]
    assert [d.text for d in load_corpus(str(tmp_path), "test")] == ["three"]
    with pytest.raises(UnknownSplitError, match="'validation'"):
        load_corpus(str(tmp_path), "validation")


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ('{"text": 3}\n', "field 'text' must be a string"),
        ('{"txt": "x"}\n', "field 'text' must be a string"),
        ("not json\n", r":1: not valid JSON"),
        ('["x"]\n', "expected a JSON object"),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "duplicate document id 'a'"),
        ('{"text": "x", "title": 5}\n', "field 'title'"),
    ],
)
def test_malformed_jsonl_is_rejected(tmp_path: Path, content: str, pattern: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, "utf-8")
    with pytest.raises(CorpusFormatError, match=pattern):
        load_corpus(str(path), "train")


@pytest.mark.parametrize(("filename", "content"), [("e.txt", "\n \n\n"), ("e.jsonl", "")])
def test_empty_local_file_names_the_file(tmp_path: Path, filename: str, content: str) -> None:
    path = tmp_path / filename
    path.write_text(content, "utf-8")
    with pytest.raises(EmptyCorpusError, match=filename):
        load_corpus(str(path), "train")


def test_missing_local_path_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UnknownCorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.txt"), "train")


def test_missing_bundled_file_explains_how_to_regenerate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(corpora, "BUNDLED_DIR", tmp_path)
    with pytest.raises(EmptyCorpusError, match=r"tools/build_data\.py"):
        load_corpus("wiki", "train")


def test_corpus_text_joins_with_blank_line_and_rejects_empty() -> None:
    docs = [Document("a", None, "x", "s"), Document("b", None, "y\nz", "s")]
    assert corpus_text(docs) == "x\n\ny\nz"
    with pytest.raises(EmptyCorpusError):
        corpus_text([])
