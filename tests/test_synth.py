"""Synthetic QA data (fedcompress.synth): prompts, parsers, pipeline, backends."""

from __future__ import annotations

import http.server
import json
import random
import re
import string
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from fedcompress.data.tasks import load_task
from fedcompress.synth import (
    Failed,
    HFBackend,
    OpenAIBackend,
    PromptSet,
    Rejected,
    Rejection,
    SynthConfig,
    SyntheticSample,
    answer_prompt,
    attempts_per_example,
    generate_synthetic,
    load_jsonl,
    parse_answer,
    parse_question,
    parse_rationale,
    question_prompt,
    rationale_prompt,
    render_prompt,
    save_jsonl,
)
from fedcompress.synth.prompts import (
    ANSWER_PROMPT,
    QUESTION_PROMPT,
    RATIONALE_PROMPT,
    letter_choices,
    list_choices,
)

# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def test_templates_have_documented_fields():
    assert _fields(QUESTION_PROMPT) == {"question", "choices"}
    assert _fields(ANSWER_PROMPT) == {"question", "choices"}
    assert _fields(RATIONALE_PROMPT) == {"question", "choices", "answer"}


def test_question_prompt_is_the_papers():
    messages = question_prompt("  Is ice cold? ", ["Yes", "No"])
    assert [m["role"] for m in messages] == ["user"]
    text = messages[0]["content"]
    assert text.startswith("Please act as a professional teacher.")
    assert "You have eight principles to do this." in text
    assert "Given Question and Multiple Choices: Is ice cold?, ['Yes', 'No']" in text
    assert text.endswith("CREATED QUESTION AND CHOICES:\nQuestion: <your created question>\n"
                         "Choices: <your created choices>")


def test_answer_and_rationale_prompts():
    text = answer_prompt("Which is a fruit?", ["apple", "carrot"])[0]["content"]
    assert "Given Question and Choices: Which is a fruit?, (A) apple (B) carrot" in text
    assert text.endswith("FINAL ANSWER: <your final choice to the question with only an "
                         "uppercase letter>")
    text = rationale_prompt("Which is a fruit?", ["apple", "it's a carrot"], 1)[0]["content"]
    assert "Question: The sun is responsible for" in text  # the paper's worked example
    assert text.endswith('Question: Which is a fruit?\nChoices: [\'apple\', "it\'s a carrot"]\n'
                         'Answer: "it\'s a carrot".\nRationale:')


def test_choice_formats_and_system_prompt():
    assert list_choices([" a ", "b"]) == "['a', 'b']"
    assert letter_choices(["x", "y", "z"]) == "(A) x (B) y (C) z"
    with pytest.raises(ValueError):
        letter_choices([str(i) for i in range(27)])
    prompts = PromptSet(system="Be brief.")
    messages = answer_prompt("q?", ["a", "b"], prompts)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["role"] == "user"


