"""The method registry and the shared settings base: one home per method, one set of defaults.

Every default lives in a method's settings classes; the CLI options, the ServerApp settings and
the ``[tool.flwr.app.config]`` table are derived from them (checked here), values from every
source are converted the same way, and bad input is an error naming the value.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import ClassVar

import pytest

from fedcompress.config import Settings, SettingsError, convert, setting
from fedcompress.methods import (
    Method,
    MethodError,
    RunConfigError,
    get_method,
    methods,
    run_config_table,
    settings_from_run_config,
)

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Toy(Settings):
    label: ClassVar[str] = "toy"

    clients: int = setting(4, "Number of clients.", ge=1)
    ratio: float = setting(0.5, "A ratio.", ge=0.0, lt=1.0)
    mode: str = setting("a", "A or b.", choices=("a", "b"))
    flag: bool = setting(False, "A flag.")
    minimum: int = setting(0, "At most clients.", ge=0)

    def validate(self) -> None:
        if self.minimum > self.clients:
            raise self.invalid("minimum", f"at most clients={self.clients}")


# -- the settings base ------------------------------------------------------------------------
@pytest.mark.parametrize("kind, value, expected", [
    (int, 3, 3), (int, 3.0, 3), (int, "3", 3), (float, 2, 2.0), (float, "0.25", 0.25),
    (bool, True, True), (bool, "false", False), (bool, "YES", True), (bool, "1", True),
    (str, "x", "x"),
])
def test_convert_is_the_same_for_every_source(kind, value, expected):
    got = convert(kind, "k", value)
    assert got == expected and type(got) is kind


@pytest.mark.parametrize("kind, value", [
    (int, True), (int, 2.5), (int, "two"), (float, False), (float, "x"), (bool, "maybe"),
    (bool, 1), (str, 3), (int, None),
])
def test_convert_refuses_with_the_value_named(kind, value):
    with pytest.raises(SettingsError, match=rf"k={value!r} is invalid: expected"):
        convert(kind, "k", value)


def test_from_dict_converts_checks_and_rejects_unknown_keys():
    toy = Toy.from_dict({"clients": "8", "ratio": 0, "flag": "true", "mode": "b"})
    assert toy == Toy(clients=8, ratio=0.0, flag=True, mode="b")
    assert type(toy.ratio) is float
    with pytest.raises(SettingsError, match=r"unknown toy setting\(s\) \['colour'\]: expected "
                                            r"some of \['clients', 'flag'"):
        Toy.from_dict({"colour": "red"})
    with pytest.raises(SettingsError, match=r"ratio=1.0 is invalid: expected a number in "
                                            r"\[0, 1\)"):
        Toy(ratio=1.0)
    with pytest.raises(SettingsError, match="clients=0 is invalid: expected an integer >= 1"):
        Toy.from_dict({"clients": 0})
    with pytest.raises(SettingsError, match="mode='c' is invalid: expected one of 'a', 'b'"):
        Toy(mode="c")
    with pytest.raises(SettingsError, match="minimum=5 is invalid: expected at most clients=4"):
        Toy(minimum=5)
    with pytest.raises(SettingsError, match="ratio=nan"):
        Toy(ratio=float("nan"))
    with pytest.raises(SettingsError, match="clients='4' is invalid"):
        Toy(clients="4")  # the constructor takes typed values; from_dict converts


def test_defaults_and_help_come_from_the_fields():
    assert Toy.defaults() == {"clients": 4, "ratio": 0.5, "mode": "a", "flag": False,
                              "minimum": 0}
    assert Toy.spec("clients").help == "Number of clients."
    assert Toy.names() == ["clients", "ratio", "mode", "flag", "minimum"]


@dataclasses.dataclass(frozen=True)
class Budget(Settings):
    label: ClassVar[str] = "budget"

    seconds: float = setting(1.0, "Seconds.", gt=0.0)
    retries: int = setting(0, "Retries (none without seconds above 1).", ge=0)

    def validate(self) -> None:
        if self.retries and self.seconds <= 1:
            raise self.invalid("retries", "0 with seconds <= 1")


@dataclasses.dataclass(frozen=True)
class ToyRun(Toy, Budget):
    label: ClassVar[str] = "toy run"

    def validate(self) -> None:
        if self.retries > self.clients:
            raise self.invalid("retries", f"at most clients={self.clients}")


def test_a_composition_of_pieces_keeps_their_keys_checks_and_order():
    assert ToyRun.pieces() == (Toy, Budget)
    assert Toy.pieces() == (Toy,)
    assert ToyRun.names() == [*Toy.names(), *Budget.names()]
    assert list(ToyRun.defaults()) == ToyRun.names() == list(ToyRun().to_dict())
    run = ToyRun.from_dict({"clients": "8", "seconds": 2, "retries": 3})
    assert run.piece(Budget) == Budget(seconds=2.0, retries=3)
    assert run.piece(Toy) == Toy(clients=8)
    assert ToyRun.owner("retries") is Budget and ToyRun.owner("mode") is Toy
    with pytest.raises(TypeError, match="Settings is not a piece of ToyRun"):
        run.piece(Settings)
    # each piece's own checks, then the composition's checks across pieces
    with pytest.raises(SettingsError, match="minimum=5 is invalid: expected at most clients=4"):
        ToyRun(minimum=5)
    with pytest.raises(SettingsError, match="retries=1 is invalid: expected 0 with seconds"):
        ToyRun(retries=1)
    with pytest.raises(SettingsError, match="retries=5 is invalid: expected at most clients=4"):
        ToyRun(seconds=2.0, retries=5)
    with pytest.raises(SettingsError, match=r"unknown toy run setting\(s\) \['colour'\]"):
        ToyRun.from_dict({"colour": "red"})


def test_fedprllms_settings_are_pieces_of_at_most_25():
    """FedPrLLM's 60-odd settings, each declared once in a piece of its subject; the
    composition adds no field of its own."""
    from fedcompress.methods.fedprllm.config import FedPrLLMConfig

    pieces = FedPrLLMConfig.pieces()
    assert len(pieces) == 8
    names = [n for piece in pieces for n in piece.names()]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(FedPrLLMConfig))
    assert len(names) == len(set(names))
    assert max(len(piece.names()) for piece in pieces) <= 25


@pytest.mark.parametrize("name", ["fedprllm", "ppcgpt", "privytune", "personalize"])
def test_every_flat_setting_parses_from_every_source(name):
    """Every flat key of a method's settings (each piece's, for a composition), with ``_`` or
    ``-``, from a command line's text, a run config's value or the pyproject table; a
    composition's flat keys are its pieces' and its defaults theirs."""
    method = get_method(name)
    for cls in method.settings:
        assert cls.names() == [n for piece in cls.pieces() for n in piece.names()]
        assert cls.defaults() == {n: v for piece in cls.pieces()
                                  for n, v in piece.defaults().items()}
        for key, default in cls.defaults().items():
            text = str(default).lower() if isinstance(default, bool) else str(default)
            for flat in (key, key.replace("_", "-")):
                assert getattr(cls.from_dict({flat: text}), key) == default, (flat, text)
                assert getattr(cls.from_dict({flat: default}), key) == default
    parsed = method.parse(method.run_config_defaults())
    assert [p.to_dict() for p in parsed] == [cls().to_dict() for cls in method.settings]


@pytest.mark.parametrize("name", ["fedprllm", "ppcgpt", "privytune", "personalize"])
def test_cli_lists_each_pieces_options_under_its_heading(name):
    import typer.main

    from fedcompress import cli

    method = get_method(name)
    command = next(c for c in typer.main.get_command(cli.app).commands.values()
                   if c.name == method.command)
    options = {p.name: p for p in command.params}
    for cls in method.settings:
        for piece in cls.pieces():
            heading = piece.label[:1].upper() + piece.label[1:]
            assert {options[n].rich_help_panel for n in piece.names()} == {heading}


# -- the registry -----------------------------------------------------------------------------
def test_registry_knows_every_method_once():
    known = methods()
    assert set(known) >= {"fedprllm", "ppcgpt"}
    assert len({m.command for m in known.values()}) == len(known)
    actions = [a for m in known.values() for a in m.actions]
    assert len(actions) == len(set(actions))
    with pytest.raises(MethodError, match="unknown method 'nope': expected one of fedprllm"):
        get_method("nope")


def test_a_method_declaring_a_setting_twice_is_refused():
    with pytest.raises(MethodError, match="setting 'clients' is declared by both Toy and Toy"):
        Method("x", "x", "", (Toy, Toy), {}, {}, "clients.x", "server.x")
    with pytest.raises(MethodError, match="action 'masks' is not"):
        Method("x", "x", "", (Toy,), {"masks": "f"}, {}, "clients.x", "server.x")


@pytest.mark.parametrize("name", ["fedprllm", "ppcgpt"])
def test_every_action_has_its_handler(name):
    import importlib

    method = get_method(name)
    module = importlib.import_module(method.client_module)
    server = importlib.import_module(method.server_module)
    for function in method.actions.values():
        assert callable(getattr(module, function))
    assert callable(server.run) and callable(server.check_settings)
    assert "clients" in method.client_settings.names()  # the simulation's node count


def test_the_one_client_app_serves_every_action():
    from clients.app import local_app

    registered = {key for key in local_app()._registered_funcs}  # Flower's registry of handlers
    for method in methods().values():
        assert set(method.actions) <= registered, (method.name, registered)


# -- one set of defaults ----------------------------------------------------------------------
def test_pyproject_run_config_table_is_the_methods_defaults():
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert table["config"] == run_config_table(), "run `python tools/flwr_config.py`"
    assert table["components"] == {"serverapp": "server.app:app", "clientapp": "clients.app:app"}


@pytest.mark.parametrize("name", ["fedprllm", "ppcgpt"])
def test_cli_options_are_the_methods_settings(name):
    import typer.main

    from fedcompress import cli

    method = get_method(name)
    command = next(c for c in typer.main.get_command(cli.app).commands.values()
                   if c.name == method.command)
    options = {p.name: p for p in command.params}
    for key, default in method.defaults().items():
        assert key in options, key
        shown = '""' if default == "" else default
        assert f"[default: {shown}]" in options[key].help.replace("\\", "")
    assert set(options) - set(method.defaults()) == {"cpus_per_client", "ray_address", "config",
                                                     "log_level"}


def test_settings_parse_into_the_methods_classes():
    fed = get_method("fedprllm")
    config, evals, server = fed.parse({"sparsity": "0.6", "eval-windows": 4, "out": "x"})
    assert (config.sparsity, evals.eval_windows, server.out) == (0.6, 4, "x")
    with pytest.raises(SettingsError, match=r"unknown fedprllm setting\(s\) \['eps'\]"):
        fed.parse({"eps": 1.0})
    with pytest.raises(SettingsError, match="baselines='dense,oracle' is invalid"):
        fed.parse({"baselines": "dense,oracle"})
    assert fed.parse({"baselines": "none"})[2].baseline_list() == []


# -- the Flower run config --------------------------------------------------------------------
def _run_config(**overrides) -> dict:
    from flwr.common.config import flatten_dict

    flat = flatten_dict(run_config_table())
    flat.update(overrides)
    return flat


def test_run_config_names_the_method_and_its_settings():
    method, settings = settings_from_run_config(_run_config(**{"fedprllm.sparsity": 0.7}))
    assert method.name == "fedprllm" and settings["sparsity"] == 0.7
    method, settings = settings_from_run_config(_run_config(method="ppcgpt",
                                                            **{"ppcgpt.eps": 1.0}))
    assert method.name == "ppcgpt" and settings["eps"] == 1.0
    assert method.parse(settings)[0].eps == 1.0


def test_run_config_errors_are_clear():
    with pytest.raises(RunConfigError, match="is a setting of method 'fedprllm', but this run's "
                                             "method is 'ppcgpt'"):
        settings_from_run_config(_run_config(method="ppcgpt", **{"fedprllm.sparsity": 0.7}))
    with pytest.raises(MethodError, match="unknown method 'prune'"):
        settings_from_run_config(_run_config(method="prune"))
    with pytest.raises(RunConfigError, match="no 'method' key"):
        settings_from_run_config({"fedprllm.sparsity": 0.5})
    with pytest.raises(RunConfigError, match="run config key 'sparsity'"):
        settings_from_run_config({"method": "fedprllm", "sparsity": 0.5})


# -- dependencies point one way ---------------------------------------------------------------
TOOLBOX = ("pruning", "masks", "layers", "privacy", "synth", "distill", "eval", "data",
           "models")


def _imports(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", TOOLBOX)
def test_the_toolbox_knows_no_method_and_no_flower(package):
    for path in sorted((REPO / "fedcompress" / package).rglob("*.py")):
        bad = {m for m in _imports(path)
               if m.startswith(("fedcompress.methods", "flwr", "clients", "server",
                                "strategies", "fedcompress.bench", "fedcompress.cli"))}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
        private = {m for m in _imports(path) if m.startswith("fedcompress.")
                   and any(part.startswith("_") for part in m.split(".")[2:])
                   and not m.startswith(f"fedcompress.{package}.")}
        assert not private, f"{path.relative_to(REPO)} uses another package's private {private}"


def test_no_flower_import_in_the_library_and_pruning_below_masks():
    for path in sorted((REPO / "fedcompress").rglob("*.py")):
        assert not {m for m in _imports(path) if m.startswith("flwr")}, path
    for path in sorted((REPO / "fedcompress" / "pruning").rglob("*.py")):
        assert not {m for m in _imports(path) if m.startswith("fedcompress.masks")}, path


@pytest.mark.parametrize("name", ["fedprllm", "ppcgpt"])
def test_message_keys_used_by_the_flower_files_are_declared(name):
    """Every record key the method's ClientApp handlers and strategy read or write is one of
    the keys its METHOD declares (one list of the wire's names)."""
    import re

    method = get_method(name)
    declared = set(method.message_keys.values())
    used = set()
    strategy = REPO / "strategies" / name  # a package (strategies/fedprllm/) or one module
    strategies = sorted(strategy.glob("*.py")) if strategy.is_dir() else [
        REPO / "strategies" / f"{name}.py"]
    for path in (REPO / "clients" / f"{name}.py", *strategies):
        text = path.read_text()
        used |= set(re.findall(r'content\["([a-z_]+)"\]', text))
        used |= set(re.findall(r'"([a-z_]+)": (?:ConfigRecord|ArrayRecord|MetricRecord)\(', text))
        used |= set(re.findall(r'RecordDict\(\{"([a-z_]+)"', text))
    assert used and used <= declared, sorted(used - declared)


def test_a_renamed_setting_keeps_its_old_name_as_an_alias():
    method = Method("toy", "toy", "", (Toy,), {}, {}, "clients.toy", "server.toy",
                    aliases={"num_clients": "clients"})
    (toy,) = method.parse({"num-clients": 7})
    assert toy.clients == 7
    (toy,) = method.parse({"num_clients": 7, "clients": 9})  # the current name wins
    assert toy.clients == 9


def test_deprecated_cli_option_warns_and_maps(monkeypatch, caplog):
    import logging

    import typer
    from typer.testing import CliRunner

    from fedcompress import cli

    method = Method("toy", "toy", "A toy.", (Toy,), {}, {}, "clients.toy", "server.toy",
                    aliases={"num_clients": "clients"})
    seen = {}
    monkeypatch.setattr(cli, "app", typer.Typer())
    monkeypatch.setattr(cli, "run_method", lambda name, settings: seen.update(settings))
    monkeypatch.setattr(cli, "_setup_logging", lambda level: None)
    cli._add_method_command(method)
    cli.app.command("noop")(lambda: None)  # a second command keeps typer's subcommand form
    with caplog.at_level(logging.WARNING, logger="fedcompress"):
        result = CliRunner().invoke(cli.app, ["toy", "--num-clients", "5"])
    assert result.exit_code == 0, result.output
    assert seen["clients"] == 5 and "--num-clients is deprecated: use --clients" in caplog.text


def test_run_config_key_no_method_has_is_an_error():
    with pytest.raises(RunConfigError, match="method 'ppcgpt' has no setting 'sparsity'"):
        settings_from_run_config(_run_config(**{"ppcgpt.sparsity": 0.5}))
