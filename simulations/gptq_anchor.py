"""The external anchor of our GPTQ: llm-compressor, per layer and end to end, in one run.

    python simulations/gptq_anchor.py --out simulations/results/gptq-anchor

llm-compressor (``llmcompressor==0.14.0.1``) is not a dependency of fedcompress (its pins
differ): it runs in a venv of its own, ``--venv`` (default ``$FEDCOMPRESS_CACHE/llmc``, i.e.
``~/.cache/fedcompress/llmc``, outside the repository), created on first use with
``--python -m venv`` and ``pip install torch==2.13.0 llmcompressor==0.14.0.1`` (pip resolves
transformers, compressed-tensors, ...: the report records what it got); an existing venv with
other versions is refused. Tensors go to and from it through one safetensors file each way
(``simulations/anchor/llmc_runner.py``, run by the venv's python).

On ``--model`` (default SmolLM2-135M) with the calibration windows of the benchmarks
(``--clients`` x ``--samples-per-client`` windows of ``--seqlen`` tokens of the wiki train split,
seed ``--seed``, pooled: the centralized baseline) and the recipe of the options (default
W4A16-like: 4-bit symmetric, group size 64 since 128 does not divide SmolLM2's 576 columns,
llm-compressor's dampening 0.01, block size 128 and static activation order):

1. **ours, centralized**: one calibration walk with GPTQ (``fedcompress.quant.gptq_quantize``
   through :func:`~fedcompress.pruning.local.layer_prune_fn` with ``PruneConfig(method="none",
   quant=...)``), recording our summed float64 Hessian (``2/N X^T X``) of the ``--layers`` x
   ``--linears`` chosen linear layers; skipped with a note when our solver is not installed
   (then the Hessians come from a walk of the dense model);
2. **per layer**: llm-compressor's own solver (``quantize_weight``, with its own observer's
   scales) on exactly our (W, H) of each chosen layer, as shipped (``llmc``, float32) and with our
   precision choices (``llmc-f64``: float64 Hessian up to its inverse's Cholesky factor and
   activation order), against ours: the share of identical integers, the largest integer
   difference, and every difference explained (:func:`explain`): the rows that diverge, the
   weight where each row first differs in the sweep order and how close it was to a rounding
   boundary before rounding (a near-tie decided by float rounding), the later differences in
   those rows (GPTQ feeds every rounding error forward), and the scales / activation orders;
3. **end to end**: llm-compressor's ``oneshot`` with ``GPTQModifier`` (the same recipe, the
   same windows as token ids, in order) saves a compressed-tensors folder; our venv loads it with
   ``transformers`` (compressed-tensors installed, no llm-compressor) and our evaluator gives its
   perplexity on the first ``--eval-windows`` windows of ``--eval-seqlen`` tokens of the wiki
   test split, beside ours and the dense model's; the relative gap (target: within 0.5%),
   sizes on disk, wall times.

Writes ``report.json`` / ``report.md`` / ``config.toml`` (:class:`~fedcompress.report.RunReport`:
config, versions of both venvs, git commit, load average, timings, the per-layer agreement table
under ``layers``, the perplexities as results), ``llmc-oneshot.json`` (what made
llm-compressor's model) and, under ``--out``/``cache/`` (not committed with a result), the model
(``llmc-model``, kept for ``--reuse-llmc`` unless ``--no-keep-model``) and the runner's log.

Under load the whole run takes long (llm-compressor's GPTQ of SmolLM2 alone: about 15-20 min on
2 busy cores): ``--llmc-only`` makes llm-compressor's model first, and a later run with
``--reuse-llmc`` and the same ``--out`` measures it beside ours without making it again (the
report says so, with the timings and commit of the run that made it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

logger = logging.getLogger("gptq_anchor")

ROOT = Path(__file__).resolve().parent
RUNNER = ROOT / "anchor" / "llmc_runner.py"
#: What the llm-compressor venv is created with (pip resolves the rest).
PINS = ("torch==2.13.0", "llmcompressor==0.14.0.1")
#: A weight whose value before rounding lies within this distance (in integer steps) of a
#: rounding boundary is a near-tie: float rounding upstream decides its integer.
TIE_TOL = 1e-3
#: Where llm-compressor's model is saved, and its runner's log, in ``--out`` (``cache/``: not
#: committed with a result; the model is reused by ``--reuse-llmc``).
LLMC_MODEL = Path("cache") / "llmc-model"
#: The linear layers of the per-layer check (names relative to a decoder layer).
DEFAULT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.down_proj")


def load_runner():
    """``simulations/anchor/llmc_runner.py`` as a module (the exchange format lives there)."""
    spec = importlib.util.spec_from_file_location("llmc_runner", RUNNER)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {RUNNER}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_venv() -> Path:
    from fedcompress.models.common import cache_dir

    return cache_dir() / "llmc"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="simulations/results/gptq-anchor")
    p.add_argument("--venv", default=None,
                   help="llm-compressor's venv, created when missing (default: "
                        "$FEDCOMPRESS_CACHE/llmc, i.e. ~/.cache/fedcompress/llmc)")
    p.add_argument("--python", default="python3.11", help="interpreter that creates the venv")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scheme", default="w4a16", choices=("w4a16", "w8a16"))
    p.add_argument("--group-size", type=int, default=64,
                   help="columns per scale (0: per output channel); 128 does not divide "
                        "SmolLM2's 576")
    p.add_argument("--asymmetric", action="store_true", help="asymmetric (zero points)")
    p.add_argument("--actorder", default="static", choices=("none", "static"),
                   help="activation order (llm-compressor 0.14 refuses 'group' in GPTQ)")
    p.add_argument("--dampening", type=float, default=0.01)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--samples-per-client", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib-text", default="wiki")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--eval-seqlen", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29],
                   help="decoder layers of the per-layer check")
    p.add_argument("--linears", nargs="+", default=list(DEFAULT_LINEARS),
                   help="linear layers (relative to a decoder layer) of the per-layer check")
    p.add_argument("--tie-tol", type=float, default=TIE_TOL,
                   help="distance to a rounding boundary (integer steps) of a near-tie")
    p.add_argument("--no-oneshot", action="store_true",
                   help="skip llm-compressor's end-to-end run (the per-layer check only)")
    p.add_argument("--llmc-only", action="store_true",
                   help="run llm-compressor's end-to-end model only (into --out, for a later "
                        "run with --reuse-llmc)")
    p.add_argument("--reuse-llmc", action="store_true",
                   help="keep llm-compressor's model in --out when it was made from the same "
                        "windows, recipe, model and venv (see llmc-oneshot.json)")
    p.add_argument("--no-ours-e2e", action="store_true",
                   help="skip our centralized GPTQ of the whole model (its perplexity); the "
                        "per-layer check then takes the Hessians from a walk of the dense "
                        "model")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense model's perplexity (minutes on a busy CPU)")
    p.add_argument("--llmc-from", default=None,
                   help="with --reuse-llmc: the --out of the run that made llm-compressor's "
                        "model (default: --out); waits while that run is still making it")
    p.add_argument("--no-keep-model", action="store_true",
                   help="delete llm-compressor's saved model after measuring it")
    p.add_argument("--log-level", default="INFO")
    opts = p.parse_args(argv)
    if opts.group_size < 0:
        p.error(f"--group-size {opts.group_size}: expected 0 (per channel) or a positive size")
    if not 0.0 < opts.dampening < 1.0:
        p.error(f"--dampening {opts.dampening}: expected a fraction in (0, 1)")
    if opts.block_size < 1 or opts.eval_windows < 1 or opts.seqlen < 2:
        p.error("--block-size, --eval-windows must be positive and --seqlen at least 2")
    if opts.llmc_only and opts.no_oneshot:
        p.error("--llmc-only with --no-oneshot leaves nothing to run")
    if opts.tie_tol <= 0 or opts.tie_tol >= 0.5:
        p.error(f"--tie-tol {opts.tie_tol}: expected a distance in (0, 0.5)")
    return opts


def quant_request(opts: argparse.Namespace) -> dict:
    """The recipe as the runner reads it (and as :class:`~fedcompress.quant.QuantConfig`)."""
    from fedcompress.quant import SCHEMES

    return {"bits": SCHEMES[opts.scheme], "group_size": opts.group_size,
            "symmetric": not opts.asymmetric, "actorder": opts.actorder,
            "dampening": opts.dampening, "block_size": opts.block_size}


# --- comparison and explanation (pure, on integer arrays) ---------------------------------------


def boundary_margin(pre: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Distance (in integer steps) of each value before rounding to the nearest rounding
    boundary ``k + 0.5`` between two integers of ``[low, high]`` (beyond the range the clamp
    decides: the outermost boundaries are ``low + 0.5`` and ``high - 0.5``)."""
    pre = pre.to(torch.float64)
    nearest = (torch.round(pre - 0.5) + 0.5).clamp(low + 0.5, high - 0.5)
    return (pre - nearest).abs()


