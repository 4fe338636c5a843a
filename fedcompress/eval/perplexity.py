"""Perplexity of a causal language model on a text, in non-overlapping windows.

The protocol is the one of the pruning literature (SparseGPT, Wanda): the whole text is tokenized
once and cut into consecutive windows of ``seqlen`` tokens; see :func:`perplexity` for the exact
definition.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fedcompress.eval.common import eval_mode, resolve_device
from fedcompress.eval.errors import EvalInputError, SeqlenError, TextTooShortError
from fedcompress.models import CALC_DTYPE, model_context_length

__all__ = ["CALC_DTYPE", "PerplexityResult", "perplexity", "tokenize_text"]

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class PerplexityResult:
    """Outcome of :func:`perplexity`.

    Attributes:
        perplexity: ``exp(nll_sum / n_tokens)``.
        nll_sum: Total negative log-likelihood in nats over all predicted tokens.
        n_tokens: Number of predicted tokens, ``n_windows * (seqlen - 1)``.
        n_windows: Number of windows evaluated.
        seqlen: Window length in tokens.
        seconds: Wall-clock time of the forward passes (not compared in ``==``).
    """

    perplexity: float
    nll_sum: float
    n_tokens: int
    n_windows: int
    seqlen: int
    seconds: float = field(default=0.0, compare=False)

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood per predicted token (nats); ``log(perplexity)``."""
        return self.nll_sum / self.n_tokens

    @property
    def tokens_per_second(self) -> float:
        """Throughput in window tokens (inputs) per second of forward time."""
        return self.n_windows * self.seqlen / self.seconds if self.seconds > 0 else math.inf


def tokenize_text(tokenizer: Any, text: str) -> torch.Tensor:
    """Tokenize ``text`` once, without special tokens, into a 1-D ``int64`` tensor.

    Raises:
        TextTooShortError: if ``text`` is empty or only whitespace.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise TextTooShortError("text is empty (or only whitespace); nothing to evaluate")
    if tokenizer is None:
        raise ValueError("tokenizer is None but text is a str; pass a tokenizer or token ids")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return torch.as_tensor(ids["input_ids"], dtype=torch.long)


def _as_token_ids(text: str | torch.Tensor, tokenizer: Any) -> torch.Tensor:
    if isinstance(text, torch.Tensor):
        ids = text
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise EvalInputError(
                f"token ids must have shape (n,) or (1, n), got {tuple(text.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise EvalInputError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
        if ids.numel() == 0:
            raise TextTooShortError("token ids are empty; nothing to evaluate")
        return ids.detach().to("cpu", torch.long)
    return tokenize_text(tokenizer, text)


def _vocab_size(model: Any) -> int | None:
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    n = getattr(emb, "num_embeddings", None)
    if isinstance(n, int):
        return n
    return getattr(getattr(model, "config", None), "vocab_size", None)


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    text: str | torch.Tensor,
    seqlen: int,
    batch_size: int = 1,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of a causal LM on ``text``, over non-overlapping windows of ``seqlen`` tokens.

    Definition:
        1. The text is tokenized once, as a whole, without special tokens (no BOS/EOS are added,
           neither at the start of the text nor at the start of each window). Token ids may also
           be given directly as a 1-D ``LongTensor``.
        2. The ids are cut into ``W = floor(N / seqlen)`` consecutive, non-overlapping windows of
           exactly ``seqlen`` tokens; the ``N mod seqlen`` tail tokens are dropped. With
           ``max_windows``, only the first ``max_windows`` windows are kept.
        3. Each window is a separate forward pass that starts with an empty context. Position
           ``t`` (``0 <= t < seqlen - 1``) predicts token ``t + 1``; the first token of each
           window is never predicted. That is ``seqlen - 1`` predicted tokens per window and
           ``n_tokens = W * (seqlen - 1)`` in total.
        4. The negative log-likelihood of each predicted token is ``-log_softmax(logits)[token]``
           with the logits upcast to ``CALC_DTYPE`` (float32) before the log-softmax, whatever
           the model's dtype. Per-window sums are taken in float32 and added up across windows
           in float64.
        5. ``perplexity = exp(nll_sum / n_tokens)``.

        This is the SparseGPT/Wanda protocol (joined text, non-overlapping windows, tail dropped,
        no BOS per window). The only difference is that those scripts tokenize with the
        tokenizer's default special tokens, so for LLaMA tokenizers their first window starts
        with a BOS token; here no special token is ever inserted. Their ``exp(sum_w mean_w *
        seqlen / (W * seqlen))`` equals ``exp(nll_sum / n_tokens)`` since every window predicts
        the same number of tokens.

    Memory: one batch materializes ``batch_size * seqlen * vocab`` logits in the model's dtype,
    plus ``seqlen * vocab`` float32 values for the log-softmax of one window at a time.

    Args:
        model: A causal LM returning ``logits`` of shape ``(batch, seqlen, vocab)``. It is run in
            eval mode under ``torch.inference_mode()``; its training flags are restored after, and
            it is neither moved nor modified.
        tokenizer: Tokenizer used when ``text`` is a string (ignored for token ids; may be None).
        text: The evaluation text, or its token ids (shape ``(n,)`` or ``(1, n)``).
        seqlen: Window length in tokens, ``2 <= seqlen <= model context length``.
        batch_size: Windows per forward pass (does not change the result beyond float noise).
        max_windows: Evaluate only the first ``max_windows`` windows (all if None).
        device: Device for the inputs. ``None``: where the model's input embeddings are. The
            model is not moved; a device that disagrees with the model's raises ``ValueError``.
        progress: Show a progress bar over the batches.

    Returns:
        A :class:`PerplexityResult`.

    Raises:
        SeqlenError: ``seqlen < 2`` or ``seqlen`` larger than the model's context length.
        TextTooShortError: empty text, or fewer than ``seqlen`` tokens.
        EvalInputError: malformed token ids (shape, dtype, or ids outside the model's vocabulary).
        ValueError: ``batch_size`` or ``max_windows`` below 1, or a device mismatch.
    """
    _check_seqlen(model, seqlen)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    ids = _checked_ids(model, _as_token_ids(text, tokenizer), seqlen)
    n_ids = int(ids.numel())
    n_windows = n_ids // seqlen
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    windows = ids[: n_windows * seqlen].view(n_windows, seqlen)
    dev = resolve_device(model, device)
    logger.info(
        "perplexity: %d tokens -> %d window(s) of %d tokens (%d tail tokens dropped), "
        "batch_size=%d, device=%s",
        n_ids,
        n_windows,
        seqlen,
        n_ids % seqlen,
        batch_size,
        dev,
    )

    t0 = time.perf_counter()
    nll_sum = _nll_sum(model, windows, batch_size, dev, progress)
    seconds = time.perf_counter() - t0

    n_tokens = n_windows * (seqlen - 1)
    result = PerplexityResult(
        perplexity=math.exp(nll_sum / n_tokens),
        nll_sum=nll_sum,
        n_tokens=n_tokens,
        n_windows=n_windows,
        seqlen=seqlen,
        seconds=seconds,
    )
    logger.info(
        "perplexity=%.4f over %d predicted tokens (%d windows) in %.1fs (%.0f tokens/s)",
        result.perplexity,
        n_tokens,
        n_windows,
        seconds,
        result.tokens_per_second,
    )
    return result
