"""What a DP statistics release is computed from (:mod:`fedcompress.privacy.dp_stats`): each
calibration window's statistics of a decoder layer, their clipping to public bounds, and the
public text those bounds and scales come from (the bundled corpora, or a file pinned by its
SHA-256). Plain torch, no Flower."""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedcompress.data.corpora import BUNDLED_CORPORA

#: How input coordinates are scaled before a window's statistics are clipped: by their public
#: per-token mean square (``public``), or not at all (``none``).
NORMALIZATIONS = ("public", "none")
#: Smallest public scale, relative to the block's largest (a coordinate that is (nearly) zero on
#: public text is scaled as if it were this small: its private values are then clipped, not
#: blown up to infinity).
SCALE_FLOOR = 1e-6
#: Quantile of the public per-window norms used as the default clip bound of each block.
CLIP_QUANTILE = 0.95
#: The public corpus the default bounds come from (bundled with the package), and its split
#: (not the calibration split ``train`` nor the evaluation split ``test``).
PUBLIC_CORPUS = "wiki"
PUBLIC_SPLIT = "validation"
#: The public texts a run may name instead (``dp_public_text``: the bundled corpora, their
#: :data:`PUBLIC_SPLIT` split), or a pinned file (:data:`DIGEST_PREFIX`). Never a path: a file
#: the server named could be a site's own data, and bounds or scales from it would make the
#: mechanism depend on private text.
PUBLIC_CORPORA = BUNDLED_CORPORA
#: A pinned public text: ``sha256:`` and the 64 hex digits of the SHA-256 of a file (``.txt`` or
#: ``.jsonl``, read as :func:`~fedcompress.data.corpora.load_corpus` reads a local file, the
#: whole file) that the federation publishes and every party holds a copy of: each site finds
#: it among the files its own operator listed as public (node config ``dp-public-files``),
#: the server at its ``dp_public_file``; the digest makes every party's copy the same text.
DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: Public windows the default bounds are measured on.
PUBLIC_WINDOWS = 32


# -- per-window statistics and clipping ------------------------------------------------------


def layer_blocks(layer: nn.Module, inputs: Any) -> dict[str, str]:
    """``{linear name: owner}``: the owner (first in sorted order) of the distinct input tensor
    each linear layer of ``layer`` reads (what one batch of ``inputs`` shows)."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import _call_layer, observed_input_owners

    return observed_input_owners(
        ModelAdapter.linear_layers(layer),
        lambda: _call_layer(layer, inputs.hidden[:1], inputs.layer_kwargs[inputs.layer]))


@torch.no_grad()
def window_inputs(layer: nn.Module, inputs: Any, batch_size: int = 8,
                  scales: Mapping[str, torch.Tensor] | None = None
                  ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Per batch of windows: ``(first window index, {owner: X [b, t, d]})``, the float64
    inputs of every distinct input of ``layer`` (one per owner, :func:`layer_blocks`); with
    ``scales`` (``{owner: c}``, :func:`public_scales`), the normalized inputs
    ``x_j / sqrt(c_j)``. The windows' statistics (:func:`window_sums`, :func:`window_norms`)
    are computed from these."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import _batches, _call_layer

    owners = layer_blocks(layer, inputs)
    linears = ModelAdapter.linear_layers(layer)
    kwargs = inputs.layer_kwargs[inputs.layer]
    xs: dict[str, torch.Tensor] = {}
    inv = None
    if scales is not None:
        missing = sorted(set(owners.values()) - set(scales))
        if missing:
            raise ValueError(f"no public scales for blocks {missing}: expected one per "
                             "distinct input")
        inv = {k: torch.as_tensor(c, dtype=torch.float64).rsqrt() for k, c in scales.items()}

    def hook(_m, args, name):
        if owners[name] != name:
            return
        x = args[0].to(torch.float64)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if inv is not None:
            if inv[name].shape[0] != x.shape[-1]:
                raise ValueError(f"public scales of {name}: {inv[name].shape[0]} coordinates, "
                                 f"its input has {x.shape[-1]}")
            x = x * inv[name].to(x.device)
        xs[name] = x

    for rows in _batches(len(inputs.hidden), batch_size):
        xs.clear()
        handles = [m.register_forward_pre_hook(lambda _m, a, name=name: hook(_m, a, name))
                   for name, m in linears.items()]
        try:
            _call_layer(layer, inputs.hidden[rows], kwargs)
        finally:
            for handle in handles:
                handle.remove()
        yield rows.start, dict(xs)


def window_sums(layer: nn.Module, inputs: Any, hessian: bool, batch_size: int = 8,
                scales: Mapping[str, torch.Tensor] | None = None
                ) -> Iterator[tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Per batch of windows: ``(first window index, {owner: square sums [b, d]},
    {owner: 2 X_w^T X_w [b, d, d]})`` (float64; the Hessians only with ``hessian``), each
    window's own statistics of every distinct input of ``layer``; with ``scales`` (``{owner:
    c}``, :func:`public_scales`), of the normalized inputs ``x_j / sqrt(c_j)``. Each window's
    Hessian is materialized: a site's release does not need them (:func:`clipped_layer_stats`
    clips from :func:`window_norms`), an attacker scoring single windows does."""
    for start, xs in window_inputs(layer, inputs, batch_size, scales):
        sq = {k: x.pow(2).sum(1) for k, x in xs.items()}
        hs = ({k: torch.einsum("bti,btj->bij", x, x).mul_(2.0) for k, x in xs.items()}
              if hessian else {})
        yield start, sq, hs