def compare_integers(a: torch.Tensor, b: torch.Tensor, order: torch.Tensor | None = None,
                     pre: torch.Tensor | None = None, bits: int = 4,
                     tie_tol: float = TIE_TOL) -> dict[str, Any]:
    """Agreement of two integer matrices ``[out, in]`` quantized by GPTQ.

    ``order``: the column sweep order (activation order; default the columns' own). A row's
    *root* is its first differing weight in that order: GPTQ feeds each rounding error forward
    along the row, so the later differences of the row (the *cascade*) follow from the root.
    ``pre``: ``b``'s values before rounding (``w / scale + zero_point``); then each root's
    distance to a rounding boundary is measured, and the share of all weights that lie as close
    (what chance alone would give).
    """
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"integer matrices of shapes {tuple(a.shape)} and {tuple(b.shape)}: "
                         "expected two [out, in] matrices of the same shape")
    rows, cols = a.shape
    if order is None:
        order = torch.arange(cols)
    order = order.to(torch.long)
    if sorted(order.tolist()) != list(range(cols)):
        raise ValueError(f"sweep order of {order.numel()} entries is not a permutation of the "
                         f"{cols} columns")
    diff = a.to(torch.int32) != b.to(torch.int32)
    n, d = a.numel(), int(diff.sum())
    diverging = diff.any(dim=1)
    first = diff[:, order].to(torch.int8).argmax(dim=1)  # first True in sweep order
    root_rows = diverging.nonzero().flatten()
    root_cols = order[first[root_rows]]
    out: dict[str, Any] = {
        "integers": n, "identical": n - d, "identical_share": (n - d) / n if n else 1.0,
        "differing": d,
        "max_abs_diff": int((a.to(torch.int32) - b.to(torch.int32)).abs().max()) if n else 0,
        "rows": rows, "rows_diverging": int(diverging.sum()),
        "cascade": d - int(diverging.sum()),
    }
    if pre is not None:
        if pre.shape != a.shape:
            raise ValueError(f"values before rounding of shape {tuple(pre.shape)} for integers "
                             f"of shape {tuple(a.shape)}")
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        margins = boundary_margin(pre[root_rows, root_cols], low, high)
        out["root_margin_max"] = float(margins.max()) if margins.numel() else 0.0
        out["roots_near_tie"] = int((margins <= tie_tol).sum())
        out["chance_near_tie"] = float((boundary_margin(pre, low, high) <= tie_tol)
                                       .double().mean())
        out["tie_tol"] = tie_tol
    return out


