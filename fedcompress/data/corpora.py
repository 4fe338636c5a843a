"""Text corpora: bundled files, hub loaders for users online, and local files.

A corpus is a list of :class:`Document` objects. :func:`corpus_text` joins them with a blank line
(``"\\n\\n"``); that joined string is *exactly* the text perplexity is measured on and the stream
calibration windows are cut from, so the way each loader splits its source into documents is part
of the metric's definition.

Corpus names accepted by :func:`load_corpus`:

* bundled, offline (:data:`BUNDLED_CORPORA`): ``"wiki"`` (English Wikipedia articles from the
  BIG-bench ``paragraph_segmentation`` task), ``"shakespeare"`` (Project Gutenberg play texts)
  and ``"code"`` (Python source files of the CPython 3.11 standard library, one document per
  file); splits ``train``, ``validation``, ``test``. See ``bundled/SOURCES.md``.
* hub, online only (:data:`HUB_CORPORA`), following Wanda / SparseGPT (``locuslab/wanda``
  ``lib/data.py``) so that ``corpus_text`` of the evaluation split is their evaluation string:

  - ``"wikitext2"``: ``load_dataset("wikitext", "wikitext-2-raw-v1")``; one document per dataset
    row, *including empty rows*, so ``corpus_text`` is ``"\\n\\n".join(rows)``.
  - ``"c4"``: ``load_dataset("allenai/c4", data_files=...)`` on the first English shard of each
    split (``en/c4-train.00000-of-01024.json.gz``, ``en/c4-validation.00000-of-00008.json.gz``).
    ``train`` gives one document per record. ``validation`` gives ONE document, the first
    :data:`C4_VALIDATION_DOCUMENTS` records joined with ``" "``, as Wanda evaluates it (Wanda
    then keeps the first ``256 * seqlen`` tokens; that truncation belongs to the evaluator).
  - ``"ptb"``: ``load_dataset("ptb_text_only", "penn_treebank")``; ONE document per split, the
    ``sentence`` fields joined with ``" "``.

  (Wanda's calibration differs slightly: it joins wikitext2's *train* rows with ``" "`` and draws
  C4 windows inside single documents; here every calibration stream is ``corpus_text``.)
* a local path: a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` file (one
  object per line with a string ``"text"``, optional ``"id"`` and ``"title"``), or a directory
  holding ``<split>.txt`` / ``<split>.jsonl``. A single file is the whole corpus: it serves
  whichever split is asked for (use a directory to keep splits apart).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcompress.data.errors import (
    CorpusFormatError,
    DataError,
    EmptyCorpusError,
    UnknownCorpusError,
    UnknownSplitError,
    data_unavailable,
    format_choices,
)
from fedcompress.data.jsonl import read_jsonl

__all__ = [
    "BUNDLED_CORPORA",
    "BUNDLED_DIR",
    "C4_VALIDATION_DOCUMENTS",
    "CORPUS_SPLITS",
    "DOCUMENT_SEPARATOR",
    "HUB_CORPORA",
    "Document",
    "corpus_text",
    "load_corpus",
]

logger = logging.getLogger(__name__)

def _installed_bundled_dir() -> Path | None:
    """The bundled-data folder of the INSTALLED fedcompress distribution (its source folder for
    an editable install), or None when there is no such install."""
    import importlib.metadata
    import json
    from urllib.parse import unquote, urlparse

    try:
        dist = importlib.metadata.distribution("fedcompress")
    except importlib.metadata.PackageNotFoundError:
        return None
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file:"):
            return Path(unquote(urlparse(info["url"]).path)) / "fedcompress" / "data" / "bundled"
    return Path(str(dist.locate_file("fedcompress/data/bundled")))


def _holds_data(folder: Path) -> bool:
    """Whether ``folder`` holds every file its ``manifest.json`` lists (a FAB's copy holds only
    the manifest)."""
    import json

    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return False
    return all((folder / name).is_file()
               for name in json.loads(manifest.read_text(encoding="utf-8"))["files"])


def _bundled_dir() -> Path:
    """Where the bundled corpora and tasks are: beside this module when they are (a checkout, an
    installed package), else in the installed fedcompress distribution. A Flower app bundle (FAB)
    carries the code and ``manifest.json`` but not the data files (Flower's 10 MiB FAB limit):
    each site reads them from its own installed fedcompress, which must hold the same files as
    the FAB says (the two manifests, which list every file's SHA-256, must be equal)."""
    here = Path(__file__).resolve().parent / "bundled"
    if _holds_data(here):
        return here
    installed = _installed_bundled_dir()
    if installed is None or not _holds_data(installed):
        return here  # loading a bundled file then fails with its path named
    mine, theirs = here / "manifest.json", installed / "manifest.json"
    if mine.is_file() and (not theirs.is_file() or mine.read_bytes() != theirs.read_bytes()):
        raise RuntimeError(f"the bundled data of the installed fedcompress ({installed}) is not "
                           f"the data this app was built with ({mine} differs): install the "
                           "fedcompress version of the app at this site")
    return installed


BUNDLED_DIR: Path = _bundled_dir()
"""Folder of the files generated by ``python tools/build_data.py`` (:func:`_bundled_dir`)."""

DOCUMENT_SEPARATOR = "\n\n"
"""What :func:`corpus_text` puts between documents."""

CORPUS_SPLITS: tuple[str, ...] = ("train", "validation", "test")
"""Splits of every bundled corpus."""

BUNDLED_CORPORA: tuple[str, ...] = ("code", "shakespeare", "wiki")
"""Names of the corpora shipped with the package (offline)."""

HUB_CORPORA: dict[str, tuple[str, ...]] = {
    "wikitext2": ("train", "validation", "test"),
    "c4": ("train", "validation"),
    "ptb": ("train", "validation", "test"),
}
"""Corpora downloaded with ``datasets.load_dataset`` (network needed), with their splits."""

C4_VALIDATION_DOCUMENTS = 1100
"""Records of the C4 validation shard that form the evaluation text (Wanda's choice)."""

WIKITEXT2_DATASET = ("wikitext", "wikitext-2-raw-v1")
C4_DATASET = "allenai/c4"
C4_DATA_FILES: dict[str, str] = {
    "train": "en/c4-train.00000-of-01024.json.gz",
    "validation": "en/c4-validation.00000-of-00008.json.gz",
}
PTB_DATASET = ("ptb_text_only", "penn_treebank")

_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")
_LOCAL_SUFFIXES = (".jsonl", ".txt")


@dataclass(frozen=True, slots=True)
class Document:
    """One document of a corpus.

    Attributes:
        id: identifier, unique within its corpus (``"wiki-01017"``, ``"shakespeare-hamlet"``,
            ``"code-json.decoder"``).
        title: the document title when the source has one, else ``None``.
        text: the document text.
        source: the corpus it came from (a corpus name or a file path).
    """

    id: str
    title: str | None
    text: str
    source: str


def corpus_text(docs: Sequence[Document]) -> str:
    """Join the documents' texts with :data:`DOCUMENT_SEPARATOR` (a blank line).

    This string is exactly what perplexity is measured on and what calibration windows are cut
    from; the loaders choose their document boundaries so that it matches the reference
    definitions (see the module docstring).

    Raises:
        EmptyCorpusError: ``docs`` is empty.
    """
    if not docs:
        raise EmptyCorpusError("cannot join an empty list of documents: the corpus has none")
    return DOCUMENT_SEPARATOR.join(doc.text for doc in docs)


def load_corpus(name: str, split: str = "train") -> list[Document]:
    """Load the ``split`` of corpus ``name`` as a list of documents.

    Args:
        name: a bundled corpus (:data:`BUNDLED_CORPORA`), a hub corpus (:data:`HUB_CORPORA`,
            network needed), or a path to a local ``.txt`` / ``.jsonl`` file or directory.
        split: ``"train"``, ``"validation"`` or ``"test"`` (``c4`` has no ``test``). A single
            local file serves every split.

    Raises:
        UnknownCorpusError: ``name`` is none of the above.
        UnknownSplitError: the corpus has no such split.
        EmptyCorpusError: the corpus, split or file holds no text.
        CorpusFormatError: a local or bundled file is malformed.
        DataUnavailableError: a hub corpus cannot be loaded (offline and not cached, or the
            download failed); the message names it and says what to use instead.
    """
    if name in BUNDLED_CORPORA:
        _check_split(name, split, CORPUS_SPLITS)
        path = BUNDLED_DIR / "corpora" / name / f"{split}.jsonl"
        if not path.is_file():
            command = (
                "python tools/build_data.py --only code" if name == "code"
                else "python tools/build_data.py --archives DIR"
            )
            raise EmptyCorpusError(
                f"bundled corpus {name!r} split {split!r}: file {path} is missing; regenerate the "
                f"bundled data with `{command}`"
            )
        docs = _read_jsonl_documents(path, source=name, default_id_prefix=name)
    elif name in HUB_CORPORA:
        _check_split(name, split, HUB_CORPORA[name])
        try:
            docs = _HUB_LOADERS[name](split)
        except DataError:
            raise
        except Exception as err:  # offline, not cached, network or hub failure
            raise data_unavailable(
                f"hub corpus {name!r} (split {split!r})", err,
                f"a bundled corpus ({format_choices(BUNDLED_CORPORA)}) or a local .txt/.jsonl "
                "file") from err
    elif _looks_like_path(name):
        docs = _load_local(Path(name), split)
    else:
        raise UnknownCorpusError(
            f"unknown corpus {name!r}; expected one of the bundled corpora "
            f"({format_choices(BUNDLED_CORPORA)}), a hub corpus "
            f"({format_choices(HUB_CORPORA)}), or a path to an existing .txt/.jsonl file or to a "
            "directory holding <split>.txt or <split>.jsonl"
        )
    _check_not_empty(docs, f"corpus {name!r} split {split!r}")
    logger.debug("loaded corpus %r split %r: %d documents", name, split, len(docs))
    return docs


# --------------------------------------------------------------------------------------------
# helpers


def _check_split(name: str, split: str, available: Sequence[str]) -> None:
    if split not in available:
        raise UnknownSplitError(
            f"corpus {name!r} has no split {split!r}; expected one of {format_choices(available)}"
        )


def _check_not_empty(docs: Sequence[Document], what: str) -> None:
    if not docs or not any(doc.text.strip() for doc in docs):
        raise EmptyCorpusError(f"{what} holds no text ({len(docs)} documents, all empty)")


def _looks_like_path(name: str) -> bool:
    path = Path(name)
    return path.exists() or path.suffix in _LOCAL_SUFFIXES or "/" in name or "\\" in name


# --------------------------------------------------------------------------------------------
# local files


#: A split of a local corpus folder is the name of a file in it (``<split>.jsonl``): letters,
#: digits, ``_`` and ``-`` only, so that no split reaches outside the folder.
SPLIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def _load_local(path: Path, split: str) -> list[Document]:
    if not SPLIT_NAME.fullmatch(str(split)):
        raise UnknownSplitError(
            f"split {split!r} is not a split name: expected letters, digits, '_' or '-' (a "
            "split names a file <split>.jsonl or <split>.txt inside the corpus folder, never "
            "a path)")
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in _LOCAL_SUFFIXES]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise UnknownSplitError(
                f"corpus directory {str(path)!r} has no split {split!r}: expected "
                f"{format_choices(str(c) for c in candidates)}"
            )
        if len(found) > 1:
            raise CorpusFormatError(
                f"corpus directory {str(path)!r} has both {found[0].name} and {found[1].name} for "
                f"split {split!r}; keep only one"
            )
        file = found[0]
    elif path.is_file():
        file = path
        logger.info("local corpus file %s is used as split %r", file, split)
    else:
        raise UnknownCorpusError(
            f"corpus path {str(path)!r} does not exist; expected a .txt/.jsonl file or a "
            "directory holding <split>.txt or <split>.jsonl"
        )

    if file.suffix == ".txt":
        docs = _read_txt_documents(file)
    elif file.suffix == ".jsonl":
        docs = _read_jsonl_documents(file, source=str(file), default_id_prefix=file.stem)
    else:
        raise UnknownCorpusError(
            f"corpus file {str(file)!r} has suffix {file.suffix!r}; expected "
            f"{format_choices(_LOCAL_SUFFIXES)}"
        )
    _check_not_empty(docs, f"corpus file {str(file)!r}")
    return docs


def _read_txt_documents(path: Path) -> list[Document]:
    """Documents are the runs of text between blank lines (lines empty or only spaces/tabs)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise CorpusFormatError(f"corpus file {str(path)!r} is not UTF-8 text: byte "
                                f"{err.object[err.start]:#04x} at offset {err.start} (line "
                                f"{line}); convert it with e.g. iconv -f latin1 -t utf-8") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    pieces = [piece.strip() for piece in _BLANK_LINES.split(text)]
    # Only the (possibly empty) edges of the file can be empty after splitting on blank lines.
    pieces = [piece for piece in pieces if piece]
    return [
        Document(id=f"{path.stem}-{i}", title=None, text=piece, source=str(path))
        for i, piece in enumerate(pieces)
    ]


def _read_jsonl_documents(path: Path, source: str, default_id_prefix: str) -> list[Document]:
    docs: list[Document] = []
    seen: set[str] = set()
    for line_number, record in read_jsonl(path, CorpusFormatError):
        text = record.get("text")
        if not isinstance(text, str):
            raise CorpusFormatError(
                f"{path}:{line_number}: field 'text' must be a string, got {text!r:.80}"
            )
        doc_id = record.get("id", f"{default_id_prefix}-{len(docs)}")
        if not isinstance(doc_id, str):
            raise CorpusFormatError(
                f"{path}:{line_number}: field 'id' must be a string, got {doc_id!r}"
            )
        if doc_id in seen:
            raise CorpusFormatError(f"{path}:{line_number}: duplicate document id {doc_id!r}")
        seen.add(doc_id)
        title = record.get("title")
        if title is not None and not isinstance(title, str):
            raise CorpusFormatError(
                f"{path}:{line_number}: field 'title' must be a string or null, got {title!r}"
            )
        docs.append(Document(id=doc_id, title=title, text=text, source=source))
    return docs


# --------------------------------------------------------------------------------------------
# hub loaders (network; never called by the tests, which patch datasets.load_dataset)


def _load_dataset(*args: Any, **kwargs: Any) -> Any:
    import datasets  # imported lazily: slow to import and only needed online

    arguments = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    logger.info("datasets.load_dataset(%s)", ", ".join(arguments))
    return datasets.load_dataset(*args, **kwargs)


def _load_wikitext2(split: str) -> list[Document]:
    rows = _load_dataset(*WIKITEXT2_DATASET, split=split)["text"]
    return [
        Document(id=f"wikitext2-{split}-{i}", title=None, text=row, source="wikitext2")
        for i, row in enumerate(rows)
    ]


def _load_c4(split: str) -> list[Document]:
    dataset = _load_dataset(C4_DATASET, data_files={split: C4_DATA_FILES[split]}, split=split)
    if split == "validation":
        texts = dataset[:C4_VALIDATION_DOCUMENTS]["text"]
        if len(texts) < C4_VALIDATION_DOCUMENTS:
            raise EmptyCorpusError(
                f"corpus 'c4' split 'validation': expected at least {C4_VALIDATION_DOCUMENTS} "
                f"records in {C4_DATA_FILES['validation']}, got {len(texts)}"
            )
        return [Document(id="c4-validation", title=None, text=" ".join(texts), source="c4")]
    return [
        Document(id=f"c4-{split}-{i}", title=None, text=text, source="c4")
        for i, text in enumerate(dataset["text"])
    ]


def _load_ptb(split: str) -> list[Document]:
    sentences = _load_dataset(*PTB_DATASET, split=split)["sentence"]
    return [Document(id=f"ptb-{split}", title=None, text=" ".join(sentences), source="ptb")]


_HUB_LOADERS: dict[str, Callable[[str], list[Document]]] = {
    "wikitext2": _load_wikitext2,
    "c4": _load_c4,
    "ptb": _load_ptb,
}
