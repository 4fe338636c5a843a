"""The server's compiled aggregation (counting, selection, applying) equals a plain reference,
bit for bit, on random counts and on a tiny model: every comparison group (layer, row, column),
N:M, every tie-break, with and without weight scaling.

The references below are the obvious definitions (numpy sums of unpacked masks, a stable sort
per group by count descending, ``|key|`` ascending, index ascending; scale then zero in torch):
they are what the kernels of :mod:`fedcompress.masks._kernels` must compute, however they are
optimised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcompress.masks.aggregate import (
    apply_global_mask,
    count_dtype,
    count_words,
    global_mask,
    payload_words,
)
from fedcompress.methods.fedprllm.federated import MaskAggregator, ServerConfig, expected_shapes
from fedcompress.models import load_model

# ---- references ----------------------------------------------------------------------------


def ref_counts(masks: np.ndarray) -> np.ndarray:
    """``sum_i M_i`` of bool masks ``[m, numel]``."""
    return masks.sum(0, dtype=np.int64)


def ref_key(counts: torch.Tensor, tie_break: str, weight: torch.Tensor, seed: int) -> np.ndarray:
    """The tie key of each weight (ascending ``|key|`` pruned first among equal counts)."""
    if tie_break == "magnitude":
        return weight.float().abs().numpy()
    if tie_break == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.rand(counts.shape, generator=gen, dtype=torch.float32).abs().numpy()
    return np.zeros(tuple(counts.shape), dtype=np.float32)


def ref_top(counts: np.ndarray, key: np.ndarray, k: int) -> np.ndarray:
    """Bool mask of the ``k`` first of each row by (count desc, key asc, index asc)."""
    mask = np.zeros(counts.shape, dtype=bool)
    idx = np.arange(counts.shape[1])
    for r in range(counts.shape[0]):
        order = np.lexsort((idx, key[r], -counts[r].astype(np.int64)))
        mask[r, order[:k]] = True
    return mask


def ref_global_mask(counts: torch.Tensor, sparsity: float, group: str, tie_break: str,
                    weight: torch.Tensor, seed: int = 0,
                    nm: tuple[int, int] | None = None) -> torch.Tensor:
    c = counts.numpy().astype(np.int64)
    key = ref_key(counts, tie_break, weight, seed)
    rows, cols = c.shape
    if nm is not None:
        n, m = nm
        mask = ref_top(c.reshape(-1, m), key.reshape(-1, m), n).reshape(rows, cols)
    elif group == "layer":
        mask = ref_top(c.reshape(1, -1), key.reshape(1, -1),
                       int(sparsity * c.size)).reshape(rows, cols)
    elif group == "row":
        mask = ref_top(c, key, int(sparsity * cols))
    else:
        mask = ref_top(c.T, key.T, int(sparsity * rows)).T
    return torch.from_numpy(np.ascontiguousarray(mask))


def ref_apply(weight: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, m: int,
              scale: bool) -> torch.Tensor:
    w = weight.clone()
    if scale:
        factor = (m - counts.to(torch.float32)) / m
        w = (w.to(torch.float32) * factor).to(weight.dtype)
    return w.masked_fill(mask, 0)


# ---- random counts ----------------------------------------------------------------------


def _counts(kind: str, m: int, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    dtype = count_dtype(m)
    if kind == "uniform":
        return torch.randint(0, m + 1, shape, generator=gen).to(dtype)
    if kind == "extremes":  # real votes: most weights near 0 or m
        p = torch.rand(shape, generator=gen)
        c = torch.where(p < 0.4, 0, torch.where(p < 0.8, m, torch.randint(0, m + 1, shape,
                                                                           generator=gen)))
        return c.to(dtype)
    return torch.full(shape, m // 2, dtype=dtype)  # "equal": every weight tied


SHAPES = [(1, 97), (97, 1), (3, 200), (200, 3), (17, 33), (64, 48), (5, 16), (16, 5)]


@pytest.mark.parametrize("tie_break", ["magnitude", "random", "index"])
@pytest.mark.parametrize("group", ["layer", "row", "column"])
@pytest.mark.parametrize("m", [1, 2, 16, 300])
@pytest.mark.parametrize("kind", ["uniform", "extremes", "equal"])
def test_global_mask_equals_reference_on_random_counts(tie_break, group, m, kind):
    gen = torch.Generator().manual_seed(m * 7 + len(kind))
    for shape in SHAPES:
        counts = _counts(kind, m, shape, gen)
        # weights with many equal magnitudes (and signs), so key ties happen too
        weight = (torch.randn(shape, generator=gen) * 4).round() / 4
        for sparsity in (0.0, 0.05, 0.3, 0.5, 0.75, 0.99):
            got = global_mask(counts, sparsity, group, tie_break, weight, seed=3)
            want = ref_global_mask(counts, sparsity, group, tie_break, weight, seed=3)
            assert torch.equal(got, want), (shape, sparsity)


@pytest.mark.parametrize("tie_break", ["magnitude", "index"])
@pytest.mark.parametrize("nm", [(2, 4), (1, 4), (4, 8), (3, 4)])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_nm_mask_equals_reference(tie_break, nm, m):
    gen = torch.Generator().manual_seed(m + nm[1])
    for kind in ("uniform", "extremes", "equal"):
        counts = _counts(kind, m, (12, 64), gen)
        weight = (torch.randn(12, 64, generator=gen) * 2).round() / 2
        got = global_mask(counts, 0.0, "layer", tie_break, weight, nm=nm)
        assert torch.equal(got, ref_global_mask(counts, 0.0, "layer", tie_break, weight,
                                                nm=nm)), kind


@pytest.mark.parametrize("group", ["layer", "row", "column"])
def test_global_mask_refuses_non_finite_tied_weights_in_every_group(group):
    counts = torch.full((8, 8), 2, dtype=torch.uint8)  # all tied: the key decides
    weight = torch.randn(8, 8)
    weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        global_mask(counts, 0.5, group, "magnitude", weight)


def _vote_like_counts(m: int, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Counts as real votes give them: most weights at 0 or ``m``, so that a column's threshold
    count is 0 or ``m`` and about half the column ties there (the column group's hard case)."""
    rows, cols = shape
    p_col = torch.rand(1, cols, generator=gen)  # how often a column's weights are pruned
    p = torch.rand(shape, generator=gen)
    c = torch.where(p < p_col * 0.9, m, torch.where(p > 0.1 + p_col * 0.9, 0,
                                                    torch.randint(0, m + 1, shape, generator=gen)))
    return c.to(count_dtype(m))


