"""The code's shape, kept: no file of the library or the Flower app above 800 lines, no
import cycle between its modules (an import inside a function counts: it holds a cycle
together as much as one at the top; one for the type checker alone does not), and no settings
class above 25 settings (a larger one is split into pieces that a composition joins). The
graph is read by ``tools/structure.py``, which also draws it in ``docs/architecture.md``."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fedcompress_structure",
                                               REPO / "tools" / "structure.py")
structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(structure)
MAX_LINES = structure.MAX_LINES
#: The most settings one settings class (a piece) may declare.
MAX_SETTINGS = 25


def test_no_file_above_the_limit():
    long = {str(p.relative_to(REPO)): n for p in structure.sources().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files above {MAX_LINES} lines: {long}"


def test_no_import_cycle():
    found = structure.cycles(structure.import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_two_parts_import_each_other():
    """Parts too: pruning and quantization share the solver below both (``fedcompress/solver``)
    rather than import each other, the report page sits above the bench."""
    found = structure.cycles(structure.part_graph())
    assert not found, "parts importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_old_imports_of_the_moved_solver_still_work():
    from fedcompress.pruning import scores, select
    from fedcompress.solver import obs
    from fedcompress.solver import select as solver_select

    assert select.select_prune_mask is solver_select.select_prune_mask
    assert select.parse_nm is solver_select.parse_nm
    assert scores.obs_sweep is obs.obs_sweep and scores.CholeskyError is obs.CholeskyError
    assert scores.SPARSEGPT_MAX_DAMP_RETRIES == obs.MAX_DAMP_RETRIES


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder(graph, expected):
    assert structure.cycles(graph) == expected


def test_the_drawing_in_the_docs_is_the_codes():
    """``docs/architecture.md`` draws the parts and what each imports, as the code has them
    (``python tools/structure.py`` rewrites it)."""
    text = structure.DOC.read_text()
    assert structure.rewritten(text, structure.drawing()) == text, (
        "the structure drawing in docs/architecture.md is stale: run "
        "`python tools/structure.py`")


def test_the_drawing_orders_parts_by_height():
    parts = {"server": {"strategies", "fedcompress/masks"}, "strategies": {"fedcompress/masks"},
             "fedcompress/masks": {"fedcompress/pruning"}, "fedcompress/pruning": set()}
    assert structure.levels(parts) == {"server": 3, "strategies": 2, "fedcompress/masks": 1,
                                       "fedcompress/pruning": 0}
    lines = structure.drawing(parts).splitlines()
    assert [line.split()[1] for line in lines[2:-1]] == ["server", "strategies",
                                                         "fedcompress/masks",
                                                         "fedcompress/pruning"]
    assert lines[2].split()[2:] == ["strategies,", "masks"]
    assert structure.part("fedcompress.report_page") == "fedcompress/report_*"
    assert structure.part("fedcompress.report") == "fedcompress/report"
    assert structure.part("clients.local") == "clients"


def settings_classes() -> set[type]:
    """Every settings class of the library: each module of ``fedcompress`` imported, then the
    subclasses of :class:`fedcompress.config.Settings` that its modules define."""
    from fedcompress.config import Settings

    for name in structure.sources():
        if name.split(".")[0] == "fedcompress":
            importlib.import_module(name)
    found, todo = set(), [Settings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {c for c in found if c.__module__.split(".")[0] == "fedcompress"}


def test_no_settings_class_above_the_limit():
    """A piece (a class that is its own piece) declares at most MAX_SETTINGS settings; a
    composition (of several pieces) may hold more, each of its pieces within the limit."""
    classes = settings_classes()
    assert {"PPCGPTConfig", "PrivyTuneConfig", "PersonalizeConfig", "FedPrLLMConfig",
            "TaskEvalSettings"} <= {c.__name__ for c in classes}
    pieces = {piece for cls in classes for piece in cls.pieces()}
    assert all(piece.pieces() == (piece,) for piece in pieces)
    large = {f"{c.__module__}.{c.__qualname__}": len(c.names()) for c in pieces
             if len(c.names()) > MAX_SETTINGS}
    assert not large, f"settings classes above {MAX_SETTINGS} settings: {large}"