def explain(cmp: dict[str, Any], scales_equal: bool = True, zero_points_equal: bool = True,
            order_differs: int = 0, order_ties: int = 0) -> tuple[bool, list[str]]:
    """``(every difference explained, the explanations)`` of a :func:`compare_integers`.

    ``order_differs``: columns whose place in the activation order differs between the two;
    ``order_ties``: of those, how many hold a Hessian diagonal value tied with another column's
    (in the precision of either side): a tie the two sorts break differently."""
    notes: list[str] = []
    explained = True
    if not scales_equal or not zero_points_equal:
        notes.append("the scales or zero points differ: both must come from the dense weights' "
                     "per-group min/max (unexplained)")
        explained = False
    if order_differs:
        if order_ties >= order_differs:
            notes.append(f"the activation orders differ at {order_differs} columns, all with "
                         "tied Hessian diagonals (tie order of the sort): rows are swept in "
                         "another order")
        else:
            notes.append(f"the activation orders differ at {order_differs} columns, "
                         f"{order_differs - order_ties} without a tie (unexplained)")
            explained = False
    if cmp["differing"] == 0:
        notes.append("identical integers")
        return explained, notes
    rows = cmp["rows_diverging"]
    if order_differs:
        notes.append(f"{cmp['differing']} integers in {rows} rows differ")
        return explained, notes
    if "roots_near_tie" not in cmp:
        notes.append(f"{rows} rows diverge; no values before rounding to classify them")
        return False, notes
    near, tol = cmp["roots_near_tie"], cmp["tie_tol"]
    chance = cmp["chance_near_tie"]
    notes.append(f"{rows} rows diverge; {near} of them first at a weight within {tol:g} of a "
                 f"rounding boundary (largest distance {cmp['root_margin_max']:.2g}; "
                 f"{100 * chance:.2f}% of all weights lie that close): float rounding decides "
                 "those near-ties")
    if cmp["cascade"]:
        notes.append(f"the other {cmp['cascade']} differing integers follow their row's first "
                     "difference (GPTQ feeds each rounding error forward along the row)")
    if near < rows:
        notes.append(f"{rows - near} rows first differ at a weight farther than {tol:g} from a "
                     "boundary (unexplained)")
        explained = False
    return explained, notes