def _wide_range_weight(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Magnitudes over many binades, with zeros, subnormals, huge values and many equal
    ones (bfloat16-rounded), so that the radix select of the tied keys needs every path: a
    bucket wider than one key, a bucket of equal keys, and a cut between equal keys."""
    w = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape,
                                                                     generator=gen).float())
    w = w.to(torch.bfloat16).float()
    pick = torch.rand(shape, generator=gen)
    w = torch.where(pick < 0.05, 0.0, w)
    w = torch.where((pick >= 0.05) & (pick < 0.08), -1e-42, w)  # subnormal
    w = torch.where((pick >= 0.08) & (pick < 0.1), 3e38, w)
    return torch.where((pick >= 0.1) & (pick < 0.3), 0.25, w)  # many equal keys


# shapes not a multiple of the 64 rows of a bit word, nor of a vector's width
COLUMN_SHAPES = [(1, 5), (2, 3), (63, 7), (64, 64), (65, 33), (127, 130), (200, 9), (700, 40)]


@pytest.mark.parametrize("m", [16, 300])  # uint8 and int16 counts
@pytest.mark.parametrize("tie_break", ["magnitude", "random", "index"])
def test_column_group_equals_reference_on_vote_like_counts(m, tie_break):
    """The column group on its hard case (about half of every column tied at its threshold),
    every k from 0 to all of a column, on both dtypes of counts."""
    from fedcompress.masks.aggregate import _tie_key, _top_counts_rows

    gen = torch.Generator().manual_seed(m + len(tie_break))
    for shape in COLUMN_SHAPES:
        rows = shape[0]
        counts = _vote_like_counts(m, shape, gen)
        assert counts.dtype == count_dtype(m)
        for weight in (_wide_range_weight(shape, gen), torch.randn(shape, generator=gen)):
            for sparsity in (0.0, 0.3, 0.5, 0.9):
                got = global_mask(counts, sparsity, "column", tie_break, weight, seed=4)
                want = ref_global_mask(counts, sparsity, "column", tie_break, weight, seed=4)
                assert torch.equal(got, want), (shape, sparsity)
            # k = 0, 1, all but one, all of a column (a sparsity cannot ask for all)
            key = _tie_key(counts, tie_break, weight, 4)
            ref_key_ = ref_key(counts, tie_break, weight, 4)
            c = counts.numpy()
            for k in sorted({0, 1, max(rows - 1, 0), rows}):
                got = _top_counts_rows(c, key, k, by_column=True)
                want = ref_top(c.T.astype(np.int64), ref_key_.T, k).T
                assert np.array_equal(got, want), (shape, k)
                assert got.sum() == k * shape[1]


def test_column_group_on_non_contiguous_counts_and_weights():
    """Counts and weights that are views (a transpose, a strided slice) select as their
    contiguous copies do."""
    gen = torch.Generator().manual_seed(8)
    counts = _vote_like_counts(16, (130, 90), gen)
    weight = _wide_range_weight((130, 90), gen)
    views = [(counts.T, weight.T), (counts[::2, 1::3], weight[::2, 1::3]),
             (counts[5:, :-7], weight[5:, :-7])]
    for c, w in views:
        assert not c.is_contiguous()
        for tie_break in ("magnitude", "index"):
            got = global_mask(c, 0.5, "column", tie_break, w)
            assert torch.equal(got, global_mask(c.contiguous(), 0.5, "column", tie_break,
                                                w.contiguous()))
            assert torch.equal(got, ref_global_mask(c.contiguous(), 0.5, "column", tie_break,
                                                    w.contiguous()))


def test_column_group_ignores_non_finite_keys_of_untied_weights():
    """A NaN or infinite weight that is not tied at its column's threshold (selected outright
    here) plays no part in the tie-break: the mask is the one its finite stand-in gives. (A
    tied one is refused: ``test_global_mask_refuses_non_finite_tied_weights_in_every_group``.)"""
    gen = torch.Generator().manual_seed(11)
    counts = torch.ones(100, 3, dtype=torch.uint8)
    counts[:10] = 2  # 10 selected outright, 40 of the 90 tied at count 1
    weight = torch.randn(100, 3, generator=gen)
    odd = weight.clone()
    odd[3, 0], odd[5, 1], odd[7, 2] = float("nan"), float("inf"), -float("inf")
    got = global_mask(counts, 0.5, "column", "magnitude", odd)
    assert torch.equal(got, ref_global_mask(counts, 0.5, "column", "magnitude", weight))
    assert got[:10].all() and got.sum() == 150


def test_column_group_on_columns_taller_than_a_16_bit_count():
    """Columns of more than 65,535 rows count their tied keys' buckets in 64 bits."""
    gen = torch.Generator().manual_seed(12)
    counts = _vote_like_counts(16, (70_000, 2), gen)
    weight = torch.randn(70_000, 2, generator=gen)
    for sparsity in (0.3, 0.5):
        assert torch.equal(global_mask(counts, sparsity, "column", "magnitude", weight),
                           ref_global_mask(counts, sparsity, "column", "magnitude", weight))


