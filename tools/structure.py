"""The code's structure, from its own imports: the graph the structure test checks, and the
drawing of it in ``docs/architecture.md``.

    python tools/structure.py            # rewrite the drawing between its markers in the doc
    python tools/structure.py --check    # exit 1 if the drawing differs from the code

A module's imports are read from its source (:func:`imported`: anywhere in it, inside
functions too; not those under ``if TYPE_CHECKING:``), nothing is imported. The drawing groups
the modules into parts (:func:`part`: the Flower layers, each subpackage of ``fedcompress``,
its top modules) and lists, part by part from the bottom up, the parts each one imports;
``tests/test_structure.py`` keeps it current and the module graph free of cycles.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The library and the Flower app (what a user imports or a SuperNode runs).
PACKAGES = ("fedcompress", "clients", "server", "strategies")
MAX_LINES = 800


def sources() -> dict[str, Path]:
    """``{module name: file}`` of every module of :data:`PACKAGES`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in it (a
    package's ``from pkg import module`` counts as importing the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # ``from pkg import module`` imports the module; ``from pkg import name``, pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (imports for the type
    checker only: no cycle at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, a package's ``__init__`` left out as a target when
    it only re-exports (an edge to a package is an edge to its ``__init__``)."""
    files = sources()
    known = set(files)
    return {name: imported(path, name, known) for name, path in files.items()}



DOC = REPO / "docs" / "architecture.md"
BEGIN = "<!-- structure: written by python tools/structure.py -->"
END = "<!-- /structure -->"
#: The Flower layers, each one part.
FLOWER = ("clients", "server", "strategies")


def part(module: str) -> str:
    """The part of the drawing a module belongs to: a Flower layer, a subpackage of
    ``fedcompress`` (``fedcompress/pruning``), or a top module of it (the report page's modules
    ``report_*`` together: they draw a bench's results, so they sit above ``bench``, which
    writes ``report``'s records)."""
    top, _, rest = module.partition(".")
    if top in FLOWER:
        return top
    if not rest:
        return "fedcompress/__init__"
    head = rest.split(".")[0]
    if head.startswith("report_"):
        head = "report_*"
    return f"fedcompress/{head}"


def part_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Part -> the other parts its modules import."""
    graph = import_graph() if graph is None else graph
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = part(module)
        parts.setdefault(mine, set()).update(part(t) for t in targets if part(t) != mine)
    return parts


def levels(parts: dict[str, set[str]]) -> dict[str, int]:
    """Each part's height: 0 for one that imports no other part, else one more than the
    highest it imports (parts in one cycle share a height)."""
    height: dict[str, int] = {}
    members = {p: c for c in cycles(parts) for p in c}

    def of(p: str, seen: frozenset[str] = frozenset()) -> int:
        if p in height:
            return height[p]
        group = set(members.get(p, [p]))
        below = {t for g in group for t in parts[g]} - group
        h = max((of(t, seen | group) + 1 for t in below if t not in seen), default=0)
        for g in group:
            height[g] = h
        return h

    for p in sorted(parts):
        of(p)
    return height


def drawing(parts: dict[str, set[str]] | None = None) -> str:
    """The parts by height, each with the parts it imports (the text between the markers)."""
    parts = part_graph() if parts is None else parts
    height = levels(parts)
    width = max(len(p) for p in parts)
    lines = ["```text", "height  part" + " " * (width - 3) + "imports"]
    for p in sorted(parts, key=lambda p: (-height[p], p)):
        targets = ", ".join(t.removeprefix("fedcompress/") if t.startswith("fedcompress/")
                            else t for t in sorted(parts[p], key=lambda t: (-height[t], t)))
        lines.append(f"{height[p]:>6}  {p:<{width}}  {targets or '-'}")
    lines.append("```")
    return "\n".join(lines)


def rewritten(text: str, drawn: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: expected the markers {BEGIN!r} and {END!r}")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{drawn}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the drawing in the doc differs from the code")
    opts = p.parse_args(argv)
    text = DOC.read_text()
    new = rewritten(text, drawing())
    if opts.check:
        if new != text:
            print(f"{DOC.relative_to(REPO)}: the structure drawing is stale: run "
                  "`python tools/structure.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