def test_render_prompt_plain_and_chat_template(tiny_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_prompt(messages, tiny_tokenizer) == "S\n\nU\n"  # no chat template: plain
    assert render_prompt("raw text", None) == "raw text"
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(messages, tiny_tokenizer, chat_template=True)
    tiny_tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_prompt(messages, tiny_tokenizer) == "<system>S</s><user>U</s><assistant>"
    assert render_prompt("hi", tiny_tokenizer) == "<user>hi</s><assistant>"
    assert render_prompt(messages, tiny_tokenizer, chat_template=False) == "S\n\nU\n"


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------

FRUIT = ("Which is a fruit?", ["apple", "carrot", "potato"])

QUESTION_CASES = [
    ("CREATED QUESTION AND CHOICES:\nQuestion: Which is a fruit?\n"
     "Choices: ['apple', 'carrot', 'potato']", FRUIT),
    ("Sure! Here is a new question.\n\n**CREATED QUESTION AND CHOICES:**\n**Question:** Which is "
     "a fruit?\n**Choices:** [\"apple\", \"carrot\", \"potato\"]", FRUIT),
    ("CREATED QUESTION AND CHOICES:\nQuestion:\nWhich is a fruit?\nChoices:\nA) apple\nB) carrot"
     "\nC) potato", FRUIT),
    ("Question: Which is a fruit? (A) apple (B) carrot (C) potato", FRUIT),
    ("Question: Which is a fruit?\nChoices: (A) apple (B) carrot (C) potato", FRUIT),
    ("Question: Which is a fruit?\nChoices: A. apple, B. carrot, C. potato", FRUIT),
    ("Question: Which is a fruit? Choices: ['apple', 'carrot', 'potato']", FRUIT),
    ("Question: Which is a fruit?\nChoices: [apple, carrot, potato]", FRUIT),
    ("Question: Which is a fruit?\nChoices: apple, carrot, potato", FRUIT),
    ("Question: Which is a fruit?\nOptions:\n- apple\n- carrot\n- potato\n", FRUIT),
    ("Question: Which is a fruit?\nChoices: ['A. apple', 'B. carrot', 'C. potato']", FRUIT),
    ("### New Question: Which is a fruit?\n### Choices\n['apple', 'carrot', 'potato']", FRUIT),
    ("Which is a fruit?\nChoices: ['apple', 'carrot', 'potato']", FRUIT),
    ("Question: Which is a fruit?\nChoices: [\n  'apple',\n  'carrot',\n  'potato'\n]", FRUIT),
    ("Question: Which is a fruit?\nChoices: ['apple', 'carrot', 'potato'", FRUIT),
    ("Q: Which is a fruit?\nChoices: ['apple', 'carrot', 'potato']\nAnswer: A", FRUIT),
    ("Given Question and Multiple Choices: Is it old?, ['Yes', 'No']\n\nQuestion: Which is a "
     "fruit?\nChoices: ['apple', 'carrot', 'potato']", FRUIT),
    ("CREATED QUESTION AND CHOICES:\n1. Question: Which is a fruit?\n2. Choices: ['apple', "
     "'carrot', 'potato']", FRUIT),
    ("Question: Which is a fruit?\nChoices: ['apple', 'carrot', 'potato']\n\nQuestion: Which is "
     "a vegetable?\nChoices: ['leek', 'pear']", FRUIT),  # only the first question counts
    ("Question: Which phrase is right?\nChoices: ['don't go', 'do not's']",
     ("Which phrase is right?", ["don't go", "do not's"])),
    ("CREATED QUESTION AND CHOICES:\nQuestion: Which sentence has the correct adjective order: "
     "a \" big red car \" b \" red big car \" ?\nChoices: ['a', 'b']",
     ("Which sentence has the correct adjective order: a \" big red car \" b \" red big car \" ?",
      ["a", "b"])),
]


@pytest.mark.parametrize("text,expected", QUESTION_CASES)
def test_parse_question_variants(text, expected):
    parsed = parse_question(text)
    assert (parsed.question, parsed.choices) == expected


@pytest.mark.parametrize("text,reason", [
    ("", Rejection.EMPTY),
    ("   \n\t", Rejection.EMPTY),
    ("lorem ipsum dolor sit amet", Rejection.NO_QUESTION),
    ("Question: \nChoices: ['a', 'b']", Rejection.NO_QUESTION),
    ("Question: 42?\nChoices: ['a', 'b']", Rejection.NO_QUESTION),
    ("Question: Is the sky blue?", Rejection.BAD_OPTIONS),
    ("Question: Is the sky blue?\nChoices: ['Yes']", Rejection.BAD_OPTIONS),
    ("Question: Is the sky blue?\nChoices: ['Yes', 'yes']", Rejection.BAD_OPTIONS),
    ("Question: Is the sky blue?\nChoices: []", Rejection.BAD_OPTIONS),
    ("Question: Is the sky blue?\nChoices: ['Yes', '']", Rejection.BAD_OPTIONS),
    ("Question: Pick one.\nChoices: " + str([f"c{i}" for i in range(30)]), Rejection.BAD_OPTIONS),
    # Real SmolLM2-135M outputs: the prompt's format echoed instead of a question.
    ("Question: CREATED QUESTION AND\nChoices: ['Yes', 'No']", Rejection.NO_QUESTION),
    ("Question: Yes The answer to this question is yes. Your output should be in the following "
     "format: CREATED QUESTION AND\nChoices: ['Yes', 'No']", Rejection.NO_QUESTION),
    ("Question: <your created question>\nChoices: <your created choices>", Rejection.NO_QUESTION),
])
def test_parse_question_rejections(text, reason):
    with pytest.raises(Rejected) as err:
        parse_question(text)
    assert err.value.reason is reason


def test_parse_question_fallback_choices_and_length():
    parsed = parse_question("Question: Is the sky blue?", fallback_choices=["Yes", "No"])
    assert parsed.choices == ["Yes", "No"]
    with pytest.raises(Rejected) as err:
        parse_question("Question: " + "why " * 100 + "?\nChoices: ['a', 'b']", max_chars=100)
    assert err.value.reason is Rejection.TOO_LONG


ANSWER_CASES = [
    ("SOLUTION: Apples grow on trees.\nFINAL ANSWER: A", 0),
    ("the answer is (B)", 1),
    ("Answer: B", 1),
    ("Answer: B) carrot", 1),
    ("**Final Answer:** (C)", 2),
    ("The correct answer is C.", 2),
    ("I think B is correct.", 1),
    ("B", 1),
    ("(c)", 2),
    ("Answer: carrot", 1),
    ("The answer is: apple", 0),
    ("answer is potato because it grows underground", 2),
    ("Final answer: \\boxed{A}", 0),
    ("SOLUTION: option A is wrong and B too.\nFINAL ANSWER: C", 2),
    ("FINAL ANSWER: B\nFINAL ANSWER: C", 2),  # the last final answer wins
    ("Answer: A", 0),
    ("Answer: A good choice is the carrot", 1),  # English "A", then the choice text
    ("SOLUTION: ...\n\nFINAL ANSWER: [B]", 1),
    ("FINAL ANSWER: 'potato'", 2),
]


@pytest.mark.parametrize("text,expected", ANSWER_CASES)
def test_parse_answer_variants(text, expected):
    assert parse_answer(text, FRUIT[1]) == expected


@pytest.mark.parametrize("text,choices,expected", [
    ("Answer: a", ["a", "b"], 0),
    ("The answer is b.", ["a", "b"], 1),
    ("Answer: Yes", ["Yes", "No"], 0),
    ("No, it is not.", ["Yes", "No"], 1),
    ("FINAL ANSWER: B", ["Yes", "No"], 1),
    ("SOLUTION: (A) Yes", ["Yes", "No"], 0),  # real SmolLM2-135M outputs
    ("Step 4: the answer is now just upper case letters.\n\nFinal answer: Yes\n\nThe final "
     "answer is the answer to the question.", ["Yes", "No"], 0),
    ("### Step-by-step process:\nThe correct answer is No.\n### Step-by-step process:\nThe "
     "answer is No.", ["Yes", "No"], 1),
])
def test_parse_answer_text_choices(text, choices, expected):
    assert parse_answer(text, choices) == expected


@pytest.mark.parametrize("text,reason", [
    ("", Rejection.EMPTY),
    ("blah blah, nothing to see here at all, really nothing whatsoever", Rejection.NO_ANSWER),
    ("FINAL ANSWER: E", Rejection.ANSWER_NOT_IN_OPTIONS),
    ("Answer: banana", Rejection.ANSWER_NOT_IN_OPTIONS),
    ("SOLUTION: I do not know.\nFINAL ANSWER:", Rejection.NO_ANSWER),
    # Real SmolLM2-135M outputs: "final answer/choice" without an answer after it.
    ("Your final answer cannot be a non-answer.\nYour final answer must be an answer that is a "
     "combination of letters.", Rejection.NO_ANSWER),
    ("SOLUTION: <Your final choice to the question with only an uppercase letter>",
     Rejection.NO_ANSWER),
])
def test_parse_answer_rejections(text, reason):
    with pytest.raises(Rejected) as err:
        parse_answer(text, FRUIT[1])
    assert err.value.reason is reason


@pytest.mark.parametrize("text,expected", [
    ("Rationale: Plants need light. <end>", "Plants need light."),
    (" The sky scatters blue light.<end>\nQuestion: next one", "The sky scatters blue light."),
    ("Because it grows on trees.\nQuestion: foo\nChoices: ['a']", "Because it grows on trees."),
    ("'A quoted rationale.' <end", "A quoted rationale."),
    ("**Rationale:** Fruits have seeds.\n\n</end>", "Fruits have seeds."),
])
def test_parse_rationale_variants(text, expected):
    assert parse_rationale(text) == expected


@pytest.mark.parametrize("text,reason,max_chars", [
    ("", Rejection.EMPTY, None),
    ("<end>", Rejection.NO_RATIONALE, None),
    ("Rationale:", Rejection.NO_RATIONALE, None),
    ("Long " * 50, Rejection.TOO_LONG, 100),
])
def test_parse_rationale_rejections(text, reason, max_chars):
    with pytest.raises(Rejected) as err:
        parse_rationale(text, max_chars=max_chars)
    assert err.value.reason is reason


def _garbage(rng: random.Random) -> str:
    pieces = ["Question:", "Choices:", "[", "]", "(", ")", "'", '"', "\n", "\n\n", "A)", "B.",
              "FINAL ANSWER:", "Answer:", "<end>", "**", "#", ",", " ", "é", "答案", "\\boxed{",
              "}", "CREATED QUESTION AND CHOICES:", "Options", "- ", "1.", "\x00", "Rationale:"]
    pieces += ["".join(rng.choice(string.printable) for _ in range(rng.randint(0, 12)))]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))


