"""Regenerate ``[tool.flwr.app.config]`` in ``pyproject.toml`` from the method registry.

    python tools/flwr_config.py          # rewrite the table in place
    python tools/flwr_config.py --check  # exit 1 if the table differs from the registry

The table is the Flower run config's defaults: ``method`` (the default method) and one
``[tool.flwr.app.config.<method>]`` table per method, whose keys and values are the method's
settings classes' (``fedcompress/methods/``), the only place defaults are written. Run it after
adding a method or changing a default; ``tests/test_methods.py`` checks that they agree.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import tomli_w

from fedcompress.methods import run_config_table

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HEADER = "[tool.flwr.app.config]"


def rendered() -> str:
    return tomli_w.dumps({"tool": {"flwr": {"app": {"config": run_config_table()}}}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare, change nothing")
    args = parser.parse_args()
    text = PYPROJECT.read_text()
    current = tomllib.loads(text)["tool"]["flwr"]["app"].get("config")
    if args.check:
        same = current == run_config_table()
        print("pyproject.toml's run config table", "agrees" if same else "DIFFERS",
              "with the method registry")
        return 0 if same else 1
    if HEADER not in text:
        sys.exit(f"{PYPROJECT}: no {HEADER} table to replace (it must be the file's last table)")
    PYPROJECT.write_text(text[:text.index(HEADER)] + rendered())
    print(f"wrote {HEADER} ({len(run_config_table()) - 1} methods) to {PYPROJECT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