def order_of(hessian: torch.Tensor, actorder: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The activation order llm-compressor computes from a Hessian in ``dtype`` (``None``
    without one)."""
    if actorder == "none":
        return None
    return torch.argsort(torch.diagonal(hessian.to(dtype)), descending=True)


def tied_columns(hessian: torch.Tensor, columns: torch.Tensor) -> int:
    """How many of ``columns`` hold a Hessian diagonal value equal to another column's, in
    float32 or float64."""
    count = 0
    for dtype in (torch.float32, torch.float64):
        diag = torch.diagonal(hessian.to(dtype))
        values, counts = torch.unique(diag, return_counts=True)
        tied = set(values[counts > 1].tolist())
        count = max(count, sum(float(diag[c]) in tied for c in columns.tolist()))
    return count


# --- the llm-compressor venv ------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, python: str) -> Path:
    """The python of llm-compressor's venv at ``venv``, created with :data:`PINS` when missing;
    refuses a venv whose llm-compressor or torch is not the pinned one."""
    exe = venv_python(venv)
    if not exe.exists():
        if venv.exists() and any(venv.iterdir()):
            raise FileNotFoundError(f"{venv} exists but has no bin/python: expected a venv "
                                    "(remove the folder to have it created)")
        logger.info("creating llm-compressor's venv %s (%s)", venv, " ".join(PINS))
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(exe), "-m", "pip", "install", "--quiet", *PINS], check=True)
    return exe


def check_pins(found: dict[str, str]) -> None:
    for pin in PINS:
        name, version = pin.split("==")
        have = found.get(name, "not installed").split("+")[0]
        if have != version:
            raise RuntimeError(f"llm-compressor's venv has {name} {have}: expected {version} "
                               "(remove the venv to have it created, or pass another --venv)")


def run_runner(exe: Path, args: list[str], log: Path) -> float:
    """Run the runner in llm-compressor's venv (its output to ``log``); wall seconds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    with open(log, "a") as out:
        done = subprocess.run([str(exe), str(RUNNER), *args], stdout=out,
                              stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(True)[-20:])
        raise RuntimeError(f"llm-compressor's runner {args[0]} failed (exit "
                           f"{done.returncode}); the end of {log}:\n{tail}")
    return time.perf_counter() - start


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))


# --- our side ---------------------------------------------------------------------------------


def our_solver():
    """``fedcompress.quant.gptq_quantize`` (or ``fedcompress.quant.solver``'s), or None while
    it does not exist."""
    import importlib

    for name in ("fedcompress.quant", "fedcompress.quant.solver"):
        try:
            return importlib.import_module(name).gptq_quantize
        except (ImportError, AttributeError):
            continue
    return None


def our_walk(model, windows: torch.Tensor, quant: dict, wanted: set[tuple[int, str]],
             batch_size: int, with_solver: bool):
    """One centralized calibration walk: with ``with_solver``, GPTQ by our recipe
    (``PruneConfig(method="none", quant=...)``, the walk :func:`local_masks` runs); without,
    the dense model. Returns the walk's result (None without a solver) and the Hessians and dense
    weights of the ``wanted`` (decoder layer, linear) pairs."""
    from fedcompress.models import ModelAdapter, weight_matrix
    from fedcompress.pruning.walker import walk

    recorded: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    if with_solver:
        from fedcompress.pruning.local import PruneConfig, layer_prune_fn

        inner = layer_prune_fn(PruneConfig(method="none", sparsity=0.0,  # type: ignore
                                           quant=quant_config(quant)))
    else:
        inner = None

    def prune(index, layer, stats):
        for name, module in ModelAdapter.linear_layers(layer).items():
            if (index, name) in wanted:
                recorded[(index, name)] = {
                    "weight": weight_matrix(module).detach().to(torch.float32).clone(),
                    "hessian": stats[name].hessian.clone()}
        if inner is None:
            return {}, None
        return inner(index, layer, stats)

    if inner is not None and hasattr(inner, "quantized"):
        prune.quantized = inner.quantized  # type: ignore[attr-defined]  # the walker moves them
    result = walk(model, windows, prune, hessian=True, batch_size=batch_size,
                  keep_weights=with_solver, progress=True)
    return (result if with_solver else None), recorded


def solver_module(solver):
    """The module that defines our solver (its named precision constants live there)."""
    return sys.modules[solver.__module__]


@contextlib.contextmanager
def hessian_precision(solver, dtype: torch.dtype | None):
    """Our solver with the Hessian in ``dtype`` up to its inverse's Cholesky factor and for the
    activation order (llm-compressor's choice: float32) instead of float64: the named constants
    ``HESSIAN_DTYPE`` of the solver's module and of :mod:`fedcompress.solver.obs` (the OBS
    sweep's factorisation) for the duration of the block; ``None``: unchanged. A module without
    the constant is an error (a solver that moved must not leave the swap silently undone)."""
    from fedcompress.solver import obs

    modules = [solver_module(solver), obs]
    missing = [m.__name__ for m in modules if not hasattr(m, "HESSIAN_DTYPE")]
    if missing:
        raise AttributeError(f"{missing}: expected a HESSIAN_DTYPE constant to swap")
    saved = [m.HESSIAN_DTYPE for m in modules]
    if dtype is not None:
        for m in modules:
            m.HESSIAN_DTYPE = dtype
    try:
        yield
    finally:
        for m, value in zip(modules, saved):
            m.HESSIAN_DTYPE = value


def quant_config(quant: dict):
    from fedcompress.quant import QuantConfig

    return QuantConfig(scheme={4: "w4a16", 8: "w8a16"}[quant["bits"]], method="gptq",
                       group_size=quant["group_size"], symmetric=quant["symmetric"],
                       actorder=quant["actorder"], dampening=quant["dampening"],
                       block_size=quant["block_size"])


