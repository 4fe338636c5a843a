"""The committed files under fedcompress/data/bundled/ agree with their manifest and rules."""

from __future__ import annotations

import hashlib
import json

import pytest

from fedcompress.data import (
    BUNDLED_CORPORA,
    BUNDLED_DIR,
    BUNDLED_TASKS,
    CORPUS_SPLITS,
    TASK_SPLITS,
    corpus_text,
    load_corpus,
    load_task,
    task_files,
)
from fedcompress.data.build import ARCHIVES

MANIFEST = json.loads((BUNDLED_DIR / "manifest.json").read_text(encoding="utf-8"))


def test_manifest_lists_exactly_the_generated_files() -> None:
    on_disk = {
        p.relative_to(BUNDLED_DIR).as_posix()
        for p in BUNDLED_DIR.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert on_disk == set(MANIFEST["files"])
    expected = {"SOURCES.md"}
    expected |= {f"corpora/{c}/{s}.jsonl" for c in BUNDLED_CORPORA for s in CORPUS_SPLITS}
    expected |= {f"tasks/{t}/{s}.jsonl" for t in BUNDLED_TASKS for s in TASK_SPLITS}
    assert on_disk == expected


@pytest.mark.parametrize("relpath", sorted(MANIFEST["files"]))
def test_file_matches_manifest(relpath: str) -> None:
    entry = MANIFEST["files"][relpath]
    data = (BUNDLED_DIR / relpath).read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert len(data) == entry["bytes"]
    if relpath.endswith(".jsonl"):
        lines = data.decode("utf-8").splitlines()
        assert len(lines) == entry["records"]
        assert all(line.strip() for line in lines)


def test_manifest_records_pinned_archives() -> None:
    for key, archive in ARCHIVES.items():
        assert MANIFEST["archives"][key]["sha256"] == archive.sha256
        assert MANIFEST["archives"][key]["version"] == archive.version


def test_sources_md_states_provenance_and_licences() -> None:
    sources = (BUNDLED_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for archive in ARCHIVES.values():
        assert archive.sha256 in sources
        assert archive.requirement in sources
    for needle in ("CC BY-SA 3.0", "Apache-2.0", "public domain", "CC BY 2.5",
                   "python -m fedcompress.data.build --archives DIR", "canary GUID"):
        assert needle in sources
    for relpath, entry in MANIFEST["files"].items():
        if relpath.endswith(".jsonl"):
            assert f"| `{relpath}` | {entry['records']} |" in sources


@pytest.mark.parametrize("name", BUNDLED_CORPORA)
def test_corpus_splits_are_disjoint_by_document(name: str) -> None:
    ids_by_split = {}
    texts = set()
    for split in CORPUS_SPLITS:
        docs = load_corpus(name, split)
        assert len(docs) == MANIFEST["files"][f"corpora/{name}/{split}.jsonl"]["records"]
        ids = [d.id for d in docs]
        assert len(ids) == len(set(ids))
        ids_by_split[split] = set(ids)
        for doc in docs:
            assert doc.source == name
            assert doc.id.startswith(f"{name}-")
            assert doc.text.strip() and doc.text == doc.text.strip()
            assert doc.text not in texts
            texts.add(doc.text)
    train, validation, test = (ids_by_split[s] for s in ("train", "validation", "test"))
    assert not train & validation and not train & test and not validation & test
    assert len(train) > len(validation) > 0 and len(test) > 0


def test_corpus_sizes_respect_caps() -> None:
    wiki = sum(len(corpus_text(load_corpus("wiki", s)).encode()) for s in CORPUS_SPLITS)
    shakespeare = sum(
        len(corpus_text(load_corpus("shakespeare", s)).encode()) for s in CORPUS_SPLITS
    )
    assert 3_000_000 < wiki < 4_100_000
    assert 2_000_000 < shakespeare < 3_100_000


def test_wiki_text_is_clean_paragraphs() -> None:
    docs = load_corpus("wiki", "validation")
    for doc in docs:
        assert doc.title is None
        assert "\n\n" not in doc.text  # paragraphs are lines; blank lines separate documents
        for paragraph in doc.text.split("\n"):
            assert paragraph == paragraph.strip() and paragraph
            assert "  " not in paragraph


def test_shakespeare_has_titles_and_no_gutenberg_boilerplate() -> None:
    for split in CORPUS_SPLITS:
        for doc in load_corpus("shakespeare", split):
            assert doc.title
            assert "gutenberg" not in doc.text.lower()
            assert "\r" not in doc.text and "\n\n\n" not in doc.text


@pytest.mark.parametrize("name", BUNDLED_TASKS)
def test_task_splits_follow_schema_and_are_disjoint(name: str) -> None:
    files = task_files(name)
    assert set(files) == set(TASK_SPLITS)
    seen_ids: set[str] = set()
    questions_by_split = {}
    for split in TASK_SPLITS:
        examples = load_task(name, split)
        assert len(examples) == MANIFEST["files"][f"tasks/{name}/{split}.jsonl"]["records"]
        ids = {ex["id"] for ex in examples}
        assert len(ids) == len(examples)
        assert not ids & seen_ids
        seen_ids |= ids
        for ex in examples:
            assert ex["id"].startswith(f"{name}-")
            assert 0 <= ex["label"] < len(ex["choices"])
        questions_by_split[split] = {ex["question"] for ex in examples}
    # groups never straddle splits: no question text is shared between two splits
    q = questions_by_split
    assert not q["train"] & q["test"] and not q["train"] & q["validation"]
    assert not q["validation"] & q["test"]
    assert len(load_task(name, "test")) <= 500
    assert len(load_task(name, "validation")) <= 200
    assert len(load_task(name, "train")) <= 2000