def test_radix_select_of_tied_keys_equals_sorting():
    """``_kth_smallest_radix`` (a histogram step, then a bitwise search of one bucket) gives
    every rank of the sorted keys, on narrow and wide ranges, equal keys and zeros."""
    from fedcompress.masks import _kernels

    rng = np.random.default_rng(3)
    cases = [np.full(100, 0.5, dtype=np.float32), np.zeros(60, dtype=np.float32),
             np.abs(rng.standard_normal(500)).astype(np.float32),
             np.abs(rng.standard_normal(300) * np.exp2(rng.integers(-120, 120, 300)))
             .astype(np.float32),
             np.concatenate([np.zeros(30), np.full(40, 1e-40), np.full(50, 3e38),
                             rng.random(80)]).astype(np.float32),
             np.float32(1) + np.arange(1000, dtype=np.float32) * np.float32(2 ** -23)]
    for keys in cases:
        bits = np.ascontiguousarray(keys).view(np.uint32)
        ordered = np.sort(bits)
        for kth in sorted({0, 1, len(bits) // 3, len(bits) // 2, len(bits) - 1}):
            assert _kernels._kth_smallest_radix(bits, kth) == ordered[kth], (len(bits), kth)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16])
def test_counting_pass_equals_numpy(dtype):
    """``_count_below`` (the column select's counting pass: 8 rows at a time into one-byte
    partial counts, flushed every 248 rows) equals numpy's count on every row count around its
    blocks (a partial 8-row step, a partial block, one-byte sums that would wrap) and odd
    column counts, with candidates from below every value to above every value."""
    from fedcompress.masks import _kernels

    rng = np.random.default_rng(21)
    for rows in (1, 7, 8, 9, 247, 248, 249, 255, 256, 257, 500, 1001):
        for cols in (1, 3, 64, 65, 130):
            values = rng.integers(0, 17, (rows, cols)).astype(dtype)
            values[:, 0] = 0  # a column all below any positive candidate: sums past 255
            cand = rng.integers(0, 18, cols).astype(dtype)
            cand[0] = 16
            out = np.empty(cols, dtype=np.int64)
            _kernels._count_below(values, cand, out, np.empty(cols, dtype=np.uint8))
            assert np.array_equal(out, (values < cand).sum(0)), (rows, cols)