def _check_seqlen(model: nn.Module, seqlen: int) -> None:
    """A window of ``seqlen`` tokens predicts at least one token and fits the model."""
    if isinstance(seqlen, bool) or not isinstance(seqlen, int):
        raise TypeError(f"seqlen must be an int, got {type(seqlen).__name__}")
    if seqlen < 2:
        raise SeqlenError(
            f"seqlen={seqlen} is too short: a window needs at least 2 tokens "
            "(one context token and one predicted token)"
        )
    context = model_context_length(model)
    if context is not None and seqlen > context:
        raise SeqlenError(
            f"seqlen={seqlen} exceeds the model context length of {context} tokens "
            "(config.max_position_embeddings or equivalent)"
        )
    if context is None:
        logger.warning("model config declares no context length; cannot check seqlen=%d", seqlen)


def _checked_ids(model: nn.Module, ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """``ids`` if they fill one window and lie inside the model's vocabulary."""
    n_ids = int(ids.numel())
    if n_ids < seqlen:
        raise TextTooShortError(
            f"text has {n_ids} tokens, fewer than one window of seqlen={seqlen} tokens"
        )
    vocab = _vocab_size(model)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise EvalInputError(
            f"token ids span [{lo}, {hi}] but the model vocabulary has {vocab} entries "
            "(is the tokenizer the model's?)"
        )
    return ids


def _nll_sum(model: nn.Module, windows: torch.Tensor, batch_size: int, dev: torch.device,
             progress: bool) -> float:
    """Summed negative log-likelihood of every window's next tokens (float32 per window,
    float64 across windows)."""
    nll_sum = 0.0  # Python float: float64 accumulation across windows
    with eval_mode(model), torch.inference_mode():
        for start in tqdm(
            range(0, len(windows), batch_size),
            desc=f"perplexity (seqlen {windows.shape[1]})",
            unit="batch",
            disable=not progress,
            leave=False,
        ):
            batch = windows[start : start + batch_size].to(dev)
            out = model(input_ids=batch, use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            window_nll = torch.empty(batch.shape[0], dtype=CALC_DTYPE, device=logits.device)
            targets = batch[:, 1:].to(logits.device)
            for row in range(batch.shape[0]):
                # One window at a time: seqlen x vocab in float32, never batch x seqlen x vocab.
                logp = torch.log_softmax(logits[row, :-1].to(CALC_DTYPE), dim=-1)
                token_logp = logp.gather(-1, targets[row].unsqueeze(-1)).squeeze(-1)
                window_nll[row] = -token_logp.sum()
            nll_sum += float(window_nll.cpu().to(torch.float64).sum())
            del out, logits
    return nll_sum