def our_layer(solver, weight: torch.Tensor, hessian: torch.Tensor, quant: dict,
              precision: torch.dtype | None = None) -> dict:
    """Our GPTQ of one (W, H): integers, scales, zero points, dequantized weights, and the
    activation order it swept in (``precision``: :func:`hessian_precision`)."""
    module = solver_module(solver)
    with hessian_precision(solver, precision):
        start = time.perf_counter()
        result = solver(weight, hessian, quant_config(quant))
        seconds = time.perf_counter() - start
        perm = None
        if quant["actorder"] != "none":
            perm = getattr(result, "perm", None)
            if perm is None and hasattr(module, "activation_order"):
                perm = module.activation_order(hessian.to(module.HESSIAN_DTYPE))
    found = {"q": result.q, "scale": result.scale.to(torch.float32),
             "zero_point": result.zero_point.to(torch.float32),
             "weight": result.weight.to(torch.float32), "seconds": seconds}
    if perm is not None:
        found["perm"] = perm
    return found


def compare_pair(a: dict, b: dict, hessian: torch.Tensor, quant: dict, tie_tol: float) -> dict:
    """One row of the per-layer table: ``a`` against ``b`` (``b`` carries ``pre``)."""
    order_a = a.get("perm")
    order_b = b.get("perm")
    differs = 0
    ties = 0
    if order_a is not None and order_b is not None:
        moved = (order_a.to(torch.long) != order_b.to(torch.long)).nonzero().flatten()
        differs = int(moved.numel())
        if differs:
            ties = tied_columns(hessian, torch.cat([order_a[moved], order_b[moved]]).unique())
    cmp = compare_integers(a["q"], b["q"], order_b, b.get("pre"), quant["bits"], tie_tol)
    scales_equal = bool(torch.equal(a["scale"], b["scale"]))
    zp_equal = bool(torch.equal(a["zero_point"], b["zero_point"]))
    ok, notes = explain(cmp, scales_equal, zp_equal, differs, ties)
    cmp.update(scales_identical=scales_equal, zero_points_identical=zp_equal,
               order_columns_differing=differs,
               max_weight_diff=float((a["weight"] - b["weight"]).abs().max()),
               explained=ok, explanation="; ".join(notes))
    return cmp


#: The pairs of the per-layer table (left against right; the right side carries ``pre``):
#: ours against llm-compressor as shipped and with our precision, ours with llm-compressor's
#: precision against it as shipped, and the two llm-compressor variants (precision alone).
PAIRS = (("ours", "llmc"), ("ours", "llmc-f64"), ("ours-f32", "llmc"), ("llmc-f64", "llmc"))


def per_layer_rows(sides: dict[str, dict], recorded: dict, quant: dict, tie_tol: float,
                   pairs: tuple[tuple[str, str], ...] = PAIRS) -> list[dict]:
    """The per-layer agreement table: every pair of :data:`PAIRS` whose two sides exist
    (``sides``: ``{side: {layer key: result}}``), for every recorded layer."""
    rows = []
    for (index, name), rec in recorded.items():
        key = f"{index}.{name}"
        for left, right in pairs:
            if left not in sides or right not in sides:
                continue
            a, b = sides[left][key], sides[right][key]
            row = {"layer": key, "shape": list(rec["weight"].shape), "pair": f"{left} vs {right}",
                   **compare_pair(a, b, rec["hessian"], quant, tie_tol)}
            rows.append(row)
    return rows


def unpack_answer(tensors: dict[str, torch.Tensor], variants: list[str]) -> dict:
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {v: {} for v in variants}
    for key, value in tensors.items():
        variant, rest = key.split("/", 1)
        layer, field = rest.rsplit("/", 1)
        found[variant].setdefault(layer, {})[field] = value
    return found


def evaluate(model, tokenizer, eval_text: str, opts) -> float:
    from fedcompress.eval.perplexity import perplexity

    return perplexity(model, tokenizer, eval_text, seqlen=opts.eval_seqlen,
                      batch_size=opts.batch_size, max_windows=opts.eval_windows,
                      progress=False).perplexity


def oneshot_fingerprint(windows: torch.Tensor, quant: dict, model_path: Path,
                        llmc_versions: dict) -> str:
    """What llm-compressor's end-to-end run depends on: the windows' token ids, the recipe,
    the model folder, llm-compressor's venv and the runner's code."""
    h = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes())
    h.update(RUNNER.read_bytes())
    h.update(json.dumps({"shape": list(windows.shape), "quant": quant, "model": str(model_path),
                         "versions": llmc_versions, "ignore": ["lm_head"]},
                        sort_keys=True).encode())
    return h.hexdigest()