def test_parsers_never_raise_anything_but_rejected():
    rng = random.Random(0)
    texts = [_garbage(rng) for _ in range(400)] + [
        "[" * 500, "Question: [" + "'" * 100, "Choices: ['", "Question: x\nChoices: [[[", "(" * 300,
        "Question: a?\nChoices: ['a', 'b'" + "]" * 50, None, 123]
    for text in texts:
        for parse in (lambda t: parse_question(t, max_chars=500),
                      lambda t: parse_answer(t, FRUIT[1]), parse_rationale):
            try:
                parse(text)
            except Rejected as err:
                assert isinstance(err.reason, Rejection)


# ---------------------------------------------------------------------------------------------
# Pipeline with a scripted backend
# ---------------------------------------------------------------------------------------------


def _stage(prompt) -> str:
    text = prompt[-1]["content"]
    if "CREATED QUESTION AND CHOICES" in text:
        return "question"
    if "FINAL ANSWER" in text:
        return "answer"
    return "rationale"


def _subject(prompt, stage: str) -> str:
    """The question a prompt is about (source question or generated question)."""
    text = prompt[-1]["content"]
    if stage == "question":
        return re.search(r"Given Question and Multiple Choices: (.*?), \[", text).group(1)
    if stage == "answer":
        return re.search(r"Given Question and Choices: (.*?), \(A\)", text).group(1)
    return re.findall(r"Question: (.*)", text)[-1]


