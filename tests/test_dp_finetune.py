"""DP-SGD fine-tuning (PrunePrivyTune Sec. 4.2): accounting, clipping, LoRA and full training."""

from __future__ import annotations

import math

import pytest
import torch

from fedcompress.privacy.accounting import (
    RDP_ALPHAS,
    BudgetError,
    epsilon_spent,
    noise_multiplier,
    noise_seed,
)
from fedcompress.privacy.classifier import (
    LabelTokenClassifier,
    classify,
    encode_texts,
    pad_batch,
    pad_id,
)
from fedcompress.privacy.finetune import (
    FinetuneConfig,
    _make_private,
    finetune,
    prepare_trainable,
)

TEXTS = ["the king was new", "the queen was first", "a river of war", "the city had people"]


def data(tokenizer, decoder=True, copies=16):
    return encode_texts(tokenizer, TEXTS * copies, [0, 1, 0, 1] * copies, 32, decoder, 2)


def decoder_classifier(tiny_model, tokenizer):
    return LabelTokenClassifier(tiny_model("llama", n_layers=2), tokenizer, ["yes", "no"])


def bert_classifier():
    import transformers as tf
    from conftest import tiny_config

    torch.manual_seed(0)
    config = tiny_config("bert", n_layers=2)
    config.num_labels = 2
    return tf.BertForSequenceClassification(config).eval()


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_reported_epsilon_is_the_accountants(accountant):
    from opacus.accountants import create_accountant

    sigma = noise_multiplier(3.0, 1e-5, 0.02, 150, accountant)
    reference = create_accountant(accountant)
    for _ in range(150):
        reference.step(noise_multiplier=sigma, sample_rate=0.02)
    kwargs = {"alphas": RDP_ALPHAS} if accountant == "rdp" else {}
    assert epsilon_spent(sigma, 0.02, 150, 1e-5, accountant) == pytest.approx(
        reference.get_epsilon(delta=1e-5, **kwargs), rel=1e-9)
    assert epsilon_spent(sigma, 0.02, 150, 1e-5, accountant) <= 3.0 + 1e-9
    assert epsilon_spent(sigma, 0.02, 50, 1e-5, accountant) < 3.0  # fewer steps spend less


@pytest.mark.parametrize("epsilon,delta,match", [
    (0.0, 1e-5, "epsilon=0.0 is invalid"), (-1.0, 1e-5, "epsilon=-1.0 is invalid"),
    (float("inf"), 1e-5, "epsilon=inf is invalid"), (1.0, 0.0, "delta=0.0 is invalid"),
    (1.0, 1.0, "delta=1.0 is invalid")])
def test_bad_budgets_are_named(epsilon, delta, match):
    with pytest.raises(BudgetError, match=match):
        noise_multiplier(epsilon, delta, 0.01, 100)
    with pytest.raises(BudgetError, match=match):
        FinetuneConfig(epsilon=epsilon, delta=delta)


def test_an_unreachable_target_is_an_error():
    with pytest.raises(BudgetError, match="no noise multiplier reaches epsilon=1e-06"):
        noise_multiplier(1e-6, 1e-12, 1.0, 10_000)