def llmc_oneshot(exe: Path, runner, windows: torch.Tensor, quant: dict, model_path: Path,
                 out: Path, work: Path, log: Path, reuse: bool,
                 source: Path | None = None) -> dict:
    """llm-compressor's ``oneshot`` on ``windows``: its compressed model in ``out/cache/llmc-model``
    and what made it in ``out/llmc-oneshot.json`` (timings, versions, the fedcompress commit,
    load averages, the :func:`oneshot_fingerprint`). ``reuse``: keep an existing model made
    from the same fingerprint (a run with ``--llmc-only`` earlier) instead of running again."""
    from fedcompress.report import versions

    llmc_versions = json.loads((work / "versions.json").read_text())
    fingerprint = oneshot_fingerprint(windows, quant, model_path, llmc_versions)
    source = out if source is None else source
    if reuse:
        wait_for_run(source)
        found_dir, found_record = source / LLMC_MODEL, source / "llmc-oneshot.json"
        if found_record.exists() and found_dir.exists():
            info = json.loads(found_record.read_text())
            if info.get("fingerprint") == fingerprint:
                logger.info("reusing llm-compressor's model %s (made %s at %s)", found_dir,
                            info.get("finished"), info.get("fedcompress_commit"))
                return {**info, "reused": True, "model_dir": str(found_dir)}
            logger.warning("%s was made from other windows, recipe or versions: running "
                           "oneshot again", found_dir)
    llmc_dir, record = out / LLMC_MODEL, out / "llmc-oneshot.json"
    request = work / "oneshot-request.safetensors"
    runner.save_exchange(request, {"input_ids": windows.to(torch.int64)},
                         {"quant": quant, "model_path": str(model_path), "ignore": ["lm_head"]})
    if llmc_dir.exists():
        shutil.rmtree(llmc_dir)
    llmc_dir.parent.mkdir(parents=True, exist_ok=True)
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    commit = versions().get("git_commit", "unknown")  # the code that runs, read before it runs
    wall = run_runner(exe, ["oneshot", str(request), str(work / "oneshot")], log)
    shutil.move(str(work / "oneshot" / "model"), llmc_dir)
    info = {**json.loads((work / "oneshot" / "oneshot.json").read_text()),
            "wall_seconds": wall, "fingerprint": fingerprint, "started": started,
            "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "fedcompress_commit": commit,
            "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    record.write_text(json.dumps(info, indent=2) + "\n")
    return {**info, "reused": False, "model_dir": str(llmc_dir)}


def wait_for_run(source: Path, poll: float = 30.0) -> None:
    """Wait while the run writing ``source`` (an earlier ``--llmc-only`` run still making
    llm-compressor's model, or measuring it) is running."""
    path = source / "report.json"
    while path.exists() and json.loads(path.read_text()).get("status") == "running":
        logger.info("waiting for the run writing %s to finish llm-compressor's model", source)
        time.sleep(poll)


def loaded_form(model) -> dict:
    """How ``transformers`` loaded a compressed-tensors model: the classes of its linear
    layers and the dtypes of their parameters."""
    kinds: dict[str, int] = {}
    dtypes: set[str] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) or "Linear" in type(module).__name__:
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
            dtypes.update(str(p.dtype) for p in module.parameters(recurse=False))
    return {"linear_classes": kinds, "parameter_dtypes": sorted(dtypes)}