def window_norms(xs: Mapping[str, torch.Tensor], hessian: bool,
                 sq: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Each window's norm per block, what its contribution is clipped by: the L2 norm of its
    square sums ``sq`` (``[b, d]``, computed from ``xs`` if not given), or with ``hessian`` the
    Frobenius norm of ``H_w = 2 X_w^T X_w`` without forming it when the window has fewer
    tokens ``t`` than inputs ``d``: ``||X^T X||_F^2 = tr((X^T X)^2) = tr((X X^T)^2)``, so
    ``2 ||X_w X_w^T||_F`` from the ``t x t`` Gram matrix (``t^2 d`` instead of ``t d^2``
    multiplications; the same number up to float64 rounding)."""
    if not hessian:
        if sq is None:
            sq = {k: x.pow(2).sum(1) for k, x in xs.items()}
        return {k: torch.linalg.vector_norm(v, dim=1) for k, v in sq.items()}
    out = {}
    for k, x in xs.items():
        gram = (torch.einsum("bti,bsi->bts", x, x) if x.shape[1] < x.shape[2]
                else torch.einsum("bti,btj->bij", x, x))
        out[k] = torch.linalg.matrix_norm(gram, "fro").mul_(2.0)
    return out


def _block_norms(sq: Mapping[str, torch.Tensor], hs: Mapping[str, torch.Tensor],
                 hessian: bool) -> dict[str, torch.Tensor]:
    """Each window's norm per block from :func:`window_sums`' materialized statistics."""
    if hessian:
        return {k: torch.linalg.matrix_norm(h, "fro") for k, h in hs.items()}
    return {k: torch.linalg.vector_norm(v, dim=1) for k, v in sq.items()}


def clip_factors(norms: Mapping[str, torch.Tensor], bounds: Mapping[str, float]
                 ) -> dict[str, torch.Tensor]:
    """Per block, each window's scale ``min(1, C_j / norm)`` (1 for a zero norm)."""
    missing = sorted(set(norms) - set(bounds))
    if missing:
        raise ValueError(f"no clip bound for blocks {missing}: expected one per distinct input")
    return {k: torch.clamp(float(bounds[k]) / torch.clamp(n, min=1e-300), max=1.0)
            for k, n in norms.items()}


@dataclass
class ClippedStats:
    """A site's clipped sums of one layer: ``stats`` (``{linear: LayerStats}``, sharers hold the
    same object), ``owners`` (``{linear: owner}``) and how many windows each block clipped."""

    stats: dict[str, Any]
    owners: dict[str, str]
    clipped: dict[str, int]


@torch.no_grad()
def clipped_layer_stats(layer: nn.Module, inputs: Any, hessian: bool,
                        bounds: Mapping[str, float], batch_size: int = 8,
                        scales: Mapping[str, torch.Tensor] | None = None) -> ClippedStats:
    """The sum over windows of each window's statistics, each window's block ``j`` clipped to
    ``bounds[j]`` (L2 of its square sums; Frobenius of its Hessian with ``hessian``) before
    summing. With ``hessian`` the square sums are ``diag(H) / 2`` of the clipped Hessian. With
    ``scales``: of the normalized inputs (:func:`window_sums`; :func:`denormalize` maps the
    sum back)."""
    from fedcompress.pruning.walker import LayerStats

    owners = layer_blocks(layer, inputs)
    blocks = sorted(set(owners.values()))
    extra = sorted(set(bounds) - set(blocks))
    if extra:
        raise ValueError(f"clip bounds for unknown blocks {extra}: the layer's blocks are "
                         f"{blocks}")
    sums: dict[str, LayerStats] = {}
    clipped = {k: 0 for k in blocks}
    for _start, xs in window_inputs(layer, inputs, batch_size, scales):
        # with a Hessian the square sums are its diagonal: no separate square sums
        sq = None if hessian else {k: x.pow(2).sum(1) for k, x in xs.items()}
        factors = clip_factors(window_norms(xs, hessian, sq), bounds)
        for k in blocks:
            f = factors[k]
            clipped[k] += int((f < 1).sum())
            tokens = int(inputs.hidden.shape[1]) * int(f.shape[0])
            if k not in sums:
                sums[k] = LayerStats(xs[k].shape[-1], hessian=hessian)
            if sq is None:
                # sum_w f_w 2 X_w^T X_w as one product over the batch's tokens (no per-window
                # d x d matrices): each window's rows of one factor scaled by its f_w
                x = xs[k]
                h = torch.einsum("bti,btj->ij", x * f[:, None, None], x).mul_(2.0)
                sums[k].add_sums(tokens, torch.diagonal(h).clone() / 2, h)
            else:
                sums[k].add_sums(tokens, torch.einsum("b,bj->j", f, sq[k]), None)
    return ClippedStats({name: sums[owner] for name, owner in owners.items()}, owners, clipped)


def is_digest(spec: str) -> bool:
    """Whether ``spec`` names a pinned public file (``sha256:`` and 64 lowercase hex digits)."""
    return bool(_DIGEST.fullmatch(str(spec)))


def check_public_text(spec: str) -> str:
    """``spec`` if it is one of :data:`PUBLIC_CORPORA` or a pinned file's digest
    (:data:`DIGEST_PREFIX`), else a ValueError naming it."""
    if spec not in PUBLIC_CORPORA and not is_digest(spec):
        hint = (" (the digest is 64 lowercase hex digits: sha256sum FILE)"
                if str(spec).startswith(DIGEST_PREFIX) else "")
        raise ValueError(f"public text {spec!r}: expected a bundled corpus, one of "
                         f"{PUBLIC_CORPORA} (its {PUBLIC_SPLIT!r} split, shipped with the "
                         "package: the same at every party, and no site's data), or "
                         f"'{DIGEST_PREFIX}<hex digest>' of a public file every party holds"
                         f"{hint}")
    return spec


#: ``{(resolved path, size, mtime_ns): digest}`` of the files hashed in this process.
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the file at ``path`` (cached per path, size and modification time);
    an OSError names the path."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(resolved, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = DIGEST_PREFIX + h.hexdigest()
    return _DIGESTS[key]


def public_text_source(spec: str, files: Sequence[str] = ()) -> str:
    """What :func:`~fedcompress.data.corpora.load_corpus` loads for the public text ``spec``:
    the bundled corpus itself, or, for a digest, the one of ``files`` whose SHA-256 it is.

    Raises:
        ValueError: ``spec`` is neither (:func:`check_public_text`); no file of ``files`` has
            the digest (each file's digest, or why it cannot be read, is named).
    """
    check_public_text(spec)
    if not is_digest(spec):
        return spec
    seen = []
    for path in files:
        if not path:
            continue
        try:
            digest = file_digest(path)
        except OSError as err:
            seen.append(f"{path}: unreadable ({err.strerror or err})")
            continue
        if digest == spec:
            return str(path)
        seen.append(f"{path}: {digest}")
    raise ValueError(f"public text {spec}: no file here has that SHA-256 digest "
                     f"({'; '.join(seen) or 'no public file given'}): expected a copy of the "
                     "published file, byte for byte")


def public_windows(tokenizer: Any, seqlen: int, n: int = PUBLIC_WINDOWS, seed: int = 0,
                   corpus: str = PUBLIC_CORPUS, files: Sequence[str] = ()) -> torch.Tensor:
    """``n`` windows of ``seqlen`` tokens of PUBLIC text: the bundled ``corpus``'s
    :data:`PUBLIC_SPLIT` split (one of :data:`PUBLIC_CORPORA`, shipped with the package, the
    same at every party), or the pinned file of ``files`` whose digest ``corpus`` is (the whole
    file; :func:`public_text_source`); ``seed`` is public: nothing private depends on it."""
    from fedcompress.data.calibration import calibration_windows
    from fedcompress.data.corpora import load_corpus

    return calibration_windows(tokenizer,
                               load_corpus(public_text_source(corpus, files), PUBLIC_SPLIT),
                               n, seqlen, seed)


@dataclass(frozen=True)
class PublicCalibration:
    """What public text fixes of a DP statistics mechanism, per decoder layer: each block's
    clip bound (in normalized units when ``scales`` is set) and, with normalization, each
    block's public per-coordinate mean squares (:func:`public_scales`)."""

    bounds: list[dict[str, float]]
    scales: list[dict[str, torch.Tensor]] | None = None

    @property
    def normalize(self) -> str:
        return "public" if self.scales is not None else "none"


def _layer_scales(sq_parts: Mapping[str, list[torch.Tensor]], tokens: int, layer: int
                  ) -> dict[str, torch.Tensor]:
    out = {}
    for k, parts in sq_parts.items():
        c = torch.cat(parts).sum(0) / tokens
        top = float(c.max()) if c.numel() else 0.0
        if not (math.isfinite(top) and top > 0):
            raise ValueError(f"layer {layer} block {k}: public windows give no signal (largest "
                             f"mean square {top}): expected > 0 (more or longer public windows)")
        out[k] = torch.clamp(c, min=SCALE_FLOOR * top)
    return out


@torch.no_grad()
def public_calibration(model: nn.Module, windows: torch.Tensor, hessian: bool,
                       quantile: float = CLIP_QUANTILE, batch_size: int = 8,
                       normalize: str = "public") -> PublicCalibration:
    """The public part of the mechanism, from PUBLIC windows (e.g. the bundled
    :data:`PUBLIC_CORPUS`) through the DENSE model, per decoder layer and block: with
    ``normalize="public"``, the per-coordinate mean square over the windows' tokens (each
    floored at :data:`SCALE_FLOOR` of the block's largest), then the clip bound, the
    ``quantile`` of the per-window norms (as :func:`clipped_layer_stats` measures them, of the
    normalized inputs when normalizing). Public data only: no privacy cost, and every party
    computes the same values."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.walker import capture_layer_inputs, forward_layer

    if not 0 < quantile <= 1:
        raise ValueError(f"quantile={quantile!r}: expected a number in (0, 1]")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r}: expected one of {NORMALIZATIONS}")
    adapter = ModelAdapter(model)
    inputs = capture_layer_inputs(model, windows, batch_size)
    tokens = int(windows.shape[0]) * int(windows.shape[1])
    out: list[dict[str, float]] = []
    scales: list[dict[str, torch.Tensor]] = []
    for i in range(len(adapter)):
        with adapter.onloaded(i) as layer:
            layer_scales = None
            if normalize == "public":
                sq_parts: dict[str, list[torch.Tensor]] = {}
                for _s, sq, _hs in window_sums(layer, inputs, False, batch_size):
                    for k, v in sq.items():
                        sq_parts.setdefault(k, []).append(v)
                layer_scales = _layer_scales(sq_parts, tokens, i)
                scales.append(layer_scales)
            norms: dict[str, list[torch.Tensor]] = {}
            for _s, xs in window_inputs(layer, inputs, batch_size, layer_scales):
                for k, n in window_norms(xs, hessian).items():
                    norms.setdefault(k, []).append(n)
            bounds = {}
            for k, parts in norms.items():
                value = float(torch.quantile(torch.cat(parts), quantile))
                if not value > 0:
                    raise ValueError(f"layer {i} block {k}: public windows give a clip bound of "
                                     f"{value}: expected > 0 (more or longer public windows)")
                bounds[k] = value
            out.append(bounds)
            if i + 1 < len(adapter):
                inputs = forward_layer(layer, inputs, batch_size)
    return PublicCalibration(out, scales if normalize == "public" else None)


def public_clip_bounds(model: nn.Module, windows: torch.Tensor, hessian: bool,
                       quantile: float = CLIP_QUANTILE, batch_size: int = 8
                       ) -> list[dict[str, float]]:
    """Default clip bounds of un-normalized statistics from PUBLIC windows:
    :func:`public_calibration` with ``normalize="none"``."""
    return public_calibration(model, windows, hessian, quantile, batch_size, "none").bounds


def public_scales(model: nn.Module, windows: torch.Tensor, batch_size: int = 8
                  ) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer and block, each input coordinate's public per-token mean square
    (:func:`public_calibration`'s normalization)."""
    calib = public_calibration(model, windows, False, 1.0, batch_size, "public")
    assert calib.scales is not None
    return calib.scales