def test_per_example_gradients_are_clipped(tiny_model, tiny_tokenizer):
    """Through opacus' grad samples: each example's clipped gradient has norm <= C, and the step's
    summed gradient (noise 0) is exactly the sum of the clipped per-example gradients."""
    config = FinetuneConfig(mode="full", epsilon=1.0, max_grad_norm=0.01, batch_size=4)
    model, _ = prepare_trainable(decoder_classifier(tiny_model, tiny_tokenizer), config)
    params = [p for p in model.parameters() if p.requires_grad]
    runner, optimizer = _make_private(model, torch.optim.SGD(params, lr=0.1), 0.0, config)
    runner.train()  # opacus records activations in training mode only
    train = data(tiny_tokenizer, copies=1)
    input_ids, attention = pad_batch(train.ids, pad_id(tiny_tokenizer))
    logits = runner(input_ids=input_ids, attention_mask=attention)
    torch.nn.functional.cross_entropy(logits, torch.tensor(train.labels)).backward()
    samples = [p.grad_sample.detach().clone() for p in params]
    assert all(s.shape[0] == 4 for s in samples)
    norms = torch.stack([s.flatten(1).norm(dim=1) for s in samples], 1).norm(dim=1)
    assert (norms > config.max_grad_norm).all()  # the test means something: all get clipped
    optimizer.clip_and_accumulate()
    factors = (config.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    for p, s in zip(params, samples):
        expected = torch.einsum("i,i...->...", factors, s)
        assert torch.allclose(p.summed_grad, expected, atol=1e-7)
    clipped = torch.cat([(factors[:, None] * s.flatten(1)) for s in samples], 1)
    assert (clipped.norm(dim=1) <= config.max_grad_norm * (1 + 1e-5)).all()


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_dp_finetuning_lowers_the_loss(tiny_model, tiny_tokenizer, kind, mode):
    model = (decoder_classifier(tiny_model, tiny_tokenizer) if kind == "decoder"
             else bert_classifier())
    train = data(tiny_tokenizer, decoder=kind == "decoder")
    before = classify(model, train, pad_id(tiny_tokenizer))["loss"]
    config = FinetuneConfig(mode=mode, epochs=4, batch_size=8, lr=3e-3, epsilon=50.0,
                            delta=1e-3)
    result = finetune(model, train, config, pad_id(tiny_tokenizer), progress=False)
    after = classify(result.model, train, pad_id(tiny_tokenizer))["loss"]
    assert after < before
    assert result.budget.spent <= 50.0 and result.budget.steps == config.steps_for(64) == 32
    assert result.budget.sigma > 0 and math.isfinite(result.budget.spent)


def _dp_runs(tiny_model, tiny_tokenizer, noise_seed):
    runs = []
    for _ in range(2):
        config = FinetuneConfig(epochs=1, batch_size=8, epsilon=5.0, delta=1e-3, seed=3,
                                noise_seed=noise_seed)
        result = finetune(decoder_classifier(tiny_model, tiny_tokenizer), data(tiny_tokenizer),
                          config, pad_id(tiny_tokenizer), progress=False)
        runs.append((result.losses, [p.detach().clone() for p in result.model.parameters()],
                     result.notes))
    return runs


def test_same_seed_same_weights(tiny_model, tiny_tokenizer):
    """With a noise seed (research), the same config gives the same losses and weights, and the
    result says that the epsilon does not hold against whoever knows the seed."""
    runs = _dp_runs(tiny_model, tiny_tokenizer, noise_seed=11)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert any("noise_seed=11" in n and "does NOT hold" in n for n in runs[0][2])


def test_dp_noise_is_secret_by_default(tiny_model, tiny_tokenizer):
    """Without a noise seed the DP noise and the Poisson batches come from fresh OS entropy: the
    same config (same initialisation) samples other batches (other losses) and ends with
    different weights, and no seed is reported (a reader who could replay the noise could
    subtract it; one who knew the batches would lose the amplification by subsampling)."""
    runs = _dp_runs(tiny_model, tiny_tokenizer, noise_seed=None)
    assert runs[0][0] != runs[1][0]
    assert not all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert not any("noise_seed" in n for n in runs[0][2])
    assert noise_seed(None) != noise_seed(None)
    assert noise_seed(4, 1) == noise_seed(4, 1) != noise_seed(4, 2)
    assert 0 <= noise_seed(None) < 2**63
    with pytest.raises(ValueError, match="noise seed=-2 is invalid"):
        FinetuneConfig(noise_seed=-2)


def test_empty_split_and_bad_labels_are_named(tiny_tokenizer):
    with pytest.raises(ValueError, match="the split is empty"):
        encode_texts(tiny_tokenizer, [], [], 32, True, 2)
    with pytest.raises(ValueError, match=r"labels \[\(1, 2\)\] .* outside \[0, 2\)"):
        encode_texts(tiny_tokenizer, ["a", "b"], [0, 2], 32, True, 2)


def test_label_words_must_start_with_distinct_tokens(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="do not start with distinct tokens"):
        LabelTokenClassifier(tiny_model("llama", 1), tiny_tokenizer, ["the king", "the queen"])


def test_per_example_gradients_are_exact_with_tied_embeddings(tiny_tokenizer):
    """Full fine-tuning of a decoder whose LM head is its embedding matrix (SmolLM2's case):
    opacus adds both uses into one per-example gradient, and the mean of the per-example
    gradients is the batch gradient for every trainable weight (norms included)."""
    import transformers as tf
    from conftest import tiny_config

    from fedcompress.privacy.classifier import encode_lm, lm_loss

    config = tiny_config("llama", 2)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    enc = encode_lm(tiny_tokenizer, ["the king was new and the queen was first",
                                     "a river of war in the city"], 16)
    dp = FinetuneConfig(mode="full", epsilon=1.0, batch_size=2)
    model, _ = prepare_trainable(model, dp)
    params = dict(model.named_parameters())
    runner, _ = _make_private(model, torch.optim.SGD(params.values(), lr=0.1), 0.0, dp)
    runner.train()
    input_ids, attention = pad_batch(enc.ids, pad_id(tiny_tokenizer))
    lm_loss(runner, input_ids, attention).mean().backward()
    for name, p in params.items():
        assert p.grad_sample.shape[0] == 2, name
        assert torch.allclose(p.grad_sample.mean(0), p.grad, atol=1e-6), name


@pytest.mark.parametrize("epsilon", [5.0, None])
def test_physical_batches_take_the_same_step_as_the_whole_batch(tiny_model, tiny_tokenizer,
                                                                epsilon):
    """A logical batch in chunks of 3 (opacus' skip-step accumulation under DP, gradient
    accumulation without) gives the weights and losses of the whole batch at once, up to float
    summation order and padding: the same clipped sum, the same noise added once."""
    runs = []
    for physical in (0, 3):
        config = FinetuneConfig(mode="full", epochs=2, batch_size=8, epsilon=epsilon,
                                delta=1e-3, seed=3, lr=1e-2, physical_batch_size=physical,
                                noise_seed=5)
        result = finetune(decoder_classifier(tiny_model, tiny_tokenizer),
                          data(tiny_tokenizer, copies=4), config, pad_id(tiny_tokenizer),
                          progress=False)
        runs.append((result.losses, [p.detach().clone() for p in result.model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5, nan_ok=True)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)  # Adam: lr 1e-2, 4 steps
    with pytest.raises(ValueError, match="physical_batch_size=-1 is invalid"):
        FinetuneConfig(physical_batch_size=-1)
