"""Block Influence (BI): how much each decoder layer changes the hidden states it receives.

Definition (ShortGPT, Men et al. 2024, as used by PPC-GPT Sec. 3.4, Eq. 6)::

    BI_i = 1 - E_{X,t} [ X_{i,t}^T X_{i+1,t} / (||X_{i,t}||_2 ||X_{i+1,t}||_2) ]

"where X_i denotes the input to the i-th layer, and X_{i,t} represents the t-th row of X_i".
``X_{i+1}`` is the input of layer ``i + 1``, i.e. the output of layer ``i``. PPC-GPT extends it
(Eq. 7) to ``BI_i = BI_Label,i + BI_Rationale,i``, the BI of the forward pass
``f(x) -> y`` (question followed by its label) plus that of ``f(x) -> r`` (question followed by
its rationale). "A higher BI score indicates a more crucial layer"; the layers with the lowest
BI are removed (:mod:`fedcompress.layers.removal`).

How it is computed here (:func:`block_influence`):

* **Sequences.** Each ``(prompt, target)`` pair becomes one sequence: the prompt tokenized with
  the tokenizer's default special tokens (e.g. a BOS), followed by the target tokenized without
  special tokens (the same split as lm-eval's context/continuation). Sequences longer than
  ``max_length`` tokens are cut on the right. They are padded on the right, so every real token
  keeps its position and, in a causal model, never attends to padding.
* **Which rows t count.** The paper's expectation runs over the rows of ``X_i``, the hidden states
  of the whole forward pass ``f(x) -> y``: by default (``positions="all"``) every non-padding
  position of prompt + target counts. ``positions="target"`` counts only the target's positions
  (an option, not the paper's definition). Padding positions (``attention_mask == 0``) never
  count.
* **Expectation.** Over all counted token positions of all examples pooled (every counted token
  weighs the same; a long example weighs more than a short one): ``BI_i = 1 - S_i / N`` with
  ``S_i`` the sum of the row cosines of layer ``i`` and ``N`` the number of counted positions.
* **Hidden states.** Captured by hooks on the decoder layers during ONE forward pass per batch:
  ``X_i`` is exactly what enters layer ``i`` and ``X_{i+1}`` what leaves it. (``transformers``'
  ``output_hidden_states`` is not used: its last entry has the final norm applied, so the last
  layer's BI would compare a raw with a normalized state.) Each layer's cosines are reduced to
  a running sum inside the hook, so only one layer's input is held at a time; the forward pass
  stops after the last layer (no final norm, no LM head).
* **Precision.** Row cosines are computed in ``CALC_DTYPE`` (float32) whatever the model's dtype,
  as ``sum(a * b, -1) / (||a|| ||b||)`` (:func:`row_cosine`); the per-batch sum is float32 and
  batches are added in Python floats (float64). Cosines are not clamped to [-1, 1], so an
  identity layer can get a BI of about -1e-7 instead of 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from fedcompress.eval.common import eval_mode, model_input_device
from fedcompress.layers.importance import LayerImportance, sum_importances
from fedcompress.models import CALC_DTYPE, ModelAdapter, model_context_length

__all__ = [
    "CALC_DTYPE",
    "EncodedPair",
    "LayerPairFn",
    "POSITIONS",
    "QA_PROMPT",
    "block_influence",
    "encode_pairs",
    "label_rationale_influence",
    "qa_label_pairs",
    "row_cosine",
    "stream_layer_io",
]

logger = logging.getLogger(__name__)

#: Which token positions count in the expectation: the whole sequence (the paper's) or the target.
POSITIONS = ("all", "target")

#: Prompt of :func:`qa_label_pairs`; the same as the zero-shot evaluation's default prompt.
QA_PROMPT = "Question: {question}\nAnswer:"


def row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows (last dimension) of ``a`` and ``b``, in ``CALC_DTYPE``.

    ``cos_t = sum(a_t * b_t) / (||a_t||_2 ||b_t||_2)``, computed in float32 whatever the inputs'
    dtype. Zero norms are handled explicitly instead of with an epsilon (which would bias every
    row): if both rows are zero the cosine is 1 (the state is unchanged: a layer that maps zero
    to zero has no influence there); if exactly one row is zero it is 0 (no angle is defined;
    the state appeared or vanished, counted as orthogonal). Not clamped to [-1, 1].
    """
    if a.shape != b.shape:
        raise ValueError(f"row_cosine needs equal shapes, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    a = a.to(CALC_DTYPE)
    b = b.to(CALC_DTYPE)
    dot = (a * b).sum(dim=-1)
    norm_a = torch.linalg.vector_norm(a, dim=-1)
    norm_b = torch.linalg.vector_norm(b, dim=-1)
    denom = norm_a * norm_b
    zero_a, zero_b = norm_a == 0, norm_b == 0
    cos = dot / torch.where(denom > 0, denom, torch.ones_like(denom))
    cos = torch.where(zero_a & zero_b, torch.ones_like(cos), cos)
    return torch.where(zero_a ^ zero_b, torch.zeros_like(cos), cos)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def qa_label_pairs(records: Sequence[Mapping[str, Any]], prompt: str = QA_PROMPT
                   ) -> list[tuple[str, str]]:
    """``(prompt, " " + correct choice)`` pairs from multiple-choice records.

    ``records`` are :class:`fedcompress.data.tasks.TaskExample` dicts (``question``,
    ``choices``, ``label``); ``prompt`` is formatted with ``question``.
    """
    return [(prompt.format(question=r["question"]), " " + str(r["choices"][r["label"]]))
            for r in records]


def _check_pairs(pairs: Sequence[tuple[str, str]], what: str = "pairs") -> None:
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise ValueError(f"{what} must be a sequence of (prompt, target) string pairs, got "
                         f"{type(pairs).__name__}")
    if len(pairs) == 0:
        raise ValueError(f"{what} is empty: expected at least one (prompt, target) pair")
    for k, pair in enumerate(pairs):
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(s, str) for s in pair)):
            raise ValueError(f"{what}[{k}] = {pair!r} is not a (prompt, target) pair of strings")


