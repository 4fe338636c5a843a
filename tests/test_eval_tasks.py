"""Zero-shot tasks and perplexity corpora by name (issue 18, item 4): lm-eval tasks from local
YAML folders and, through a patched loader, from lm-eval's own task names; hub corpora by name
through a patched loader; a clear error for a name that cannot be loaded offline. Every model is
the tiny llama; nothing touches the network."""

from __future__ import annotations

import json

import pytest
import yaml

from fedcompress.data import corpora
from fedcompress.data.errors import DataUnavailableError, UnknownTaskError
from fedcompress.eval.common import hub_offline
from fedcompress.eval.tasks import STANDARD_TASKS, load_tasks, parse_names
from fedcompress.methods.fedprllm.config import EvalConfig, FedPrLLMConfig
from fedcompress.methods.fedprllm.experiment import prepare_experiment

RECORDS = [
    {"question": "the king of the city is", "choices": ["a king", "a river"], "label": 0},
    {"question": "the river of the city is", "choices": ["a queen", "a river"], "label": 1},
    {"question": "they had a war in the", "choices": ["year", "king", "river"], "label": 0},
    {"question": "the people of the city were", "choices": ["first", "new"], "label": 1},
]


def write_yaml_task(folder, name="local_mc", dataset_path="json", records=RECORDS):
    """A multiple-choice lm-eval task over a tiny JSONL file (dataset_path: json)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"task": name, "dataset_path": dataset_path, "output_type": "multiple_choice",
              "test_split": "train", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
              "doc_to_target": "label",
              "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
              "metadata": {"version": 1.0}}
    if dataset_path == "json":
        config["dataset_kwargs"] = {"data_files": {"train": str(data)}}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return folder


def _experiment(model_dir, **evals):
    config = FedPrLLMConfig(model=model_dir, seqlen=16, batch_size=2, clients=2,
                            samples_per_client=1, sparsity=0.5)
    return prepare_experiment(config, EvalConfig(eval_seqlen=16, eval_windows=2, **evals))


def test_names_parse():
    assert parse_names("boolq, rte,,none") == ["boolq", "rte"]
    assert parse_names("standard") == list(STANDARD_TASKS)
    assert parse_names("") == [] and parse_names(None) == []


def test_local_yaml_task_on_the_prune_path(tiny_dir, tmp_path):
    """--tasks NAME --tasks-path DIR: the same Experiment.evaluate as prune and bench scores
    the local lm-eval task next to a bundled task; acc_<task> columns and details."""
    folder = write_yaml_task(tmp_path / "yaml")
    exp = _experiment(tiny_dir, tasks="local_mc,strategyqa", tasks_path=str(folder),
                      task_limit=3)
    assert sorted(exp.tasks.lm_eval) == ["local_mc"] and list(exp.tasks.records) == ["strategyqa"]
    record = exp.evaluate("dense", exp.model)
    again = exp.evaluate("dense", exp.model)  # tasks are reused: the same scores
    assert record["zero_shot"]["local_mc"]["n"] == 3
    assert record["zero_shot"]["strategyqa"]["n"] == 3
    assert 0.0 <= record["acc_local_mc"] <= 1.0 and 0.0 <= record["acc_strategyqa"] <= 1.0
    assert record["zero_shot"]["local_mc"]["chance"] == pytest.approx((0.5 + 0.5 + 1 / 3) / 3)
    assert record["mean_acc"] == pytest.approx((record["acc_local_mc"]
                                                + record["acc_strategyqa"]) / 2)
    assert again["zero_shot"] == record["zero_shot"]


def test_report_shows_accuracy(tiny_dir, tmp_path):
    """The prune report (report.json / report.md) and the bench report carry the accuracy."""
    from fedcompress.bench.run import accuracy_table
    from fedcompress.methods.fedprllm import summary
    from fedcompress.report import RunReport

    folder = write_yaml_task(tmp_path / "yaml")
    exp = _experiment(tiny_dir, tasks="local_mc", tasks_path=str(folder))
    record = exp.evaluate("dense", exp.model)
    with RunReport(tmp_path / "run", "prune", {"tasks": "local_mc"}, argv=[]) as report:
        report.add_result(record)
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["results"][0]["zero_shot"]["local_mc"]["acc"] == record["acc_local_mc"]
    assert "acc_local_mc" in (tmp_path / "run" / "report.md").read_text()
    _, columns, rows, _ = summary(data)
    assert columns[-1] == "acc local_mc" and rows[0][-1] == f"{record['acc_local_mc']:.4f}"
    table = accuracy_table([{**record, "kind": "dense", "status": "ok"}])
    assert "local_mc" in table and f"{record['acc_local_mc']:.4f}" in table


def test_standard_task_by_name_with_a_patched_loader(tiny_dir, monkeypatch):
    """`--tasks boolq` resolves lm-eval's own boolq task; its hub dataset comes from a patched
    datasets.load_dataset (what a user online downloads)."""
    import datasets

    calls = []
    rows = {"question": ["is the river new", "was the king first", "is the city old"],
            "passage": ["the river is new.", "the king was not first.", "the city is old."],
            "idx": [0, 1, 2], "label": [1, 0, 1]}

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        split = datasets.Dataset.from_dict(rows)
        return datasets.DatasetDict({"train": split, "validation": split})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    exp = _experiment(tiny_dir, tasks="boolq")
    assert calls and calls[0][1] == "boolq"
    record = exp.evaluate("dense", exp.model)
    assert record["zero_shot"]["boolq"]["n"] == 3
    assert record["zero_shot"]["boolq"]["chance"] == pytest.approx(0.5)


def test_unloadable_task_offline_is_a_clear_error(tmp_path):
    """A task whose hub dataset is not cached, offline: one message naming the task and saying
    it needs the internet or a local YAML task (no traceback: a ValueError for the CLI)."""
    folder = write_yaml_task(tmp_path / "yaml", name="hub_mc",
                             dataset_path="fedcompress-test/not-a-cached-dataset")
    with hub_offline(), pytest.raises(DataUnavailableError) as err:
        load_tasks("hub_mc", tasks_path=str(folder))
    message = str(err.value)
    assert "lm-eval task 'hub_mc'" in message and "needs the internet" in message
    assert "HF_HUB_OFFLINE" in message and "--tasks-path" in message
    assert isinstance(err.value, ValueError) and "\n" not in message


def test_unknown_task_name(tmp_path):
    folder = write_yaml_task(tmp_path / "yaml")
    with pytest.raises(UnknownTaskError, match="local_mx.*close lm-eval names.*local_mc"):
        load_tasks("local_mx", tasks_path=str(folder))


def test_hub_corpus_by_name_with_a_patched_loader(tiny_dir, monkeypatch):
    """--eval-text wikitext2 / ptb / c4: the hub datasets of the papers, here patched."""
    calls = []
    text = "the king of the city was the first . " * 40

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if args[0] == corpora.C4_DATASET:
            import datasets

            return datasets.Dataset.from_dict({"text": [text] * corpora.C4_VALIDATION_DOCUMENTS})
        return {"text": [text, ""], "sentence": [text, text]}

    monkeypatch.setattr(corpora, "_load_dataset", fake)
    exp = _experiment(tiny_dir, eval_text="wikitext2")
    assert calls[-1] == (corpora.WIKITEXT2_DATASET, {"split": "test"})
    assert exp.eval_text == text + "\n\n"
    assert exp.evaluate("dense", exp.model)["perplexity"] > 0
    assert corpora.load_corpus("ptb", "test")[0].text == f"{text} {text}"
    assert calls[-1] == (corpora.PTB_DATASET, {"split": "test"})
    corpora.load_corpus("c4", "validation")
    assert calls[-1][1]["data_files"] == {"validation": corpora.C4_DATA_FILES["validation"]}


def test_unloadable_corpus_offline_is_a_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(corpora, "_load_dataset", offline)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataUnavailableError) as err:
        corpora.load_corpus("wikitext2", "test")
    message = str(err.value)
    assert "hub corpus 'wikitext2'" in message and "needs the internet" in message
    assert "HF_DATASETS_OFFLINE" in message and "wiki" in message


def test_prune_and_bench_take_the_options():
    """`fedcompress prune` options come from EvalConfig; the bench accepts them as overrides."""
    from typer.testing import CliRunner

    from fedcompress.cli import app

    runner = CliRunner()
    for command in (["prune", "--help"], ["bench", "--help"]):
        result = runner.invoke(app, command, env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        assert "--tasks " in result.output and "--tasks-path" in result.output