class ScriptedBackend:
    """Outputs looked up by (stage, question); a list value gives one output per sample."""

    name = "scripted"

    def __init__(self, script, default=None):
        self.script = script
        self.default = default
        self.calls = []

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        self.calls.append({"n": n, "temperature": temperature, "seed": seed,
                           "prompts": len(prompts)})
        out = []
        for prompt in prompts:
            stage = _stage(prompt)
            value = self.script.get((stage, _subject(prompt, stage)), self.default)
            if callable(value):
                value = value()
            out.append(list(value) if isinstance(value, list) else [value] * n)
        return out


def _q(question: str, choices=("alpha", "beta", "gamma")) -> str:
    return f"CREATED QUESTION AND CHOICES:\nQuestion: {question}\nChoices: {list(choices)}"


SCRIPT = {
    ("question", "src good"): _q("Good question?"),
    ("answer", "Good question?"): "SOLUTION: think.\nFINAL ANSWER: B",
    ("rationale", "Good question?"): "Beta is right because of reasons. <end>",
    ("question", "src garbage"): "I cannot help with that.",
    ("question", "src one option"): _q("One option?", ["only"]),
    ("question", "src disagree"): _q("Disagree?"),
    ("answer", "Disagree?"): ["FINAL ANSWER: A", "FINAL ANSWER: B", "FINAL ANSWER: A"],
    ("question", "src no answer"): _q("No answer?"),
    ("answer", "No answer?"): ["FINAL ANSWER: A", "I am not sure.", "FINAL ANSWER: A"],
    ("question", "src out of range"): _q("Out of range?"),
    ("answer", "Out of range?"): "FINAL ANSWER: E",
    ("question", "src empty"): "",
    ("question", "src timeout"): Failed(Rejection.TIMEOUT, "slow"),
    ("question", "src copy"): _q("src copy"),
    ("question", "src no rationale"): _q("No rationale?"),
    ("answer", "No rationale?"): "FINAL ANSWER: C",
    ("rationale", "No rationale?"): "<end>",
    ("question", "src duplicate"): _q("Good question?"),
    ("question", "src too long"): _q("Long " * 500 + "?"),
    ("question", "src rationale error"): _q("Rationale error?"),
    ("answer", "Rationale error?"): "Answer: gamma",
    ("rationale", "Rationale error?"): Failed(Rejection.BACKEND_ERROR, "HTTP 500"),
}
EXPECTED = {  # source -> rejection (None: accepted)
    "src good": None, "src garbage": Rejection.NO_QUESTION,
    "src one option": Rejection.BAD_OPTIONS, "src disagree": Rejection.DISAGREEMENT,
    "src no answer": Rejection.NO_ANSWER, "src out of range": Rejection.ANSWER_NOT_IN_OPTIONS,
    "src empty": Rejection.EMPTY, "src timeout": Rejection.TIMEOUT, "src copy": Rejection.COPY,
    "src no rationale": Rejection.NO_RATIONALE, "src duplicate": Rejection.DUPLICATE,
    "src too long": Rejection.TOO_LONG, "src rationale error": Rejection.BACKEND_ERROR,
}


def _examples(names) -> list[dict]:
    return [{"id": f"ex{i}", "question": q, "choices": ["x", "y", str(i)]}
            for i, q in enumerate(names)]