def ours_and_per_layer(report, opts, loaded, windows: torch.Tensor, eval_text: str,
                       quant: dict, exe: Path, runner, work: Path, log: Path) -> float:
    """The dense model's and our centralized GPTQ's perplexity (results), and the per-layer
    check (``report.extra["layers"]``); returns our perplexity (NaN without our solver)."""
    from fedcompress.models import ModelAdapter
    from fedcompress.pruning.local import apply_masks

    model, tokenizer = loaded.model, loaded.tokenizer
    n_layers = len(ModelAdapter(model))
    bad = sorted(i for i in opts.layers if not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"--layers {bad}: the model has decoder layers 0..{n_layers - 1}")
    dense = {"name": "dense", "weights_bytes": weights_bytes(Path(loaded.path)),
             "folder_bytes": folder_bytes(Path(loaded.path))}
    if not opts.no_dense:
        with report.phase("dense-eval"):
            dense["perplexity"] = evaluate(model, tokenizer, eval_text, opts)
    report.add_result(dense)

    solver = our_solver()
    report.extra["ours_available"] = solver is not None
    if solver is None:
        logger.warning("fedcompress.quant.gptq_quantize does not exist yet: llm-compressor's "
                       "side only (Hessians from a walk of the dense model)")
    wanted = {(i, name) for i in opts.layers for name in opts.linears}
    ppl_ours = float("nan")
    walk_ours = solver is not None and not opts.no_ours_e2e
    report.extra["hessians_from"] = ("our centralized GPTQ walk" if walk_ours
                                     else "a walk of the dense model")
    with report.phase("ours-gptq" if walk_ours else "dense-walk"):
        start = time.perf_counter()
        walked, recorded = our_walk(model, windows, quant, wanted, opts.batch_size, walk_ours)
        ours_seconds = time.perf_counter() - start
    missing = sorted(f"{i}.{n}" for i, n in wanted - set(recorded))
    if missing:
        raise ValueError(f"--linears: no linear layers {missing} in the model")
    if walked is not None:
        with report.phase("ours-eval"):
            ours_model = apply_masks(copy.deepcopy(model), walked.masks, walked.weights)
            ppl_ours = evaluate(ours_model, tokenizer, eval_text, opts)
            del ours_model
        report.add_result({"name": "ours-gptq-centralized", "perplexity": ppl_ours,
                           "seconds": ours_seconds})

    # per layer: llm-compressor's solver on our (W, H)
    names = sorted(recorded)
    request = work / "solve-request.safetensors"
    tensors = {}
    for index, name in names:
        tensors[f"{index}.{name}/weight"] = recorded[(index, name)]["weight"]
        tensors[f"{index}.{name}/hessian"] = recorded[(index, name)]["hessian"]
    variants = list(runner.VARIANTS)
    runner.save_exchange(request, tensors, {
        "quant": quant, "layers": [f"{i}.{n}" for i, n in names], "variants": variants})
    with report.phase("llmc-per-layer"):
        run_runner(exe, ["solve", str(request), str(work / "solve-answer.safetensors")], log)
    answer, info = runner.load_exchange(work / "solve-answer.safetensors")
    theirs = unpack_answer(answer, variants)
    sides = dict(theirs)
    if solver is not None:
        sides["ours"], sides["ours-f32"] = {}, {}
        with report.phase("ours-per-layer"):
            for index, name in names:
                rec = recorded[(index, name)]
                key = f"{index}.{name}"
                sides["ours"][key] = found = our_layer(solver, rec["weight"],
                                                       rec["hessian"], quant)
                sides["ours-f32"][key] = our_layer(solver, rec["weight"], rec["hessian"],
                                                   quant, torch.float32)
                if walked is not None:
                    found["walk_identical"] = bool(torch.equal(
                        found["weight"], walked.weights[index][name].to(torch.float32)))
    rows = per_layer_rows(sides, recorded, quant, opts.tie_tol)
    for row in rows:
        side = row["pair"].split(" vs ")[1]
        row["llmc_seconds"] = info["layers"][row["layer"]][side]["seconds"]
        row["llmc_rtn_fallback"] = info["layers"][row["layer"]][side]["rtn_fallback"]
    report.extra["layers"] = rows
    if walked is not None:
        report.extra["ours_walk_identical"] = {k: v["walk_identical"]
                                               for k, v in sides["ours"].items()}
    report.sections.append(("Per layer: llm-compressor's quantize_weight on our (W, H)",
                            layer_table(rows)))
    report.write()

    return ppl_ours


