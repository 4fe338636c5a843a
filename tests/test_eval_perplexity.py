"""Unit tests of fedcompress.eval.perplexity on tiny random models (no hub, no files)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.modeling_outputs import CausalLMOutput

from fedcompress.eval import (
    CALC_DTYPE,
    EvalInputError,
    PerplexityResult,
    SeqlenError,
    TextTooShortError,
    perplexity,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Federated learning keeps the data on the clients and shares only updates.",
    "A pruned model keeps the largest weights and drops the rest.",
]
TEXT = " ".join(CORPUS * 6)
CONTEXT = 64


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_model(vocab_size: int, seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        **overrides,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return build_model(len(tokenizer))


def reference_ppl(model: torch.nn.Module, ids: torch.Tensor, seqlen: int) -> tuple[float, int]:
    """Plain forward + cross_entropy on the same non-overlapping windows, one at a time."""
    n_windows = ids.numel() // seqlen
    nll = 0.0
    with torch.no_grad():
        for w in range(n_windows):
            window = ids[w * seqlen : (w + 1) * seqlen].unsqueeze(0)
            logits = model(window).logits[0].float()
            nll += F.cross_entropy(logits[:-1], window[0, 1:], reduction="sum").item()
    return math.exp(nll / (n_windows * (seqlen - 1))), n_windows


def ids_of(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)


# ---------------------------------------------------------------------------- correctness
def test_matches_manual_reference(model, tokenizer) -> None:
    seqlen = 32
    ids = ids_of(tokenizer, TEXT)
    expected, n_windows = reference_ppl(model, ids, seqlen)
    result = perplexity(model, tokenizer, TEXT, seqlen=seqlen, batch_size=2, progress=False)
    assert isinstance(result, PerplexityResult)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.n_windows == n_windows == ids.numel() // seqlen
    assert result.n_tokens == n_windows * (seqlen - 1)
    assert result.seqlen == seqlen
    assert result.mean_nll == pytest.approx(math.log(result.perplexity), rel=1e-9)


def test_no_special_tokens_are_added(model, tokenizer) -> None:
    # Same result from the string and from its special-token-free ids, as 1-D or (1, n).
    seqlen = 16
    ids = ids_of(tokenizer, TEXT)
    from_text = perplexity(model, tokenizer, TEXT, seqlen=seqlen, progress=False)
    from_ids = perplexity(model, None, ids, seqlen=seqlen, progress=False)
    from_2d = perplexity(model, None, ids.unsqueeze(0).int(), seqlen=seqlen, progress=False)
    assert from_text == from_ids == from_2d


@pytest.mark.parametrize("batch_size", [3, 4, 100])
def test_batch_size_does_not_change_result(model, tokenizer, batch_size: int) -> None:
    one = perplexity(model, tokenizer, TEXT, seqlen=16, batch_size=1, progress=False)
    many = perplexity(model, tokenizer, TEXT, seqlen=16, batch_size=batch_size, progress=False)
    assert many.n_windows == one.n_windows
    assert many.perplexity == pytest.approx(one.perplexity, rel=1e-5)


def test_max_windows_keeps_the_first_windows(model, tokenizer) -> None:
    ids = ids_of(tokenizer, TEXT)
    expected, _ = reference_ppl(model, ids[: 3 * 16], 16)
    result = perplexity(model, tokenizer, TEXT, seqlen=16, max_windows=3, progress=False)
    assert result.n_windows == 3
    assert result.perplexity == pytest.approx(expected, rel=1e-4)


def test_uniform_logits_give_vocab_size(tokenizer) -> None:
    model = build_model(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit is 0: uniform over the vocabulary
    result = perplexity(model, tokenizer, TEXT, seqlen=16, batch_size=4, progress=False)
    vocab = model.config.vocab_size
    assert result.perplexity == pytest.approx(vocab, rel=1e-5)
    assert result.nll_sum == pytest.approx(result.n_tokens * math.log(vocab), rel=1e-6)


class _Oracle(torch.nn.Module):
    """Gives probability ``p`` to token ``(x + 1) % V`` after token ``x``, the rest uniformly."""

    def __init__(self, vocab: int, p: float) -> None:
        super().__init__()
        self.vocab, self.p = vocab, p
        self.config = LlamaConfig(vocab_size=vocab, max_position_embeddings=CONTEXT)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the module a device

    def forward(self, input_ids: torch.Tensor, **_: object) -> CausalLMOutput:
        rest = math.log((1 - self.p) / (self.vocab - 1)) if self.p < 1 else -1e4
        logits = torch.full((*input_ids.shape, self.vocab), rest, dtype=torch.bfloat16)
        logits.scatter_(-1, ((input_ids + 1) % self.vocab).unsqueeze(-1), math.log(self.p))
        return CausalLMOutput(logits=logits)


@pytest.mark.parametrize(("p", "expected"), [(1.0, 1.0), (0.25, 4.0), (0.5, 2.0)])
def test_known_predictor_gives_known_perplexity(p: float, expected: float) -> None:
    vocab = 50
    ids = torch.arange(10 * vocab) % vocab
    result = perplexity(_Oracle(vocab, p), None, ids, seqlen=20, batch_size=8, progress=False)
    # bf16 logits are upcast to float32; log(p) and log((1-p)/(V-1)) round in bf16 (~0.4%).
    assert result.perplexity == pytest.approx(expected, rel=1e-2)
    assert result.n_windows == 25


def test_bfloat16_model_is_close_to_float32(model, tokenizer) -> None:
    assert CALC_DTYPE == torch.float32
    bf16 = build_model(len(tokenizer)).to(torch.bfloat16)
    ref = perplexity(model, tokenizer, TEXT, seqlen=32, progress=False)
    low = perplexity(bf16, tokenizer, TEXT, seqlen=32, progress=False)
    assert math.isfinite(low.perplexity)
    assert low.perplexity == pytest.approx(ref.perplexity, rel=0.05)


def test_model_is_not_mutated(tokenizer) -> None:
    # attention dropout would make a training-mode forward random: the result must equal the
    # eval-mode reference, and the training flags and weights must be left as they were.
    model = build_model(len(tokenizer), attention_dropout=0.5)
    ids = ids_of(tokenizer, TEXT)
    expected, _ = reference_ppl(model, ids, 16)
    model.train()
    model.model.layers[0].eval()  # a mixed state must survive too
    flags = {name: m.training for name, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = perplexity(model, tokenizer, TEXT, seqlen=16, batch_size=4, progress=False)
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert {name: m.training for name, m in model.named_modules()} == flags
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_progress_bar_runs(model, tokenizer) -> None:
    result = perplexity(model, tokenizer, TEXT, seqlen=16, max_windows=2, progress=True)
    assert result.n_windows == 2


# ---------------------------------------------------------------------------- errors
def test_seqlen_longer_than_context_names_both(model, tokenizer) -> None:
    with pytest.raises(SeqlenError, match=rf"seqlen={CONTEXT + 1}.*{CONTEXT}"):
        perplexity(model, tokenizer, TEXT, seqlen=CONTEXT + 1, progress=False)


@pytest.mark.parametrize("seqlen", [1, 0, -5])
def test_seqlen_below_two(model, tokenizer, seqlen: int) -> None:
    with pytest.raises(SeqlenError, match=rf"seqlen={seqlen}"):
        perplexity(model, tokenizer, TEXT, seqlen=seqlen, progress=False)


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_empty_text(model, tokenizer, text: str) -> None:
    with pytest.raises(TextTooShortError, match="empty"):
        perplexity(model, tokenizer, text, seqlen=16, progress=False)


def test_empty_ids(model) -> None:
    with pytest.raises(TextTooShortError, match="empty"):
        perplexity(model, None, torch.zeros(0, dtype=torch.long), seqlen=16, progress=False)


def test_text_shorter_than_a_window_names_token_count(model, tokenizer) -> None:
    text = "Paris is the capital of France."
    n = ids_of(tokenizer, text).numel()
    assert 2 <= n < 48
    with pytest.raises(TextTooShortError, match=rf"{n} tokens.*seqlen=48"):
        perplexity(model, tokenizer, text, seqlen=48, progress=False)


def test_errors_are_value_errors(model, tokenizer) -> None:
    with pytest.raises(ValueError):
        perplexity(model, tokenizer, "", seqlen=16, progress=False)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.full((40,), 10_000), r"\[10000, 10000\].*320"),
        (torch.full((40,), -1), r"\[-1, -1\]"),
        (torch.zeros(40), "integer"),
        (torch.zeros(2, 40, dtype=torch.long), r"shape"),
    ],
)
def test_bad_token_ids(model, ids: torch.Tensor, match: str) -> None:
    with pytest.raises(EvalInputError, match=match):
        perplexity(model, None, ids, seqlen=16, progress=False)


def test_bad_batch_size_and_max_windows(model, tokenizer) -> None:
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        perplexity(model, tokenizer, TEXT, seqlen=16, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="max_windows must be >= 1 or None, got 0"):
        perplexity(model, tokenizer, TEXT, seqlen=16, max_windows=0, progress=False)


def test_device_mismatch(model, tokenizer) -> None:
    with pytest.raises(ValueError, match=r"device='meta' but the model is on 'cpu'"):
        perplexity(model, tokenizer, TEXT, seqlen=16, device="meta", progress=False)
    result = perplexity(model, tokenizer, TEXT, seqlen=16, device="cpu", progress=False)
    assert result.n_windows > 0
