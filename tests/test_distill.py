"""Unit tests of fedcompress.distill (CoT distillation data, LoRA training, accuracy hook).

Tiny random LLaMA models built from a config and a word-level tokenizer: seconds in all.
"""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from fedcompress.distill import (
    IGNORE_INDEX,
    DistillDataError,
    EmptyDataError,
    LabelError,
    LoraSettings,
    MissingRationaleError,
    NonFiniteLossError,
    PromptFormat,
    SequenceTooLongError,
    TrainConfig,
    accuracy_hook,
    build_examples,
    collate,
    distill,
    load_adapter,
    lora_target_modules,
    mc_records,
    multitask_loss,
    retrain_client,
    task_loss,
)
from fedcompress.models import ModelAdapter
from fedcompress.synth import SyntheticSample

WORDS = ("the a of and to in is was for on with as by at from that it his her they this king "
         "queen river city war year people first time new made who which were had but not be "
         "or an are have one their been has more after also two other into over only its when "
         "than most some would there out about can up may what so no if all my your our we you "
         "he she him them me us do did does said label rationale Question Choices Answer "
         "A B C D yes").split()

SAMPLES = [
    {"id": "s0", "question": "who was the first king of the city ?",
     "choices": ["the queen", "a river", "two people"], "label": 0,
     "rationale": "the queen was first in the city ."},
    {"id": "s1", "question": "what is in the city ?", "choices": ["war", "a river"], "label": 1,
     "rationale": "a river is in the city ."},
    {"id": "s2", "question": "who said it ?", "choices": ["the king", "we", "you"], "label": 2,
     "rationale": "you said it at that time ."},
    {"id": "s3", "question": "when was the war ?", "choices": ["one year", "after the king"],
     "label": 1, "rationale": "the war was after the king ."},
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokens = specials + sorted(set(WORDS)) + list(".,;:!?'\"()-[]")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


TOKENIZER = make_tokenizer()
# a few float32 ulps, relative: the tolerance for results that differ only by summation order
FLOAT32_REL = 8 * torch.finfo(torch.float32).eps


def make_model(seed: int = 0, n_layers: int = 2) -> LlamaForCausalLM:
    # initializer_range 0.2 (not 0.02): with a frozen, near-zero LM head a tiny random model
    # cannot move its logits far enough through LoRA to memorise anything.
    config = LlamaConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=n_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, initializer_range=0.2,
                         pad_token_id=TOKENIZER.pad_token_id,
                         bos_token_id=TOKENIZER.bos_token_id,
                         eos_token_id=TOKENIZER.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def cfg(**kw) -> TrainConfig:
    base = dict(lr=1e-2, max_steps=3, batch_size=4, grad_accum=1, progress=False,
                lora=LoraSettings(r=4, alpha=8, dropout=0.0), max_length=64)
    base.update(kw)
    return TrainConfig(**base)


def logits(model, text: str = "who was the first king of the city ?") -> torch.Tensor:
    ids = torch.tensor([TOKENIZER(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf_loss(model, batch) -> float:
    """transformers' own causal-LM loss (mean over labels != -100): an independent reference."""
    with torch.no_grad():
        return float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           labels=batch["labels"]).loss)


# ------------------------------------------------------------------------------- data
def test_target_only_masking_is_exact() -> None:
    fmt = PromptFormat()
    data = build_examples(SAMPLES, TOKENIZER, fmt=fmt, max_length=64)
    assert data.tasks == ("label", "rationale")
    eos = TOKENIZER.eos_token_id
    for i, sample in enumerate(SAMPLES):
        for task, prefix, target in (
                ("label", "[label]", " " + sample["choices"][sample["label"]]),
                ("rationale", "[rationale]", " " + sample["rationale"])):
            prompt = fmt.prompt(task, sample["question"], sample["choices"])
            assert prompt.startswith(prefix + " Question: " + sample["question"])
            assert prompt.endswith("\nAnswer:")
            p_ids = TOKENIZER(prompt)["input_ids"]
            t_ids = TOKENIZER(target, add_special_tokens=False)["input_ids"] + [eos]
            ex = data.examples[task][i]
            assert ex.id == sample["id"] and ex.task == task
            assert list(ex.input_ids) == p_ids + t_ids
            assert list(ex.labels) == [IGNORE_INDEX] * len(p_ids) + t_ids
            assert ex.prompt_tokens == len(p_ids) and ex.target_tokens == len(t_ids)
    # the prompt lists the options with letters; the letter format targets the letter
    assert "Choices: (A) the queen (B) a river (C) two people" in fmt.prompt(
        "label", SAMPLES[0]["question"], SAMPLES[0]["choices"])
    letter = build_examples(SAMPLES[:1], TOKENIZER, tasks=("label",),
                            fmt=PromptFormat(label_target="letter", append_eos=False))
    ex = letter.examples["label"][0]
    assert [t for t in ex.labels if t != IGNORE_INDEX] == TOKENIZER(
        " A", add_special_tokens=False)["input_ids"]


def test_synthetic_samples_and_text_labels_are_accepted() -> None:
    synth = [SyntheticSample(id=s["id"], question=s["question"], choices=s["choices"],
                             label=s["label"], rationale=s["rationale"], source_id="x")
             for s in SAMPLES]
    by_text = [dict(s, label=s["choices"][s["label"]]) for s in SAMPLES]
    a = build_examples(synth, TOKENIZER)
    b = build_examples(by_text, TOKENIZER)
    assert a.examples == b.examples == build_examples(SAMPLES, TOKENIZER).examples


def test_collate_pads_right_with_masked_labels() -> None:
    data = build_examples(SAMPLES, TOKENIZER, tasks=("rationale",))
    exs = data.examples["rationale"]
    batch = collate(exs, pad_id=TOKENIZER.pad_token_id)
    width = max(len(e) for e in exs)
    assert batch["input_ids"].shape == (len(exs), width)
    for row, e in enumerate(exs):
        n = len(e)
        assert batch["input_ids"][row, :n].tolist() == list(e.input_ids)
        assert batch["labels"][row, :n].tolist() == list(e.labels)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert (batch["input_ids"][row, n:] == TOKENIZER.pad_token_id).all()
    # padding with the EOS id (tokenizers without a pad token) keeps the targets' own EOS
    eos = TOKENIZER.eos_token_id
    same = collate(exs, pad_id=eos)
    for row, e in enumerate(exs):
        assert same["labels"][row, len(e) - 1] == eos
        assert same["labels"][row].tolist() == batch["labels"][row].tolist()


def test_overflow_raises_or_truncates_with_counts() -> None:
    full = build_examples(SAMPLES, TOKENIZER, tasks=("rationale",), max_length=64)
    longest = full.stats["tasks"]["rationale"]["longest"]
    limit = longest - 2
    with pytest.raises(SequenceTooLongError, match=r"sample 's\d'.*max_length=" + str(limit)):
        build_examples(SAMPLES, TOKENIZER, tasks=("rationale",), max_length=limit)
    cut = build_examples(SAMPLES, TOKENIZER, tasks=("rationale",), max_length=limit,
                         overflow="truncate")
    st = cut.stats["tasks"]["rationale"]
    expected = [max(0, len(e) - limit) for e in full.examples["rationale"]]
    assert st["truncated_examples"] == sum(1 for c in expected if c) >= 1
    assert st["cut_target_tokens"] == sum(expected)
    for e, f in zip(cut.examples["rationale"], full.examples["rationale"], strict=True):
        assert len(e) <= limit and e.input_ids == f.input_ids[:len(e)]
        assert e.cut_tokens == len(f) - len(e)
    prompt_len = full.examples["rationale"][0].prompt_tokens
    with pytest.raises(SequenceTooLongError, match="prompt alone"):
        build_examples(SAMPLES[:1], TOKENIZER, tasks=("rationale",), max_length=prompt_len,
                       overflow="truncate")


# ------------------------------------------------------------------------------- losses
def test_task_loss_counts_target_tokens_only() -> None:
    model = make_model()
    data = build_examples(SAMPLES, TOKENIZER, max_length=64)
    batch = collate(data.examples["rationale"], TOKENIZER.pad_token_id)
    with torch.no_grad():
        ours = float(task_loss(model, batch))
        # by hand, one example at a time, without padding
        total, count = 0.0, 0
        for e in data.examples["rationale"]:
            out = model(input_ids=torch.tensor([e.input_ids])).logits[0].float()
            logp = torch.log_softmax(out, dim=-1)
            for t in range(e.prompt_tokens, len(e)):
                total -= float(logp[t - 1, e.input_ids[t]])
                count += 1
    assert count == sum(e.target_tokens for e in data.examples["rationale"])
    assert ours == pytest.approx(total / count, abs=1e-5)
    assert ours == pytest.approx(hf_loss(model, batch), abs=1e-5)


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_multitask_loss_is_the_sum_of_the_single_task_losses(weight: float) -> None:
    model = make_model()
    data = build_examples(SAMPLES, TOKENIZER, max_length=64)
    lb = collate(data.examples["label"], TOKENIZER.pad_token_id)
    rb = collate(data.examples["rationale"], TOKENIZER.pad_token_id)
    with torch.no_grad():
        parts = multitask_loss(model, {"label": lb, "rationale": rb}, rationale_weight=weight)
    label, rationale = hf_loss(model, lb), hf_loss(model, rb)
    assert float(parts["label"]) == pytest.approx(label, abs=1e-5)
    assert float(parts["rationale"]) == pytest.approx(rationale, abs=1e-5)
    assert float(parts["loss"]) == pytest.approx(label + weight * rationale, abs=1e-5)
    assert parts["loss"].dtype == torch.float32

    # The training loop's first step (LoRA B = 0: the base model) reports the same numbers.
    result = distill(make_model(), TOKENIZER, SAMPLES,
                     cfg(max_steps=1, batch_size=len(SAMPLES), rationale_weight=weight))
    m = result.metrics
    assert m.task_loss["label"][0] == pytest.approx(label, abs=1e-5)
    assert m.task_loss["rationale"][0] == pytest.approx(rationale, abs=1e-5)
    assert m.loss[0] == pytest.approx(label + weight * rationale, abs=1e-5)
    assert m.target_tokens == {t: sum(e.target_tokens for e in data.examples[t])
                               for t in ("label", "rationale")}


def test_gradient_accumulation_equals_one_big_batch() -> None:
    one = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=2, batch_size=4, grad_accum=1))
    acc = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=2, batch_size=2, grad_accum=2))
    assert acc.metrics.micro_batches == 4 and one.metrics.micro_batches == 2
    # float32 losses near 10 differ by the order of summation (one ulp there is about 1e-6,
    # and AVX2 and AVX-512 kernels sum in different orders): compare relative to float32
    assert acc.metrics.loss == pytest.approx(one.metrics.loss, rel=FLOAT32_REL)
    a, b = one.adapter_state(), acc.adapter_state()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------- training