def earlier_llmc_eval(out: Path, opts: argparse.Namespace) -> dict | None:
    """llm-compressor's perplexity as an earlier run into ``out`` measured it (the run that made
    its model, e.g. with ``--llmc-only``), when that run finished and evaluated with the same
    windows: ``{"perplexity", "fingerprint", "from"}``, or None."""
    path = out / "report.json"
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    config = earlier.get("config", {})
    same = all(config.get(k) == getattr(opts, k) for k in ("eval_windows", "eval_seqlen",
                                                           "batch_size", "model"))
    found = [r for r in earlier.get("results", []) if r.get("name") == "llmc-gptq"]
    oneshot = earlier.get("llmc_oneshot", {})
    if earlier.get("status") != "ok" or not same or not found or "fingerprint" not in oneshot:
        return None
    commit = earlier.get("versions", {}).get("git_commit", "?")
    return {"perplexity": found[0]["perplexity"], "fingerprint": oneshot["fingerprint"],
            "from": f"{earlier.get('started', '?')} at {commit}"}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=getattr(logging, opts.log_level.upper()),
                        format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoModelForCausalLM

    from fedcompress.data.corpora import corpus_text, load_corpus
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig, federation_windows
    from fedcompress.models import load_model
    from fedcompress.report import RunReport

    runner = load_runner()
    quant = quant_request(opts)
    venv = Path(opts.venv) if opts.venv else default_venv()
    out = Path(opts.out)
    source = Path(opts.llmc_from) if opts.llmc_from else out
    # the earlier run's report, read before this run's report replaces it (same --out)
    previous = earlier_llmc_eval(out, opts) if opts.reuse_llmc and source == out else None
    report = RunReport.for_script(__file__, opts, seeds={"seed": opts.seed})
    for name in ("compressed-tensors", "safetensors"):
        try:
            report.versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            report.versions[name] = "not installed"
    work = Path(tempfile.mkdtemp(prefix="gptq-anchor-"))
    log = out / "cache" / "llmc-runner.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    with report:
        with report.phase("llmc-venv"):
            exe = ensure_venv(venv, opts.python)
            run_runner(exe, ["versions", str(work / "versions.json")], log)
            llmc_versions = json.loads((work / "versions.json").read_text())
            check_pins(llmc_versions)
        report.extra["llmc_venv"] = {"path": str(venv), "pins": list(PINS),
                                     "versions": llmc_versions}
        report.extra["quant"] = quant
        with report.phase("load"):
            loaded = load_model(opts.model, device="cpu", dtype="float32")
            tokenizer = loaded.tokenizer
            config = FedPrLLMConfig(model=opts.model, clients=opts.clients,
                                    samples_per_client=opts.samples_per_client,
                                    seqlen=opts.seqlen, seed=opts.seed,
                                    calib_text=opts.calib_text, batch_size=opts.batch_size)
            windows = torch.cat(federation_windows(tokenizer, config)[0])
            eval_text = corpus_text(load_corpus("wiki", "test"))
        report.extra["windows"] = {"calibration": list(windows.shape),
                                   "eval": [opts.eval_windows, opts.eval_seqlen]}
        ppl_ours = float("nan")
        if not opts.llmc_only:
            ppl_ours = ours_and_per_layer(report, opts, loaded, windows, eval_text, quant, exe,
                                          runner, work, log)

        # end to end: llm-compressor's oneshot on the same windows
        if not opts.no_oneshot:
            with report.phase("llmc-oneshot"):
                oneshot = llmc_oneshot(exe, runner, windows, quant, Path(loaded.path), out,
                                       work, log, opts.reuse_llmc, source)
                if opts.reuse_llmc and source != out:
                    previous = earlier_llmc_eval(source, opts)
            report.extra["llmc_oneshot"] = oneshot
            llmc_dir = Path(oneshot["model_dir"])
            with report.phase("llmc-eval"):
                start = time.perf_counter()
                llmc_model = AutoModelForCausalLM.from_pretrained(llmc_dir)
                llmc_model.eval()
                load_s = time.perf_counter() - start
                report.extra["llmc_loaded"] = loaded_form(llmc_model)
                if (oneshot["reused"] and previous is not None
                        and previous["fingerprint"] == oneshot["fingerprint"]):
                    ppl_llmc = previous["perplexity"]
                    report.extra["llmc_perplexity_from"] = previous["from"]
                    logger.info("llm-compressor's perplexity %.4f: measured by the run that "
                                "made its model (%s)", ppl_llmc, previous["from"])
                else:
                    ppl_llmc = evaluate(llmc_model, tokenizer, eval_text, opts)
                del llmc_model
            gap = ppl_llmc / ppl_ours - 1 if math.isfinite(ppl_ours) else float("nan")
            qconfig = json.loads((llmc_dir / "config.json").read_text()).get(
                "quantization_config", {})
            report.add_result({"name": "llmc-gptq", "perplexity": ppl_llmc,
                               "gap_vs_ours": gap, "weights_bytes": weights_bytes(llmc_dir),
                               "folder_bytes": folder_bytes(llmc_dir),
                               "seconds": oneshot["timings"]["oneshot"],
                               "load_seconds": load_s, "reused": oneshot["reused"],
                               "format": qconfig.get("format", "?")})
            if opts.no_keep_model and not oneshot["reused"]:
                shutil.rmtree(llmc_dir)
        report.sections.insert(0, ("End to end", end_to_end_text(report.results)))
    shutil.rmtree(work, ignore_errors=True)
    report.print_table()
    return 0


def layer_table(rows: list[dict]) -> str:
    from fedcompress.report import markdown_table

    return markdown_table(
        ["layer", "pair", "identical", "max |diff|", "rows diverging", "roots near a tie",
         "explained", "explanation"],
        [[r["layer"], r["pair"], f"{100 * r['identical_share']:.3f}% ({r['differing']} differ)",
          str(r["max_abs_diff"]), f"{r['rows_diverging']} of {r['rows']}",
          str(r.get("roots_near_tie", "-")), "yes" if r["explained"] else "NO",
          r["explanation"]] for r in rows])


def end_to_end_text(results: list[dict]) -> str:
    by = {r["name"]: r for r in results}
    lines = []
    for name in ("dense", "ours-gptq-centralized", "llmc-gptq"):
        if name in by:
            r = by[name]
            size = r.get("weights_bytes")
            ppl = r.get("perplexity")
            lines.append(f"- {name}: perplexity "
                         + (f"{ppl:.3f}" if isinstance(ppl, float) else "not measured")
                         + (f", weights {size / 1e6:.1f} MB" if size else ""))
    if "llmc-gptq" in by and "gap_vs_ours" in by["llmc-gptq"]:
        gap = by["llmc-gptq"]["gap_vs_ours"]
        if isinstance(gap, float) and math.isfinite(gap):
            lines.append(f"- llm-compressor against ours: {100 * gap:+.3f}% (target within 0.5%)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