def test_pipeline_agreement_filter_and_rejection_counts():
    backend = ScriptedBackend(SCRIPT)
    examples = _examples(EXPECTED)
    config = SynthConfig(batch_size=5, max_question_chars=400)
    result = generate_synthetic(examples, backend, config, progress=False)
    stats = result.stats
    assert stats.examples == stats.target == stats.attempts == len(EXPECTED)
    assert stats.accepted == 1 and len(result.samples) == 1
    assert stats.accepted + stats.rejected == stats.attempts
    assert stats.acceptance_rate == pytest.approx(1 / len(EXPECTED))
    expected_counts = {r.value: 0 for r in Rejection}
    for reason in EXPECTED.values():
        if reason is not None:
            expected_counts[reason.value] += 1
    assert stats.rejections == expected_counts
    assert stats.rejections_by_stage["answer"] == {
        "disagreement": 1, "no_answer": 1, "answer_not_in_options": 1}
    assert stats.rejections_by_stage["rationale"] == {"no_rationale": 1, "backend_error": 1}
    sample = result.samples[0]
    assert sample == SyntheticSample(id="ex0-s0", question="Good question?",
                                     choices=["alpha", "beta", "gamma"], label=1,
                                     rationale="Beta is right because of reasons.",
                                     source_id="ex0")
    assert sample.answer == "beta" and sample.options == sample.choices
    # 3 answer samples per question, 1 question and 1 rationale sample.
    assert {c["n"] for c in backend.calls} == {1, 3}
    by_source = {r["source_id"]: r["reason"] for r in result.rejected}
    assert by_source == {f"ex{i}": r.value for i, r in enumerate(EXPECTED.values()) if r}
    disagree = next(r for r in result.rejected if r["reason"] == "disagreement")
    assert disagree["stage"] == "answer" and len(disagree["raw"]) == 3
    assert stats.prompts == {"question": 13, "answer": 6, "rationale": 3}
    assert stats.answer_votes == {"parsed": 6 * 3 - 1 - 3, "total": 6 * 3}


def test_pipeline_survives_backend_exceptions_and_bad_shapes():
    class Broken:
        name = "broken"

        def __init__(self, mode):
            self.mode = mode

        def generate(self, prompts, n, temperature, max_new_tokens, seed):
            if self.mode == "raise":
                raise RuntimeError("CUDA out of memory")
            if self.mode == "short":
                return [["x"] * n]  # one row for many prompts
            return [[None] * n for _ in prompts]  # not strings

    for mode in ("raise", "short", "types"):
        result = generate_synthetic(_examples(["a", "b", "c"]), Broken(mode), progress=False)
        assert result.stats.rejections["backend_error"] == 3
        assert result.stats.accepted == 0 and result.samples == []


def test_ratio_rounds_and_closed_choices():
    assert attempts_per_example(4, 0.5) == [1, 0, 1, 0]
    assert attempts_per_example(3, 2) == [2, 2, 2]
    assert sum(attempts_per_example(7, 1.5)) == 11
    good = {("question", "src good"): _q("Good question?"),
            ("answer", "Good question?"): "FINAL ANSWER: A",
            ("rationale", "Good question?"): "Fine. <end>"}
    backend = ScriptedBackend(good)
    result = generate_synthetic(_examples(["src good"]), backend,
                                SynthConfig(ratio=3, reject_duplicates=False), progress=False)
    assert result.stats.target == 3 and result.stats.accepted == 3
    assert [s.id for s in result.samples] == ["ex0-s0", "ex0-s1", "ex0-s2"]
    # With duplicates rejected, the same question is accepted once; more rounds retry the rest.
    result = generate_synthetic(_examples(["src good"]), backend,
                                SynthConfig(ratio=2, max_rounds=3), progress=False)
    assert result.stats.accepted == 1 and result.stats.rounds == 3
    assert result.stats.attempts == 4 and result.stats.rejections["duplicate"] == 3
    # A question without choices takes the shared (closed) label set of the examples.
    script = {("question", "is it?"): "Question: Is it new?",
              ("answer", "Is it new?"): "FINAL ANSWER: Yes",
              ("rationale", "Is it new?"): "It is. <end>"}
    yes_no = [{"id": "y", "question": "is it?", "choices": ["Yes", "No"], "label": 1}]
    result = generate_synthetic(yes_no, ScriptedBackend(script), progress=False)
    assert result.samples[0].choices == ["Yes", "No"] and result.samples[0].label == 0
    result = generate_synthetic(yes_no, ScriptedBackend(script),
                                SynthConfig(closed_choices=False), progress=False)
    assert result.stats.rejections["bad_options"] == 1