class EncodedPair(NamedTuple):
    """One tokenized ``prompt + target`` sequence."""

    ids: list[int]  # at most max_length token ids
    target_start: int  # index of the target's first token in ids (len(ids) if cut away)
    full_length: int  # tokens before the cut to max_length


def encode_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]], max_length: int
                 ) -> list[EncodedPair]:
    """Token ids of each ``prompt + target`` and the index where the target starts.

    The prompt is tokenized with the tokenizer's default special tokens, the target without;
    the concatenation is cut to its first ``max_length`` tokens (so the target start is at most
    ``max_length``: a target cut away entirely has no positions left).

    Raises:
        ValueError: empty ``pairs``, malformed pairs, ``max_length < 1``, or a pair that
            tokenizes to no token at all.
    """
    _check_pairs(pairs)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r} is invalid: expected an int >= 1")
    encoded = []
    for k, (prompt, target) in enumerate(pairs):
        p_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        t_ids = list(tokenizer(target, add_special_tokens=False)["input_ids"]) if target else []
        ids = (p_ids + t_ids)[:max_length]
        if not ids:
            raise ValueError(f"pairs[{k}] = {(prompt, target)!r} tokenizes to no token; expected "
                             "at least one token per pair")
        encoded.append(EncodedPair(ids, min(len(p_ids), max_length), len(p_ids) + len(t_ids)))
    return encoded


# --------------------------------------------------------------------------------------------
# Streaming over the layer boundaries
# --------------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised by the last layer's hook: nothing after the decoder layers is needed."""


LayerPairFn = Callable[[int, torch.Tensor, torch.Tensor], None]


