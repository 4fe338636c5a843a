"""Zero-shot tasks and perplexity corpora by name in every method (issue 18, item 4): the
shared task settings, a name that cannot load fails before the run, PrunePrivyTune's classify
objective refuses tasks, and the end-to-end records of personalized pruning and PPC-GPT carry
acc_<task> (a local YAML task and a bundled one, tiny llama). Nothing touches the network."""

from __future__ import annotations

import importlib

import pytest
from test_eval_tasks import write_yaml_task

from fedcompress.config import SettingsError
from fedcompress.data import corpora
from fedcompress.data.errors import DataUnavailableError, UnknownTaskError
from fedcompress.eval.common import hub_offline
from fedcompress.methods import get_method, methods
from fedcompress.methods.evaluation import TaskEvalSettings, task_fields

METHODS = ("fedprllm", "ppcgpt", "privytune", "personalize")
#: Settings a method needs for tasks to be allowed (PrunePrivyTune scores causal LMs only).
NEEDS = {"privytune": {"objective": "lm"}}


@pytest.fixture(scope="module")
def yaml_tasks(tmp_path_factory):
    """A folder with a local multiple-choice lm-eval task (local_mc) and one whose dataset is
    on the hub and not cached (hub_mc)."""
    folder = write_yaml_task(tmp_path_factory.mktemp("yaml"))
    write_yaml_task(folder, name="hub_mc", dataset_path="fedcompress-test/not-a-cached-dataset")
    return str(folder)


def _server(name: str):
    return importlib.import_module(get_method(name).server_module)


# -- one settings class, every method ---------------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_every_method_takes_the_task_settings_on_its_server(name):
    method = get_method(name)
    owners = {method.owner(k) for k in ("tasks", "tasks_path", "task_split", "task_limit")}
    assert len(owners) == 1 and issubclass(owners.pop(), TaskEvalSettings)
    assert not set(TaskEvalSettings.names()) & set(method.client_settings.names())  # not sent
    assert {k: method.defaults()[k] for k in TaskEvalSettings.names()} == \
        TaskEvalSettings.defaults()
    evals = next(p for p in method.parse({"tasks": "boolq,rte", "task_limit": 5, **NEEDS.get(
        name, {})}) if isinstance(p, TaskEvalSettings))
    assert evals.task_names == ["boolq", "rte"] and evals.task_limit == 5


def test_every_method_command_shows_the_options():
    from typer.testing import CliRunner

    from fedcompress.cli import app

    runner = CliRunner()
    for method in methods().values():
        result = runner.invoke(app, [method.command, "--help"],
                               env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        for option in ("--tasks ", "--tasks-path", "--task-split", "--task-limit"):
            assert option in result.output, (method.command, option)


# -- a name that cannot load fails before the run -----------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_a_bad_task_name_fails_the_settings_check(name, yaml_tasks):
    settings = {"tasks_path": yaml_tasks, **NEEDS.get(name, {})}
    with pytest.raises(UnknownTaskError, match="unknown task 'local_mx'.*local_mc"):
        _server(name).check_settings({**settings, "tasks": "local_mx"})
    with hub_offline(), pytest.raises(DataUnavailableError, match="lm-eval task 'hub_mc'"):
        _server(name).check_settings({**settings, "tasks": "local_mc,hub_mc"})
    _server(name).check_settings({**settings, "tasks": "local_mc"})


def test_the_simulation_stops_before_the_engine_starts(yaml_tasks, monkeypatch, tmp_path):
    import server.simulation as sim

    def engine(*args, **kwargs):
        raise AssertionError("the Simulation Engine started")

    monkeypatch.setattr(sim, "simulate", engine)
    with hub_offline(), pytest.raises(DataUnavailableError) as err:
        sim.simulate_method("personalize", {"tasks": "hub_mc", "tasks_path": yaml_tasks,
                                            "out": str(tmp_path / "run")})
    message = str(err.value)
    assert "lm-eval task 'hub_mc' cannot be loaded offline" in message
    assert "needs the internet" in message and "--tasks-path" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["ppcgpt", "privytune", "personalize"])