def test_pipeline_seeds_are_deterministic_and_time_limit():
    seeds = []
    for seed in (0, 0, 1):
        backend = ScriptedBackend(SCRIPT)
        generate_synthetic(_examples(EXPECTED), backend, SynthConfig(seed=seed, batch_size=4),
                           progress=False)
        seeds.append([c["seed"] for c in backend.calls])
    assert seeds[0] == seeds[1] != seeds[2]
    assert len(set(seeds[0])) == len(seeds[0])  # every call its own seed

    def slow():
        time.sleep(0.05)
        return "nothing"

    result = generate_synthetic(_examples(["a", "b", "c", "d"]), ScriptedBackend({}, slow),
                                SynthConfig(batch_size=1, time_limit=0.01), progress=False)
    assert result.stats.stopped_early and result.stats.attempts == 1


def test_invalid_inputs():
    with pytest.raises(ValueError):
        SynthConfig(ratio=0)
    with pytest.raises(ValueError):
        SynthConfig(answer_samples=0)
    with pytest.raises(ValueError):
        SynthConfig(answer_temperature=-1)
    backend = ScriptedBackend({})
    with pytest.raises(ValueError, match="no question"):
        generate_synthetic([{"id": "a", "choices": []}], backend, progress=False)
    with pytest.raises(ValueError, match="duplicate id"):
        generate_synthetic([{"id": "a", "question": "q"}, {"id": "a", "question": "r"}], backend,
                           progress=False)
    assert backend.calls == []


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path):
    samples = [SyntheticSample("s0", "Which? «ü»", ["a", "b"], 1, "Because.", "ex0"),
               SyntheticSample("s1", "Why?", ["x", "y", "z"], 0, "Since.", "ex1")]
    path = tmp_path / "sub" / "samples.jsonl"
    assert save_jsonl(samples, path) == 2
    assert load_jsonl(path) == samples
    # A saved file is also a valid local task (label/choices/question/id).
    assert [e["label"] for e in load_task(str(path), "train")] == [1, 0]
    path.write_text(path.read_text() + '{"id": "bad", "question": "q", "choices": ["a"], '
                    '"label": 3, "rationale": "", "source_id": "x"}\n')
    with pytest.raises(ValueError, match=":3:"):
        load_jsonl(path)


def test_result_save(tmp_path):
    result = generate_synthetic(_examples(EXPECTED), ScriptedBackend(SCRIPT),
                                SynthConfig(max_question_chars=400), progress=False)
    folder = result.save(tmp_path / "run")
    assert load_jsonl(folder / "samples.jsonl") == result.samples
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["backend"] == "scripted" and stats["config"]["prompts"] == "ppc-gpt"
    assert stats["stats"]["accepted"] == 1
    assert stats["stats"]["rejections"]["disagreement"] == 1
    assert len((folder / "rejected.jsonl").read_text().splitlines()) == len(EXPECTED) - 1


# ---------------------------------------------------------------------------------------------
# Local transformers backend (tiny random llama: garbage text, real plumbing)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf():
    from conftest import build_tiny_model, build_tiny_tokenizer

    return build_tiny_model("llama", n_layers=2), build_tiny_tokenizer()


def test_hf_backend_shapes_determinism_and_padding(tiny_hf):
    model, tokenizer = tiny_hf
    backend = HFBackend(model, tokenizer, batch_size=2)
    prompts = ["the king", "the queen of the river city was new and the people", "a war"]
    state = torch.get_rng_state()
    first = backend.generate(prompts, n=3, temperature=1.0, max_new_tokens=4, seed=0)
    assert torch.equal(state, torch.get_rng_state())  # the caller's random state is untouched
    assert len(first) == 3 and all(len(row) == 3 for row in first)
    assert all(isinstance(t, str) and not isinstance(t, Failed) for row in first for t in row)
    assert backend.generate(prompts, n=3, temperature=1.0, max_new_tokens=4, seed=0) == first
    assert backend.generate(prompts, n=3, temperature=1.0, max_new_tokens=4, seed=1) != first
    # Greedy: n identical completions; left padding gives the same tokens as one by one.
    greedy = backend.generate(prompts, n=2, temperature=0, max_new_tokens=4, seed=0)
    assert all(row[0] == row[1] for row in greedy)
    alone = HFBackend(model, tokenizer, batch_size=1).generate(prompts, n=2, temperature=0,
                                                               max_new_tokens=4, seed=5)
    assert alone == greedy
    assert backend.stats["prompts"] == 12 and backend.stats["new_tokens"] > 0