def test_training_reduces_the_loss_on_a_memorisable_set() -> None:
    result = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=30, lr=3e-2))
    m = result.metrics
    assert m.steps == 30 and len(m.loss) == 30 and len(m.lr) == 30
    assert m.loss[-1] < 0.3 * m.loss[0]
    assert m.task_loss["label"][-1] < m.task_loss["label"][0]
    assert m.task_loss["rationale"][-1] < m.task_loss["rationale"][0]
    assert m.lr[0] == pytest.approx(3e-2) and m.lr[-1] == pytest.approx(3e-2 / 30)  # linear
    assert m.samples_seen == 120 and m.epochs == pytest.approx(30.0)
    assert m.wall_seconds >= m.train_seconds > 0
    assert 0 < m.trainable_params < m.total_params


def test_same_seed_same_run_other_seed_other_run() -> None:
    rng_before = torch.get_rng_state()
    runs = [distill(make_model(), TOKENIZER, SAMPLES,
                    cfg(max_steps=4, batch_size=2, seed=s,
                        lora=LoraSettings(r=4, alpha=8, dropout=0.1)))
            for s in (7, 7, 8)]
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    assert runs[0].metrics.loss == runs[1].metrics.loss
    a, b, c = (r.adapter_state() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert runs[0].metrics.loss != runs[2].metrics.loss
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_lora_changes_only_adapter_parameters() -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = distill(model, TOKENIZER, SAMPLES, cfg(max_steps=5))
    peft_model = result.model
    base = peft_model.get_base_model()
    changed_lora = 0
    for name, param in base.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
            changed_lora += "lora_B" in name and bool(param.abs().sum() > 0)
            continue
        assert not param.requires_grad, name
        key = name.replace(".base_layer", "")
        assert torch.equal(param, before[key]), f"base weight {name} changed"
    assert changed_lora > 0
    # LoRA sits on exactly the decoder layers' linear layers (not embeddings, not the LM head)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in base.named_parameters() if ".lora_A." in n}
    adapter = ModelAdapter(make_model())
    expected = {f"{adapter.layers_path}.{i}.{name}" for i, layer in enumerate(adapter.layers)
                for name in ModelAdapter.linear_layers(layer)}
    assert adapted == expected
    assert lora_target_modules(make_model()).startswith(r"model\.layers\.")


def test_merge_gives_the_adapter_model_logits() -> None:
    result = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=5))
    peft_logits = logits(result.model)
    assert not torch.allclose(peft_logits, logits(make_model()), atol=1e-4)  # it did learn
    merged = result.model.merge_and_unload()
    assert isinstance(merged, LlamaForCausalLM)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), peft_logits, atol=1e-5, rtol=1e-5)
    # merge=True in the config does the same and returns the plain model
    direct = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=5, merge=True))
    assert direct.merged and isinstance(direct.model, LlamaForCausalLM)
    torch.testing.assert_close(logits(direct.model), peft_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="merged"):
        direct.adapter_state()


