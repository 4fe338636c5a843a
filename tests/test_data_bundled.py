"""The committed files under fedcompress/data/bundled/ agree with their manifest and rules."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import tomllib
import warnings
from pathlib import Path

import pytest
from conftest import load_tool

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

build = load_tool("build_data")
from build_data import ARCHIVES, STDLIB, module_name  # noqa: E402

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
    assert MANIFEST["stdlib"]["sha256"] == STDLIB.sha256
    assert MANIFEST["stdlib"]["version"] == STDLIB.version == "3.11.7"


def test_sources_md_states_provenance_and_licences() -> None:
    sources = (BUNDLED_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for archive in ARCHIVES.values():
        assert archive.sha256 in sources
        assert archive.requirement in sources
    for needle in ("CC BY-SA 3.0", "Apache-2.0", "public domain", "CC BY 2.5",
                   "python tools/build_data.py --archives DIR", "canary GUID", "make data-check",
                   "python tools/build_data.py --only code", "CPython 3.11.7", "PSF-2.0",
                   "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2", STDLIB.sha256,
                   "Python Software Foundation; All Rights Reserved"):
        assert needle in sources
    assert [line for line in sources.splitlines() if line.startswith("## Corpus ")] == [
        f"## Corpus `{name}`" for name in BUNDLED_CORPORA
    ]
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
    code = sum(len(corpus_text(load_corpus("code", s)).encode()) for s in CORPUS_SPLITS)
    assert 3_000_000 < wiki < 4_100_000
    assert 2_000_000 < shakespeare < 3_100_000
    assert 1_000_000 < code < 1_510_000
    code_files = sum(MANIFEST["files"][f"corpora/code/{s}.jsonl"]["bytes"] for s in CORPUS_SPLITS)
    assert code_files < 2_000_000


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


def test_code_is_python_stdlib_source_one_file_per_document() -> None:
    titles: set[str] = set()
    for split in CORPUS_SPLITS:
        docs = load_corpus("code", split)
        assert [d.title for d in docs] == sorted(d.title for d in docs)  # path order
        for doc in docs:
            assert doc.title and doc.title.endswith(".py") and doc.title not in titles
            titles.add(doc.title)
            assert doc.id == f"code-{module_name(doc.title)}"
            folders = doc.title.split("/")[:-1]
            assert not set(folders) & set(build.CODE_EXCLUDED_DIRS)
            assert not any(f.startswith("config-") for f in folders)
            assert not doc.title.split("/")[-1].startswith("_sysconfigdata")
            size = len(doc.text.encode("utf-8"))
            assert build.CODE_MIN_BYTES - 100 <= size <= build.CODE_MAX_BYTES
            assert "\r" not in doc.text
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(doc.text, filename=doc.title)
    assert 150 <= len(titles) <= 300


def test_code_corpus_rebuilds_byte_for_byte(tmp_path: Path) -> None:
    """`--only code` on a copy of the bundle reproduces the committed files (needs the pinned
    standard library, i.e. this interpreter being CPython 3.11.7)."""
    stdlib = build.read_stdlib(build.default_stdlib())
    if stdlib.sha256 != STDLIB.sha256:
        pytest.skip(f"the running interpreter's standard library is not {STDLIB.name}'s")
    copy = tmp_path / "bundled"
    shutil.copytree(BUNDLED_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    build.rebuild_code_corpus(copy)
    for path in sorted(BUNDLED_DIR.rglob("*")):
        if path.is_file():
            rel = path.relative_to(BUNDLED_DIR)
            assert (copy / rel).read_bytes() == path.read_bytes(), rel


FAB_CODE_ROOM = 512 * 1024


def _fab(root: Path) -> dict[str, bytes]:
    """The FAB flwr builds from this checkout: its file names -> contents."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_files

    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    files = {p.relative_to(root).as_posix(): p
             for pattern in config["tool"]["flwr"]["app"]["fab-include"]
             for p in root.glob(pattern) if p.is_file()}
    fab, _ = build_fab_from_files({"pyproject.toml": root / "pyproject.toml", **files})
    with zipfile.ZipFile(io.BytesIO(fab)) as archive:
        return {name: archive.read(name) for name in archive.namelist()} | {"": fab}


def test_fab_ships_every_module_its_code_imports() -> None:
    """The FAB leaves out code no app runs (`fab-exclude`): no shipped module imports, even
    lazily inside a function, a module of this repository that is not shipped."""
    root = BUNDLED_DIR.parents[2]
    fab = _fab(root)
    missing = []
    for name, source in fab.items():
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                path = module.replace(".", "/")
                for candidate in (f"{path}.py", f"{path}/__init__.py"):
                    if (root / candidate).is_file() and candidate not in fab:
                        missing.append(f"{name} imports {module} ({candidate} not shipped)")
    assert not missing, "\n".join(missing)


def test_fab_carries_code_not_data_and_leaves_room_under_the_fab_limit() -> None:
    """The FAB that flwr builds from this checkout (its own include/exclude rules; a FAB stores
    its files uncompressed) carries the app's code and the bundled data's manifest, no data file
    (sites read those from their installed fedcompress), and stays at least 512 KiB under
    flwr's limit."""
    from flwr.common.constant import FAB_MAX_SIZE

    fab = _fab(BUNDLED_DIR.parents[2])
    data = [name for name in fab if name.startswith("fedcompress/data/bundled/")]
    assert data == ["fedcompress/data/bundled/manifest.json"], data
    assert len(fab[""]) <= FAB_MAX_SIZE - FAB_CODE_ROOM, f"{len(fab['']):,} bytes"


def test_a_fab_without_data_reads_the_installed_bundled_data(tmp_path) -> None:
    """A copy of the package holding only the bundled data's manifest (what a FAB unpacks)
    finds the bundled corpora and tasks in the installed fedcompress, and refuses an installed
    fedcompress whose data differs from the manifest it was built with."""
    import subprocess
    import sys

    for root in ("fedcompress", "clients", "server", "strategies"):
        shutil.copytree(BUNDLED_DIR.parents[2] / root, tmp_path / root,
                        ignore=shutil.ignore_patterns("__pycache__", "*.jsonl", "SOURCES.md"))
    probe = ("import fedcompress.data.corpora as c, fedcompress.data as d; "
             "print(c.__file__); print(c.BUNDLED_DIR); "
             "print(len(d.load_corpus('wiki', 'train')), len(d.load_task('social_iqa', 'test')))")

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    out = run()
    assert out.returncode == 0, out.stderr
    module, folder, sizes = out.stdout.split("\n")[:3]
    assert module.startswith(str(tmp_path))  # the copy's code ran
    assert Path(folder) == BUNDLED_DIR  # the installed data was read
    assert sizes.split() == [str(len(load_corpus("wiki", "train"))),
                             str(len(load_task("social_iqa", "test")))]
    manifest = tmp_path / "fedcompress/data/bundled/manifest.json"
    manifest.write_text(manifest.read_text().replace('"bytes"', '"bytes" ', 1))
    out = run()
    assert out.returncode != 0 and "is not the data this app was built with" in out.stderr
