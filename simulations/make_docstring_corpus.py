"""Build a text corpus of our own, offline: the docstrings of Python's standard library.

English technical prose unlike the bundled corpora (Wikipedia, Shakespeare, code), for studies
that need a setting other than the committed ones (``simulations/bench_personalized_guard.toml``).
The files are parsed with :mod:`ast` (nothing is imported or run); each module with at least
``--min-chars`` of docstrings (its own, then its classes' and functions', in source order) is
one document; a module goes to ``test.jsonl`` when the first byte of the SHA-256 of its name is
below ``256 * --test-share``, else to ``train.jsonl``. The same Python version gives the same
files: ``corpus.json`` beside them names it and the files' hashes.

    python simulations/make_docstring_corpus.py --out runs/corpora/pydoc
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger("make_docstring_corpus")

#: Folders of the standard library whose files are tests, demos or vendored code, not its API.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "__pycache__", "turtledemo", "ensurepip", "pydoc_data"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def docstrings(source: str) -> list[str]:
    """The module's docstring, then its classes' and functions' in source order."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append((getattr(node, "lineno", 0), doc))
    return list(dict.fromkeys(doc for _, doc in sorted(found, key=lambda item: item[0])))


def build(root: Path, min_chars: int, test_share: float) -> dict[str, list[dict]]:
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            text = "\n\n".join(docstrings(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError) as err:
            logger.warning("skipped %s: %s", path, err)
            continue
        if len(text) < min_chars:
            continue
        name = module_name(path, root)
        split = "test" if hashlib.sha256(name.encode()).digest()[0] < 256 * test_share else "train"
        splits[split].append({"id": f"pydoc-{name}", "title": name, "text": text})
    return splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/corpora/pydoc", help="folder for train.jsonl "
                        "and test.jsonl (a corpus path fedcompress reads)")
    parser.add_argument("--min-chars", type=int, default=400,
                        help="fewest characters of docstrings for a module to count")
    parser.add_argument("--test-share", type=float, default=0.2,
                        help="share of the modules in the test split, by name hash")
    opts = parser.parse_args(argv)
    if not 0 < opts.test_share < 1:
        parser.error(f"--test-share {opts.test_share}: expected a number in (0, 1)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    root = Path(sysconfig.get_paths()["stdlib"])
    splits = build(root, opts.min_chars, opts.test_share)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"python": sys.version.split()[0], "stdlib": str(root),
               "command": "python simulations/make_docstring_corpus.py " + " ".join(
                   sys.argv[1:] if argv is None else argv), "splits": {}}
    for split, docs in splits.items():
        if not docs:
            raise SystemExit(f"no module in the {split} split: lower --min-chars")
        data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
        (out / f"{split}.jsonl").write_bytes(data)
        summary["splits"][split] = {"documents": len(docs),
                                    "characters": sum(len(d["text"]) for d in docs),
                                    "sha256": hashlib.sha256(data).hexdigest()}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("wrote %s: %s", out, summary["splits"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