def test_hf_backend_failures_become_failed(tiny_hf):
    model, tokenizer = tiny_hf
    backend = HFBackend(model, tokenizer, batch_size=4)
    out = backend.generate(["the " * 200, "the king"], n=2, temperature=0, max_new_tokens=2,
                           seed=0)
    assert [c.reason for c in out[0]] == [Rejection.TOO_LONG] * 2  # beyond the 128 positions
    assert not isinstance(out[1][0], Failed)

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.generation_config = model.config, model.generation_config
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def generate(self, **kwargs):
            raise RuntimeError("out of memory")

    out = HFBackend(Exploding(), tokenizer).generate(["a", "b"], n=3, temperature=1, seed=0,
                                                     max_new_tokens=2)
    assert all(c.reason is Rejection.BACKEND_ERROR for row in out for c in row)


@pytest.fixture(scope="module")
def tiny_long_dir(tmp_path_factory):
    """A saved tiny 2-layer llama with room for the paper's prompts (1024 positions)."""
    import transformers as tf
    from conftest import build_tiny_tokenizer, tiny_config

    config = tiny_config("llama", n_layers=2)
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-1k")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_hf_backend_load_chat_template_and_pipeline(tiny_long_dir):
    backend = HFBackend.load(tiny_long_dir, device="cpu", dtype="float32", batch_size=4)
    assert backend.name == tiny_long_dir
    backend.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}the king:{% endif %}")
    assert backend.render("who was it").endswith("who was it . the king:")
    examples = load_task("strategyqa", "train")[:3]
    config = SynthConfig(question_max_new_tokens=6, answer_max_new_tokens=4,
                         rationale_max_new_tokens=4, batch_size=2, ratio=1)
    runs = [generate_synthetic(examples, backend, config, progress=False) for _ in range(2)]
    stats = runs[0].stats
    assert stats.attempts == 3 and stats.accepted + stats.rejected == 3
    assert runs[0].stats.rejections == runs[1].stats.rejections  # seeded: the same again
    assert runs[0].rejected == runs[1].rejected

    class ScriptedQuestions:
        """Scripted questions, then the tiny model for the answer and rationale stages."""

        name = "hybrid"

        def __init__(self):
            self.count = 0

        def generate(self, prompts, n, temperature, max_new_tokens, seed):
            if _stage(prompts[0]) == "question":
                self.count += len(prompts)
                return [[_q(f"Is {self.count - i} new?", ["Yes", "No"])] * n
                        for i in range(len(prompts))]
            return backend.generate(prompts, n, temperature, max_new_tokens, seed)

    runs = [generate_synthetic(examples, ScriptedQuestions(), config, progress=False)
            for _ in range(2)]
    stats = runs[0].stats
    assert stats.prompts == {"question": 3, "answer": 3, "rationale": stats.accepted}
    assert stats.answer_votes["total"] == 9
    assert sum(stats.rejections_by_stage["answer"].values()) + stats.accepted == 3
    assert runs[0].rejected == runs[1].rejected and runs[0].samples == runs[1].samples


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP backend against a stub server
# ---------------------------------------------------------------------------------------------


class _StubHandler(http.server.BaseHTTPRequestHandler):
    """Scripted by the request's ``model`` field."""

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append({"path": self.path, "body": body,
                                    "auth": self.headers.get("Authorization")})
            count = sum(r["body"]["model"] == body["model"] for r in server.requests)
        model, n = body["model"], body.get("n", 1)
        if model == "malformed":
            return self._send(200, b"{not json")
        if model == "shape":
            return self._send(200, b'{"object": "list", "data": []}')
        if model == "http500" or (model == "flaky" and count == 1):
            return self._send(500, b'{"error": "boom"}')
        if model == "slow":
            time.sleep(1.0)
        if model == "one":  # a server that ignores n
            n = 1
        if model == "pipeline":
            text = body["messages"][-1]["content"]
            if "CREATED QUESTION" in text:
                reply = _q("Which colour is the sky?", ["blue", "green"])
            elif "FINAL ANSWER" in text:
                reply = "SOLUTION: Look up.\nFINAL ANSWER: A"
            else:
                reply = "Air scatters blue light most. <end>"
            texts = [reply] * n
        else:
            texts = [f"{model} seed={body['seed']} #{i}" for i in range(n)]
        if self.path.endswith("/chat/completions"):
            choices = [{"index": i, "message": {"role": "assistant", "content": t}}
                       for i, t in reversed(list(enumerate(texts)))]
        else:
            choices = [{"index": i, "text": t} for i, t in enumerate(texts)]
        payload = {"choices": choices, "usage": {"completion_tokens": 2 * len(texts)}}
        self._send(200, json.dumps(payload).encode())

    def _send(self, code, data):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout test)
            pass