def test_column_group_whatever_its_sampled_rows_hold():
    """The column select sets each column's range of key buckets from the tied keys of about
    64 sampled rows (every 10th of these 640); that range changes the work, never the mask:
    columns whose sampled rows hold no tied entry, a tied key far above the sampled ones (the
    cut in the top bucket), tied keys far below them (the cut in the bottom bucket), all keys
    equal, all keys zero; equal to the sorting reference for every k."""
    from fedcompress.masks.aggregate import _top_counts_rows

    rng = np.random.default_rng(22)
    rows, cols = 640, 6
    counts = np.where(rng.random((rows, cols)) < 0.5, 16, 0).astype(np.uint8)
    key = np.abs(rng.standard_normal((rows, cols))).astype(np.float32)
    sampled = np.arange(rows) % 10 == 0
    counts[sampled, 0] = 16  # column 0: no sampled entry ties at 0
    counts[~sampled, 0] = 0
    key[~sampled & (counts[:, 1] == 0), 1] *= 1e6  # column 1: the unsampled ties far above
    key[~sampled & (counts[:, 2] == 0), 2] *= 1e-30  # column 2: far below (and subnormal)
    key[:, 3] = 0.5
    key[:, 4] = 0.0
    counts[:, 5] = 7  # column 5: every entry tied, keys as drawn
    for k in sorted({1, 2, 63, 64, 65, 100, 319, 320, 321, 500, 575, 576, 577, 639, 640}):
        got = _top_counts_rows(counts, key, k, by_column=True)
        want = ref_top(counts.T.astype(np.int64), key.T, k).T
        assert np.array_equal(got, want), k
        assert np.array_equal(_top_counts_rows(counts, None, k, by_column=True),
                              ref_top(counts.T.astype(np.int64), np.zeros_like(key.T), k).T), k


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 128, 255, 256])
def test_counts_equal_reference(m):
    """Every number of count planes (1 to 8 in bytes, 9 wide), inputs of one word, of part of a
    word, and of several counting chunks with a partial last one; random votes, then every site
    voting for every weight (every count plane set: the largest count)."""
    rng = np.random.default_rng(m)
    for numel in (64, 100, 4096, 70_001):
        score = rng.standard_normal(numel)
        masks = (score + rng.standard_normal((m, numel))) < 0  # correlated, like real votes
        if numel == 100:
            masks[:] = True
        words = [payload_words(np.packbits(x), (numel + 7) // 8) for x in masks]
        got = count_words(words, numel)
        assert got.dtype == count_dtype(m)
        assert np.array_equal(got.numpy().astype(np.int64), ref_counts(masks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [False, True])
def test_apply_equals_reference(dtype, scale):
    gen = torch.Generator().manual_seed(1)
    for m in (1, 7, 16, 300):
        shape = (33, 70)
        w = torch.randn(shape, generator=gen).to(dtype)
        counts = _counts("uniform", m, shape, gen)
        mask = torch.rand(shape, generator=gen) < 0.5
        got = w.clone()
        apply_global_mask(got, mask, counts, m, scale)
        want = ref_apply(w, mask, counts, m, scale)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


# ---- a tiny model, end to end ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def _site_masks(shapes, m: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    return [{k: (b + torch.randn(b.shape, generator=gen)) < 0 for k, b in base.items()}
            for _ in range(m)]


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("workers", [1, 2])
def test_pruned_model_equals_reference(tiny, m, workers):
    """``MaskAggregator.prune`` gives, bit for bit, the weights of the reference pipeline
    (counts, stable-sort selection on the global model's weights, scale then zero), for every
    group, N:M, scaling and tie-break, and the pruned fractions of the reference masks."""
    shapes = expected_shapes(tiny.model)
    sites = _site_masks(shapes, m, seed=m)
    agg = MaskAggregator(tiny.model, m, workers=workers)
    for masks in sites:
        agg.add(masks)
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    weights = {k: agg._weight(k).detach().clone() for k in shapes}
    counts = {k: torch.from_numpy(ref_counts(np.stack([s[k].reshape(-1).numpy() for s in sites]))
                                  .reshape(shapes[k])) for k in shapes}
    variants = [(g, s, t, None) for g in ("layer", "row", "column") for s in (False, True)
                for t in ("magnitude", "random", "index")]
    variants += [("layer", s, "magnitude", (2, 4)) for s in (False, True)]
    for group, scale, tie_break, nm in variants:
        server = ServerConfig(group, scale, tie_break, seed=11)
        target = load_model(tiny.path, device="cpu").model
        fractions = agg.prune(target, server, 0.5, nm)
        for key in shapes:
            c = counts[key].to(count_dtype(m))
            mask = ref_global_mask(c, 0.5, group, tie_break, weights[key], seed=11, nm=nm)
            want = ref_apply(weights[key], mask, c, m, scale)
            got = agg._weight(key, target)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                (key, group, scale, tie_break, nm)
            assert fractions[key] == mask.sum().item() / mask.numel()
    # the global model itself is untouched
    assert all(torch.equal(v, original[k]) for k, v in tiny.model.state_dict().items())


def test_apply_scaling_is_exact_for_every_count_and_extreme_weights():
    """The compiled one-pass apply multiplies by exactly torch's ``(m - c) / m`` for every
    count value, also on subnormal, huge, signed-zero and infinite weights."""
    special = torch.tensor([1e-45, -1e-40, 3.4e38, -3.4e38, -0.0, 0.0, float("inf"), 1 / 3,
                            -2.5, 7.0], dtype=torch.float32)
    for m in list(range(1, 41)) + [255, 300]:
        counts = torch.arange(m + 1).repeat_interleave(len(special)).to(count_dtype(m))
        w = special.repeat(m + 1).reshape(1, -1)
        counts = counts.reshape(1, -1)
        for mask in (torch.zeros_like(w, dtype=torch.bool), torch.rand(w.shape) < 0.3):
            got = w.clone()
            apply_global_mask(got, mask, counts, m, True)
            want = ref_apply(w, mask, counts, m, True)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), m


#: Run in a fresh interpreter, where no kernel has been loaded yet: prints, as JSON, the count of
#: compiled signatures of every kernel after each step.
LOAD_KERNELS_PROBE = """
import json
import numpy as np
import torch
from numba.core.registry import CPUDispatcher
from fedcompress.masks import _kernels
from fedcompress.masks.aggregate import (apply_global_mask, count_packed, global_mask,
                                         load_kernels)

def signatures():
    return {name: len(obj.signatures) for name, obj in sorted(vars(_kernels).items())
            if isinstance(obj, CPUDispatcher)}

def aggregate(n_sites):
    rng = np.random.default_rng(n_sites)
    masks = [np.packbits(rng.random(96 * 64) < 0.9) for _ in range(n_sites)]
    counts = count_packed(masks, 96 * 64).reshape(96, 64)
    weight = torch.from_numpy(rng.standard_normal((96, 64)).astype(np.float32))
    for group in ("layer", "row", "column"):
        for tie_break in ("magnitude", "index"):
            mask = global_mask(counts, 0.5, group, tie_break, weight)
            apply_global_mask(weight.clone(), mask, counts, n_sites, True)
    return counts

steps = {"fresh": signatures()}
load_kernels(16)
steps["load 16"] = signatures()
counts = aggregate(16)
steps["aggregate 16"] = signatures()
load_kernels(300)
steps["load 300"] = signatures()
wide = aggregate(300)
steps["aggregate 300"] = signatures()
print(json.dumps({"steps": steps, "dtypes": [str(counts.dtype), str(wide.dtype)],
                  "max": [int(counts.max()), int(wide.max())]}))
"""


def test_load_kernels_compiles_what_the_aggregation_needs_for_narrow_and_wide_counts():
    """load_kernels(n) loads every kernel the aggregation of n sites' masks runs: after it, a
    real aggregation (count, every group and tie-break, scaling) of 16 sites (uint8 counts)
    and then of 300 (int16 counts, the wide count planes) compiles nothing more; the wide
    counts need kernels of their own, which load_kernels(300) adds."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LOAD_KERNELS_PROBE], capture_output=True,
                         text=True, timeout=600, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    steps = probe["steps"]
    assert probe["dtypes"] == ["torch.uint8", "torch.int16"]
    assert probe["max"][1] > 255  # the wide counts really exceed one byte
    assert not any(steps["fresh"].values()), steps["fresh"]  # nothing loaded before
    assert all(steps["load 16"][name] for name in ("count_words", "select_rows",
                                                   "select_columns", "apply_mask"))
    assert steps["aggregate 16"] == steps["load 16"]
    assert steps["load 300"] != steps["load 16"]  # the wide counts' own signatures
    assert steps["aggregate 300"] == steps["load 300"]


def test_cost_script_on_a_tiny_model(tiny_dir, tmp_path):
    """simulations/aggregation_cost.py runs for two models in one command: a row per model
    and group with every step's seconds, floor and the real path's weights equal to the
    steps'."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("aggregation_cost",
                                                  "simulations/aggregation_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    module.main(["--models", tiny_dir, tiny_dir, "--sites", "3", "--windows", "1",
                 "--seqlen", "16", "--repeats", "1", "--bandwidth-mib", "8", "--out", str(out),
                 "--payloads", str(tmp_path / "cache")])
    report = json.loads((out / "report.json").read_text())
    rows = report["results"]
    assert len(rows) == 6 and {r["group"] for r in rows} == {"layer", "row", "column"}
    assert all(r["prune_equals_steps"] for r in rows)
    assert all(r["floor_seconds"][s] > 0 and r[f"{s}_seconds"] > 0
               for r in rows for s in ("count", "select", "apply", "prune"))
    assert rows[3]["payloads_from_cache"] and not rows[0]["payloads_from_cache"]
    assert "x floor" in (out / "report.md").read_text()