def stream_layer_io(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    fn: LayerPairFn) -> None:
    """One forward pass calling ``fn(i, x_in, x_out)`` for every decoder layer ``i`` in order.

    ``x_in`` is the hidden state entering layer ``i`` and ``x_out`` the one leaving it (both
    ``[batch, seq, hidden]`` in the model's dtype). ``fn`` runs inside the layer's forward hook,
    so the caller reduces the states there and nothing is kept; the pass stops after the last
    layer. Meant to be run under ``torch.inference_mode()``.
    """
    layers = ModelAdapter(model).layers
    last = len(layers) - 1
    stash: dict[int, torch.Tensor] = {}

    def pre_hook(index: int):
        def hook(_module, args, kwargs):
            stash[index] = args[0] if args else kwargs["hidden_states"]
        return hook

    def post_hook(index: int):
        def hook(_module, _args, output):
            x_out = output[0] if isinstance(output, (tuple, list)) else output
            fn(index, stash.pop(index), x_out)
            if index == last:
                raise _StopForward
        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(post_hook(i)))
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if getattr(model.config, "use_cache", None) is not None:
            kwargs["use_cache"] = False
        try:
            model(**kwargs)
        except _StopForward:
            pass
        else:  # pragma: no cover - every supported model calls its layers in order
            raise RuntimeError("the forward pass ended without reaching the last decoder layer")
    finally:
        for handle in handles:
            handle.remove()
        stash.clear()


# --------------------------------------------------------------------------------------------
# Block Influence
# --------------------------------------------------------------------------------------------


def _pad_id(tokenizer: Any) -> int:
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def block_influence(
    model: nn.Module,
    tokenizer: Any,
    pairs: Sequence[tuple[str, str]],
    max_length: int = 512,
    batch_size: int = 8,
    positions: str = "all",
    progress: bool = True,
) -> LayerImportance:
    """Block Influence of every decoder layer on ``(prompt, target)`` text (module docstring).

    ``BI_i = 1 - (1/N) sum_{counted (example, t)} cos(X_{i,t}, X_{i+1,t})`` with the cosine of
    :func:`row_cosine` in float32 and ``N`` the counted, non-padding positions: all of
    prompt + target (``positions="all"``, the paper's) or the target's only (``"target"``).

    Args:
        model: A model of a supported architecture
            (:class:`~fedcompress.models.adapter.ModelAdapter`).
            Run in eval mode under ``torch.inference_mode()``, where it lives; its training flags
            are restored after and it is not modified.
        tokenizer: The model's tokenizer.
        pairs: ``(prompt, target)`` strings, e.g. (question, " " + label) or (question,
            " " + rationale). The target follows the prompt directly: put any separator in it.
        max_length: Longest sequence in tokens; longer ones are cut on the right.
        batch_size: Sequences per forward pass. Sequences are batched by decreasing length (less
            padding); the result does not depend on it beyond float noise.
        positions: ``"all"`` or ``"target"``.
        progress: Show a progress bar over the batches.

    Returns:
        A :class:`LayerImportance` with ``method="block_influence"`` (higher: more important).

    Raises:
        ValueError: empty or malformed ``pairs``; ``max_length``, ``batch_size`` or
            ``positions`` out of range; a sequence longer than the model's context; no counted
            token position at all.
    """
    if positions not in POSITIONS:
        raise ValueError(f"positions={positions!r} is invalid: expected one of {POSITIONS}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: expected an int >= 1")
    encoded = encode_pairs(tokenizer, pairs, max_length)
    longest = max(len(e.ids) for e in encoded)
    context = model_context_length(model)
    if context is not None and longest > context:
        raise ValueError(f"the longest sequence has {longest} tokens, more than the model's "
                         f"context of {context}: expected max_length <= {context}")
    n_layers = len(ModelAdapter(model))
    device = model_input_device(model)
    pad = _pad_id(tokenizer)
    order = sorted(range(len(encoded)), key=lambda k: -len(encoded[k].ids))  # stable
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]

    sums = [0.0] * n_layers
    n_counted = 0
    no_tokens = 0
    start = time.perf_counter()
    with eval_mode(model), torch.inference_mode():
        for batch in tqdm(batches, desc="block influence", unit="batch", disable=not progress):
            input_ids, attention, counted, empty = pack_batch([encoded[k] for k in batch], pad,
                                                              positions)
            no_tokens += empty
            n_batch = int(counted.sum())
            if n_batch == 0:
                continue
            n_counted += n_batch
            counted = counted.to(device)

            def accumulate(i: int, x_in: torch.Tensor, x_out: torch.Tensor,
                           mask: torch.Tensor = counted) -> None:
                sums[i] += float(row_cosine(x_in, x_out)[mask].sum())

            stream_layer_io(model, input_ids.to(device), attention.to(device), accumulate)
    seconds = time.perf_counter() - start
    if n_counted == 0:
        raise ValueError(f"no token position to average over: all {len(encoded)} pairs have an "
                         f"empty target after truncation to max_length={max_length} "
                         f"(positions={positions!r}); expected at least one counted position")
    if no_tokens:
        logger.warning("%d of %d pairs have no %s token within max_length=%d and do not count",
                       no_tokens, len(encoded), positions, max_length)
    scores = tuple(1.0 - s / n_counted for s in sums)
    logger.info("block influence over %d pairs, %d positions (%s) in %.1fs: min %.4g at layer "
                "%d, max %.4g at layer %d", len(encoded), n_counted, positions, seconds,
                min(scores), scores.index(min(scores)), max(scores), scores.index(max(scores)))
    return LayerImportance(
        method="block_influence", scores=scores, n_examples=len(encoded), n_tokens=n_counted,
        info={"positions": positions, "max_length": max_length, "batch_size": batch_size,
              "truncated": sum(1 for e in encoded if e.full_length > max_length),
              "pairs_without_counted_tokens": no_tokens, "seconds": seconds})