def test_save_load_round_trip(tmp_path) -> None:
    result = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=5))
    expected = logits(result.model)
    path = result.save(tmp_path / "adapter", tokenizer=TOKENIZER)
    assert (path / "adapter_config.json").exists() and (path / "train_metrics.json").exists()
    reloaded = load_adapter(make_model(), path).eval()
    torch.testing.assert_close(logits(reloaded), expected, atol=1e-6, rtol=1e-6)

    merged = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=5, merge=True))
    merged.save(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(again), logits(merged.model), atol=1e-6, rtol=1e-6)


def test_retrain_client_uses_the_label_loss_only() -> None:
    result = retrain_client(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=4))
    m = result.metrics
    assert m.weights == {"label": 1.0} and set(m.task_loss) == {"label"}
    assert m.loss == m.task_loss["label"]
    no_rationale = [{k: v for k, v in s.items() if k != "rationale"} for s in SAMPLES]
    same = distill(make_model(), TOKENIZER, no_rationale, cfg(max_steps=4, rationale_weight=0))
    assert same.metrics.loss == m.loss
    # a client continues training the adapter it received
    cont = retrain_client(result.model, TOKENIZER, SAMPLES, cfg(max_steps=2))
    assert cont.model is result.model
    assert cont.metrics.trainable_params == m.trainable_params  # no second adapter
    assert cont.metrics.loss[0] < m.loss[0]  # same first batch, starts from the trained adapter