@pytest.fixture
def stub_server() -> Iterator[tuple[str, list]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    server.daemon_threads = True
    server.requests, server.lock = [], threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_http_backend_chat_and_completions(stub_server, monkeypatch):
    url, requests = stub_server
    monkeypatch.setenv("SYNTH_TEST_KEY", "sk-test")
    backend = OpenAIBackend(url + "/v1/", "ok", api_key_env="SYNTH_TEST_KEY", max_workers=2)
    prompts = [[{"role": "user", "content": "hi"}], "plain"]
    out = backend.generate(prompts, n=2, temperature=0.7, max_new_tokens=8, seed=10)
    assert out == [["ok seed=10 #0", "ok seed=10 #1"], ["ok seed=11 #0", "ok seed=11 #1"]]
    chat = sorted(requests, key=lambda r: r["body"]["seed"])
    assert {r["path"] for r in chat} == {"/v1/chat/completions"}
    assert chat[1]["body"]["messages"] == [{"role": "user", "content": "plain"}]
    assert chat[0]["body"] | {"messages": None} == {
        "model": "ok", "messages": None, "n": 2, "temperature": 0.7, "max_tokens": 8,
        "seed": 10}
    assert {r["auth"] for r in chat} == {"Bearer sk-test"}
    assert backend.stats["completion_tokens"] == 8

    requests.clear()
    backend = OpenAIBackend(url, "ok", api="completions", api_key_env="SYNTH_UNSET_KEY",
                            stop=["<end>"])
    assert backend.generate(["hello"], n=1, temperature=0, max_new_tokens=4, seed=3) == [
        ["ok seed=3 #0"]]
    assert requests[0]["path"] == "/v1/completions" and requests[0]["auth"] is None
    assert requests[0]["body"]["prompt"] == "hello" and requests[0]["body"]["stop"] == ["<end>"]
    # A server that returns fewer choices than n is topped up with more requests.
    requests.clear()
    out = OpenAIBackend(url, "one").generate(["x"], n=3, temperature=1, max_new_tokens=4, seed=0)
    assert len(out[0]) == 3 and len(requests) == 3 and len(set(out[0])) == 3


def test_http_backend_errors_become_rejections(stub_server):
    url, requests = stub_server
    kwargs = dict(retries=1, backoff=0.01, timeout=5.0)
    for model, reason in (("malformed", Rejection.BACKEND_ERROR),
                          ("shape", Rejection.BACKEND_ERROR),
                          ("http500", Rejection.BACKEND_ERROR)):
        out = OpenAIBackend(url, model, **kwargs).generate(["a", "b"], n=2, temperature=1,
                                                           max_new_tokens=4, seed=0)
        assert [[c.reason for c in row] for row in out] == [[reason] * 2] * 2, model
    counts = {m: sum(r["body"]["model"] == m for r in requests)
              for m in ("malformed", "shape", "http500")}
    assert counts == {"malformed": 2, "shape": 2, "http500": 4}  # only 5xx is retried
    assert "HTTP 500" in out[0][0].detail
    # A first 500 then success: retried once.
    backend = OpenAIBackend(url, "flaky", **kwargs)
    assert backend.generate(["a"], n=1, temperature=1, max_new_tokens=4, seed=0) == [
        ["flaky seed=0 #0"]]
    assert backend.stats["retries"] == 1
    # Too slow: the client's timeout fires on each of the 2 attempts (the reasons say so; the
    # server would have answered after 1 s), so no wall-clock bound is needed.
    backend = OpenAIBackend(url, "slow", retries=1, backoff=0.01, timeout=0.25)
    out = backend.generate(["a"], n=2, temperature=1, max_new_tokens=4, seed=0)
    assert [c.reason for c in out[0]] == [Rejection.TIMEOUT] * 2
    assert backend.stats["requests"] == 2
    # Nobody listening: a connection error, not a crash.
    dead = OpenAIBackend("http://127.0.0.1:9", "ok", retries=0, timeout=1.0)
    out = dead.generate(["a"], n=1, temperature=1, max_new_tokens=4, seed=0)
    assert out[0][0].reason is Rejection.BACKEND_ERROR


def test_http_backend_pipeline(stub_server):
    url, _ = stub_server
    examples = load_task("social_iqa", "train")[:4]
    backend = OpenAIBackend(url, "pipeline", retries=0)
    result = generate_synthetic(examples, backend, SynthConfig(reject_duplicates=False),
                                progress=False)
    assert result.stats.accepted == 4 and result.stats.acceptance_rate == 1.0
    assert {s.source_id for s in result.samples} == {e["id"] for e in examples}
    assert result.samples[0].label == 0
    assert result.samples[0].rationale == "Air scatters blue light most."
    failing = OpenAIBackend(url, "http500", retries=0)
    result = generate_synthetic(examples, failing, progress=False)
    assert result.stats.rejections["backend_error"] == 4 and result.stats.accepted == 0