def pack_batch(encoded: Sequence[EncodedPair], pad: int, positions: str = "target"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Right-padded ``input_ids`` and ``attention`` of encoded pairs (``ids``, ``target_start``,
    ...), the mask of the positions that count (``all`` tokens, or the ``target`` ones), and
    how many pairs have no counted position."""
    width = max(len(e.ids) for e in encoded)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    counted = torch.zeros((len(encoded), width), dtype=torch.bool)
    empty = 0
    for row, (ids, target_start, *_) in enumerate(encoded):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, :len(ids)] = 1
        first = 0 if positions == "all" else target_start
        counted[row, first:len(ids)] = True
        empty += first >= len(ids)
    return input_ids, attention, counted, empty


def label_rationale_influence(
    model: nn.Module,
    tokenizer: Any,
    label_pairs: Sequence[tuple[str, str]],
    rationale_pairs: Sequence[tuple[str, str]],
    **kwargs: Any,
) -> LayerImportance:
    """PPC-GPT's BI (Eq. 7): ``BI_i = BI_Label,i + BI_Rationale,i``.

    ``BI_Label`` is :func:`block_influence` on ``label_pairs`` (question -> label), and
    ``BI_Rationale`` on ``rationale_pairs`` (question -> rationale), each with its own
    expectation over its own tokens, then summed layer by layer (so the sum ranges over
    [0, 4] rather than [0, 2]). ``kwargs`` go to both calls. Both parts are kept in
    ``components`` (methods ``block_influence:label`` and ``block_influence:rationale``).
    """
    _check_pairs(label_pairs, "label_pairs")
    _check_pairs(rationale_pairs, "rationale_pairs")
    label = block_influence(model, tokenizer, label_pairs, **kwargs)
    rationale = block_influence(model, tokenizer, rationale_pairs, **kwargs)
    return sum_importances(
        [dataclasses.replace(label, method="block_influence:label"),
         dataclasses.replace(rationale, method="block_influence:rationale")],
        method="block_influence:label+rationale")
