"""DP-LoRA cannot silently break: one DP step moves every adapter weight by exactly the optimizer
step of the clipped, noised per-example gradients, on the pinned opacus/peft pair.

Opacus users report LoRA updates silently corrupted with some opacus/peft pairs (opacus issue
820: opacus 1.5.4 with peft 0.14-0.18 registers its per-example hooks wrongly on peft's LoRA
layers; the loss and the epsilon look normal while the adapters get wrong gradients). These
tests recompute everything opacus does from an independent reference, outside opacus:

* each example's gradient of every LoRA weight, by a plain backward pass of that example alone
  through the unwrapped model;
* their flat clipping to ``max_grad_norm``, their sum, the Gaussian noise of the seeded
  generator (``noise_multiplier * max_grad_norm``, drawn parameter by parameter as opacus does),
  the division by the expected batch size;
* the optimizer's step (SGD: ``-lr * grad``; AdamW's first step, through torch's own AdamW on a
  copy).

and compare with what fedcompress' DP path (:func:`~fedcompress.privacy.finetune._make_private`
and its step, :func:`~fedcompress.privacy.finetune._step`) did to the model. If a future opacus
or peft breaks this, these tests fail; keep the pins where they pass.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from fedcompress.privacy.classifier import (
    LabelTokenClassifier,
    encode_lm,
    encode_texts,
    lm_loss,
    logits_of,
    pad_batch,
    pad_id,
)
from fedcompress.privacy.finetune import FinetuneConfig, _make_private, _step, prepare_trainable

TEXTS = ["the king was new", "the queen was first", "a river of war", "the city had people",
         "a new king of the city", "the first river", "the war was new", "a king had people",
         "the queen of war", "the river was first", "a city was new", "the people had war"]
SIGMA, CLIP, SEED = 0.7, 0.05, 11


def test_the_pinned_pair_is_the_one_these_tests_checked():
    """The pins of pyproject.toml: a change of either package must re-run these tests."""
    assert importlib.metadata.version("opacus") == "1.6.0"
    assert importlib.metadata.version("peft") == "0.21.2"


def _lora_model(tiny_model, tokenizer, objective):
    torch.manual_seed(0)
    base = tiny_model("llama", n_layers=2)
    model = LabelTokenClassifier(base, tokenizer, ["yes", "no"]) if objective == "classify" \
        else base
    config = FinetuneConfig(mode="lora", epsilon=1.0, max_grad_norm=CLIP, batch_size=4,
                            lora_r=4, lora_alpha=8)
    model, _ = prepare_trainable(model, config)
    # peft starts lora_B at zero, so every lora_A gradient would be zero: start from a random B
    # (as after some training) so that both factors have per-example gradients to check.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model, config


def _data(tokenizer, objective):
    if objective == "classify":
        return encode_texts(tokenizer, TEXTS, [i % 2 for i in range(len(TEXTS))], 32, True, 2)
    return encode_lm(tokenizer, TEXTS, 32)


def _loss(model, train, rows, pad):
    input_ids, attention = pad_batch([train.ids[i] for i in rows], pad)
    if train.language_modelling:
        return lm_loss(model, input_ids, attention).mean()
    labels = torch.tensor([train.labels[i] for i in rows])
    return torch.nn.functional.cross_entropy(logits_of(model, input_ids, attention), labels)


def _reference_step(model, train, batch, pad):
    """Per-example gradients of the trainable weights, by one plain backward per example (the
    unwrapped model, no opacus); then clipped, summed, noised and averaged as DP-SGD says."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_example = []
    for i in batch:
        model.zero_grad(set_to_none=True)
        _loss(model, train, [i], pad).backward()
        per_example.append({n: p.grad.detach().clone() for n, p in params.items()})
    model.zero_grad(set_to_none=True)
    norms = torch.stack([torch.cat([g.flatten() for g in e.values()]).norm() for e in per_example])
    factors = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    noise = torch.Generator().manual_seed(SEED)
    grads = {}
    for n in params:  # opacus draws the noise parameter by parameter, in parameter order
        summed = sum(f * e[n] for f, e in zip(factors, per_example, strict=True))
        drawn = torch.normal(0.0, SIGMA * CLIP, summed.shape, generator=noise)
        grads[n] = (summed + drawn) / 4  # the expected batch size (loss_reduction="mean")
    return per_example, norms, grads


@pytest.mark.parametrize("objective", ["classify", "lm"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_one_dp_step_moves_each_adapter_weight_exactly(tiny_model, tiny_tokenizer, objective,
                                                       optimizer_name):
    model, config = _lora_model(tiny_model, tiny_tokenizer, objective)
    pad = pad_id(tiny_tokenizer)
    train = _data(tiny_tokenizer, objective)
    # four rows of one length: each example alone is then padded exactly as in the batch
    lengths = [len(ids) for ids in train.ids]
    common = max(set(lengths), key=lengths.count)
    batch = [i for i, n in enumerate(lengths) if n == common][:4]
    assert len(batch) == 4, lengths
    model.train()
    per_example, norms, expected_grads = _reference_step(model, train, batch, pad)
    assert (norms > CLIP).all(), "every example is clipped, so clipping is exercised"
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert named and all("lora_" in n for n in named), sorted(named)
    assert all(e[n].abs().sum() > 0 for e in per_example for n in named), \
        "every adapter weight has a per-example gradient to check"
    before = {n: p.detach().clone() for n, p in named.items()}

    params = list(named.values())
    inner = torch.optim.SGD(params, lr=0.5) if optimizer_name == "sgd" else \
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    runner, optimizer = _make_private(model, inner, SIGMA, config,
                                      torch.Generator().manual_seed(SEED))
    runner.train()
    _step(runner, optimizer, train, batch, pad, torch.device("cpu"))

    # opacus' per-example gradients are the reference's, weight by weight
    for n, p in named.items():
        torch.testing.assert_close(p.grad_sample, torch.stack([e[n] for e in per_example]),
                                   rtol=1e-4, atol=1e-7, msg=f"per-example gradient of {n}")
    # the gradient the optimizer used: clipped, summed, noised, averaged
    for n, p in named.items():
        torch.testing.assert_close(p.grad, expected_grads[n], rtol=1e-4, atol=1e-7,
                                   msg=f"DP gradient of {n}")
    # and the weights moved by exactly the optimizer's step of that gradient
    replay = {n: before[n].clone().requires_grad_(True) for n in named}
    check = torch.optim.SGD(replay.values(), lr=0.5) if optimizer_name == "sgd" else \
        torch.optim.AdamW(replay.values(), lr=1e-2, weight_decay=0.0)
    for n, q in replay.items():
        q.grad = expected_grads[n].clone()
    check.step()
    for n, p in named.items():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not move"
        torch.testing.assert_close(p.detach(), replay[n].detach(), rtol=1e-4, atol=1e-6,
                                   msg=f"step of {n}")
    # the frozen base model did not move
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)