def test_the_server_run_loads_the_tasks_first(name, yaml_tasks, tmp_path, monkeypatch):
    """`flwr run` calls the ServerApp's run without check_settings: the tasks still load
    before any model (a failed run, no model loaded, the error in report.json)."""
    import json

    server = _server(name)
    monkeypatch.setattr(server, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    out = tmp_path / "run"
    with pytest.raises(UnknownTaskError):
        server.run(None, {"tasks": "local_mx", "tasks_path": yaml_tasks, "out": str(out),
                          **NEEDS.get(name, {})})
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["results"] == []


def test_privytune_classify_refuses_tasks(tmp_path):
    server = _server("privytune")
    for settings in ({"tasks": "strategyqa"}, {"tasks": "boolq", "objective": "classify"}):
        with pytest.raises(SettingsError, match=r"tasks='\w+' is invalid: expected none with "
                                                r"objective='classify'.*need objective='lm'"):
            server.check_settings(settings)
    server.check_settings({"tasks": "none"})  # no task: nothing to refuse
    with pytest.raises(SettingsError, match="need objective='lm'"):  # the run refuses too
        server.run(None, {"tasks": "strategyqa", "out": str(tmp_path / "run")})


# -- perplexity corpora by name ------------------------------------------------------------------
def _hub(monkeypatch, calls: list | None = None, offline: bool = False):
    text = "the king of the city was the first . " * 40

    def load(*args, **kwargs):
        if offline:
            raise ConnectionError("Couldn't reach the Hub (LocalEntryNotFoundError)")
        if calls is not None:
            calls.append((args, kwargs))
        return {"text": [text, ""], "sentence": [text, text]}

    monkeypatch.setattr(corpora, "_load_dataset", load)


def test_corpora_by_name_in_privytune_and_personalize(monkeypatch):
    """PrunePrivyTune's lm corpus (train, validation and test splits) and personalized
    pruning's site corpora (train, test) take wikitext2 / ptb; offline and not cached, the
    settings check fails with the DataUnavailableError naming the corpus."""
    calls: list = []
    _hub(monkeypatch, calls)
    _server("privytune").check_settings({"objective": "lm", "corpus": "wikitext2",
                                         "clients": 1})
    assert [c[1]["split"] for c in calls] == ["train", "validation", "test"]
    calls.clear()
    _server("personalize").check_settings({"calib_text": "wiki+ptb"})
    assert [(c[0], c[1]["split"]) for c in calls] == [(corpora.PTB_DATASET, "train"),
                                                      (corpora.PTB_DATASET, "test")]
    _hub(monkeypatch, offline=True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, settings, corpus in (
            ("privytune", {"objective": "lm", "corpus": "ptb"}, "ptb"),
            ("personalize", {"calib_text": "wiki+wikitext2"}, "wikitext2")):
        with pytest.raises(DataUnavailableError, match=f"hub corpus '{corpus}' .*cannot be "
                                                       "loaded offline"):
            _server(name).check_settings(settings)


# -- end to end: the records get acc_<task> -----------------------------------------------------
def test_personalize_scores_the_servers_models(tiny_dir, yaml_tasks, tmp_path):
    """The server scores the global models it holds (global plan, uniform FedPrLLM, dense); the
    sites' rows are unchanged; the summary shows the accuracy columns and says what is not
    scored."""
    from conftest import personalize_in_process, personalize_tiny_settings

    from fedcompress.methods.personalize import summary
    from fedcompress.models import load_model

    settings = personalize_tiny_settings(tiny_dir, tmp_path / "run", clients=2,
                                         baselines="fedprllm,dense", tasks="local_mc,strategyqa",
                                         tasks_path=yaml_tasks, task_limit=3)
    report = personalize_in_process(settings)
    assert report["status"] == "ok"
    sites = [r for r in report["results"] if "site" in r]
    held = [r for r in report["results"] if "site" not in r]
    assert [r["site"] for r in sites] == [0, 1] and all("acc_local_mc" not in r for r in sites)
    assert [r["name"] for r in held] == ["global-plan", "fedprllm", "dense"]
    for r in held:
        assert set(r["zero_shot"]) == {"local_mc", "strategyqa"}
        assert r["zero_shot"]["local_mc"]["n"] == 3 and r["zero_shot"]["strategyqa"]["n"] == 3
        assert r["mean_acc"] == pytest.approx((r["acc_local_mc"] + r["acc_strategyqa"]) / 2)
    assert held[0]["sparsity"] == pytest.approx(0.5, abs=0.04) and held[2]["sparsity"] < 0.01
    loaded = load_model(tiny_dir, device="cpu")  # the dense record is the model as loaded
    evals = TaskEvalSettings(tasks="local_mc,strategyqa", tasks_path=yaml_tasks, task_limit=3)
    expected = task_fields(evals.load_tasks(), evals, loaded.model, loaded.tokenizer,
                           batch_size=2, seed=0)
    assert {t: held[2][f"acc_{t}"] for t in held[2]["zero_shot"]} == \
        {t: expected[f"acc_{t}"] for t in expected["zero_shot"]}
    _, columns, rows, notes = summary(report)
    assert columns[-2:] == ["acc local_mc", "acc strategyqa"]
    assert rows[-1][0] == "server dense" and rows[-1][-1] == f"{held[2]['acc_strategyqa']:.4f}"
    assert rows[0][-1] == "-" and "not scored" in notes[-1]
    text = (tmp_path / "run" / "report.md").read_text()
    assert "## Zero-shot accuracy" in text and "personalized model" in text
    assert "acc_local_mc" in text


def test_ppcgpt_scores_llm_o_and_the_distilled_model(tiny_dir, yaml_tasks, tmp_path,
                                                     monkeypatch, openai_stub):
    """LLM_o and the server's distilled model (before the clients retrain it) are scored; with
    no dense baseline LLM_o still gets a ``dense`` record holding its zero-shot accuracy."""
    from conftest import ppcgpt_in_process, ppcgpt_tiny_settings, yes_no_generator
    from test_ppcgpt import tiny_sanitizer

    from fedcompress.methods import ppcgpt

    monkeypatch.setattr(ppcgpt, "sanitizer_for", lambda *a: tiny_sanitizer())
    with openai_stub(yes_no_generator) as stub:
        settings = ppcgpt_tiny_settings(tiny_dir, stub.url, tmp_path / "run")
        report = ppcgpt_in_process({**settings, "baselines": "none", "save_model": False,
                                    "tasks": "local_mc", "tasks_path": yaml_tasks})
    assert report["status"] == "ok"
    fed, dense = report["results"]
    assert (fed["name"], dense["name"]) == ("ppcgpt", "dense")
    assert 0 <= fed["acc_server"] <= 1 and 0 <= fed["acc_client"] <= 1  # S and C kept
    assert fed["zero_shot"]["local_mc"]["n"] == 4 and dense["zero_shot"]["local_mc"]["n"] == 4
    assert (fed["layers"], dense["layers"]) == (2, 3)
    assert "acc_client" not in dense and "zero_shot" in report["timings"]
    _, columns, rows, notes = ppcgpt.summary(report)
    assert columns[-1] == "acc local_mc" and rows[1][3] == "-"
    assert rows[0][-1] == f"{fed['acc_local_mc']:.4f}" and "before the clients retrain" in \
        notes[-1]


def test_privytune_lm_scores_the_initial_final_and_central_models(tiny_dir, yaml_tasks,
                                                                    tmp_path):
    """objective lm: the initial model (layers removed, before fine-tuning), the final global
    model and the central baseline get acc_<task>; the initial record takes round 0's
    perplexity."""
    from conftest import privytune_in_process, privytune_tiny_settings

    from fedcompress.methods.privytune import summary

    settings = privytune_tiny_settings(
        tiny_dir, "unused", tmp_path / "run", objective="lm", corpus="wiki", rounds=1,
        train_examples=8, eval_examples=4, similarity_source="public", attack_samples=0,
        epsilon=0.0, save_model=False, tasks="local_mc", tasks_path=yaml_tasks)
    report = privytune_in_process(settings)
    assert report["status"] == "ok"
    assert [r["name"] for r in report["results"]] == ["initial", "federated", "central"]
    initial, fed, central = report["results"]
    assert initial["perplexity"] == report["rounds"][0]["perplexity"]
    assert initial["layers"] == fed["layers"] == central["layers"] == 2
    for r in report["results"]:
        assert r["zero_shot"]["local_mc"]["n"] == 4 and r["mean_acc"] == r["acc_local_mc"]
    _, columns, rows, _ = summary(report)
    assert columns[-1] == "acc local_mc" and rows[0][5] == "-"  # no seconds for initial
    assert [row[-1] for row in rows] == [f"{r['acc_local_mc']:.4f}" for r in report["results"]]