def test_accuracy_hook_scores_the_training_format() -> None:
    fmt = PromptFormat()
    records = mc_records(SAMPLES, fmt)
    assert records[0]["question"] == fmt.prompt("label", SAMPLES[0]["question"],
                                                SAMPLES[0]["choices"])
    assert records[0]["choices"] == SAMPLES[0]["choices"]
    hook = accuracy_hook(TOKENIZER, SAMPLES, fmt)
    result = distill(make_model(), TOKENIZER, SAMPLES, cfg(max_steps=30, lr=3e-2),
                     eval_fn=hook)
    evals = result.metrics.evals
    assert [e["step"] for e in evals] == [0, 30]
    assert evals[-1]["acc"] == 1.0 and evals[-1]["n"] == len(SAMPLES)
    assert result.metrics.eval_seconds > 0


# ------------------------------------------------------------------------------- errors
def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(EmptyDataError, match="no samples"):
        build_examples([], TOKENIZER)
    with pytest.raises(EmptyDataError):
        distill(make_model(), TOKENIZER, [], cfg())
    with pytest.raises(LabelError, match=r"'s0'.*not one of its options"):
        build_examples([dict(SAMPLES[0], label="the king")], TOKENIZER)
    with pytest.raises(LabelError, match=r"label 3 is not one of its 3 options"):
        build_examples([dict(SAMPLES[0], label=3)], TOKENIZER)
    with pytest.raises(LabelError):
        build_examples([dict(SAMPLES[0], label=True)], TOKENIZER)
    with pytest.raises(MissingRationaleError, match="rationale_weight=0"):
        distill(make_model(), TOKENIZER, [dict(SAMPLES[0], rationale="  ")], cfg())
    with pytest.raises(DistillDataError, match="choices"):
        build_examples([dict(SAMPLES[0], choices=["only one"])], TOKENIZER)
    for lr in (0, -1e-4, math.nan, math.inf):
        with pytest.raises(ValueError, match="lr="):
            TrainConfig(lr=lr)
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(grad_accum=0)
    with pytest.raises(ValueError, match="rationale_weight"):
        TrainConfig(rationale_weight=-1)
    with pytest.raises(ValueError, match="r="):
        LoraSettings(r=0)
    config = make_model().config
    config.max_position_embeddings = 8
    with pytest.raises(ValueError, match="context of 8"):
        distill(LlamaForCausalLM(config), TOKENIZER, SAMPLES, cfg())


def test_non_finite_loss_names_the_step() -> None:
    model = make_model()
    calls = {"n": 0}

    def poison(module, inputs, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] >= 3 else output

    model.lm_head.register_forward_hook(poison)
    with pytest.raises(NonFiniteLossError, match="step 3/5") as info:
        retrain_client(model, TOKENIZER, SAMPLES, cfg(max_steps=5))
    assert info.value.step == 3 and info.value.task == "label"
    assert model.training is False  # flags restored after the failure


@pytest.mark.parametrize("arch", ["qwen2", "opt", "gpt2"])
def test_other_architectures_train(arch: str, tiny_model, tiny_tokenizer) -> None:
    model = tiny_model(arch, n_layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    samples = [{"question": "the king of the city", "choices": ["the queen", "a river"],
                "label": 0, "rationale": "the queen is with the king ."}]
    result = distill(model, tiny_tokenizer, samples,
                     cfg(max_steps=2, batch_size=1, max_length=64, merge=True))
    assert all(math.isfinite(x) for x in result.metrics.loss)
    merged = result.model.state_dict()
    assert merged.keys() == before.keys()
