"""Which of the project's pinned packages the package registry still serves (a maintainer tool:
not part of the installed package or the FAB).

Usage::

    python tools/check_pins.py            # every pin; exit 1 naming those not served
    python tools/check_pins.py --quiet    # only the pins that are not served

The pins are the ``name==version`` requirements of ``pyproject.toml`` (dependencies and every
extra) and of the ``Makefile`` (the embedded model packages and the CPU torch). Each is looked up
with ``pip index versions NAME``, so with pip's own configuration (index, find-links,
constraints): the registry ``make install`` installs from. ``make install`` runs this when an
install fails, so that the message names every pin that can no longer be installed, where it
is pinned and what the registry serves instead. Registries drop releases (PyPI no longer serves
bigbench 1.0.0): a pin that was installable last month may not be today.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;,]+)\s*(;.*)?$")
MAKEFILE_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s'\"]*)")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    where: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def pins(root: Path = ROOT) -> list[Pin]:
    """Every ``name==version`` pin of ``pyproject.toml`` and the ``Makefile``, once each (the
    first place it is pinned), in file order."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found: dict[str, Pin] = {}
    groups = {"dependencies": project.get("dependencies", [])}
    groups |= {f"optional-dependencies.{k}": v
               for k, v in project.get("optional-dependencies", {}).items()}
    for group, requirements in groups.items():
        for requirement in requirements:
            match = PIN.match(requirement)
            if match is None:
                raise ValueError(f"pyproject.toml [{group}]: {requirement!r} is not pinned "
                                 "(expected name==version)")
            name, version = match.group(1), match.group(3)
            found.setdefault(name.lower(), Pin(name, version, f"pyproject.toml {group}"))
    for number, line in enumerate((root / "Makefile").read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        for name, version in MAKEFILE_PIN.findall(line):
            found.setdefault(name.lower(), Pin(name, version, f"Makefile line {number}"))
    return list(found.values())


def served_versions(name: str, python: str = sys.executable) -> list[str] | None:
    """The versions of ``name`` that pip's configured registry serves (None: pip could not
    tell, e.g. the registry is unreachable)."""
    out = subprocess.run([python, "-m", "pip", "index", "versions", name, "--pre"],
                         capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    if "No matching distribution" in out.stderr:
        return []
    return None


def check(pin_list: Sequence[Pin], python: str = sys.executable, jobs: int = 8
          ) -> list[tuple[Pin, list[str] | None]]:
    """Each pin with the versions the registry serves (looked up ``jobs`` at a time)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        versions = list(pool.map(lambda pin: served_versions(pin.name, python), pin_list))
    return list(zip(pin_list, versions, strict=True))


def describe(pin: Pin, versions: list[str] | None) -> str | None:
    """A line naming a pin that is not served (None when it is)."""
    if versions is None:
        return (f"{pin.requirement} ({pin.where}): the registry did not answer for "
                f"{pin.name!r}; check the network or pip's index settings")
    if pin.version in versions:
        return None
    served = ", ".join(versions[:8]) + (", ..." if len(versions) > 8 else "")
    return (f"{pin.requirement} ({pin.where}): NOT SERVED by the registry any more; it serves "
            f"{served or 'no version at all'}. Move the pin to a served release (and check what "
            "depends on it), or install it from a copy of your own")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/check_pins.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="print only the pins not served")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter whose pip (and pip configuration) looks them up")
    args = parser.parse_args(argv)
    results = check(pins(), args.python)
    missing = [line for pin, versions in results if (line := describe(pin, versions))]
    if not args.quiet:
        for pin, versions in results:
            if describe(pin, versions) is None:
                print(f"ok  {pin.requirement} ({pin.where})")
    for line in missing:
        print(f"error: {line}", file=sys.stderr)
    if missing:
        print(f"{len(missing)} of {len(results)} pinned package(s) cannot be installed from the "
              "registry", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"all {len(results)} pinned packages are served by the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
