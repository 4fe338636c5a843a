"""llm-compressor's side of the GPTQ anchor, run by the python of a venv of its own.

    <venv>/bin/python simulations/anchor/llmc_runner.py solve REQUEST.safetensors OUT.safetensors
    <venv>/bin/python simulations/anchor/llmc_runner.py oneshot REQUEST.safetensors OUT_DIR
    <venv>/bin/python simulations/anchor/llmc_runner.py recipe REQUEST.safetensors OUT_DIR
    <venv>/bin/python simulations/anchor/llmc_runner.py versions OUT.json

llm-compressor is not a dependency of fedcompress (its pins differ): ``simulations/gptq_anchor.py``
writes a request (tensors and a JSON header in ONE safetensors file, :func:`save_exchange`), runs
this script with the venv's python and reads its answer. This file imports only the standard
library, torch and safetensors at module level (so fedcompress's venv can import it for the
exchange format and :func:`recover_integers`); llm-compressor, compressed-tensors, transformers
and datasets are imported inside the tasks.

``solve``: for every layer of the request (``<name>/weight`` float32 ``[out, in]`` and
``<name>/hessian`` ``[in, in]``, our Hessian, float64), llm-compressor's own scale observer
(``memoryless_minmax``, the one GPTQModifier uses for weights) on the dense weight, then its own
solver ``llmcompressor.modifiers.gptq.gptq_quantize.quantize_weight`` on exactly that (W, H), in
each requested *variant*:

* ``llmc``: as shipped (``GPTQ_PRECISION`` float32: the Hessian cast to float32, its activation
  order from the float32 diagonal, dampening, Cholesky, inverse and upper Cholesky in float32);
* ``llmc-f64``: the same code with fedcompress's precision choices: the Hessian stays float64 up
  to the upper Cholesky factor of its inverse (llm-compressor's ``factorize_hessian`` called on
  the float64 Hessian, then cast to float32) and the activation order comes from the float64
  diagonal (``apply_activation_ordering`` on the float64 Hessian); the column loop stays float32.

Answer per variant and layer: ``<variant>/<name>/q`` (int8 integers, recovered from the
dequantized weights the solver returns, exactly: checked), ``scale``, ``zero_point``,
``weight`` (the solver's dequantized float32 weights), ``pre`` (the value each weight had just
before rounding, ``w / scale + zero_point``, recorded from inside the solver's quantizer, in the
original column order: how close a differing integer was to a rounding boundary), ``perm`` (the
activation order, when there is one); the header holds the losses, RTN fallbacks and seconds.

``recipe``: ``oneshot`` with the request's recipe (llm-compressor's YAML, as given, parsed by
llm-compressor itself) on the model folder of the request, calibrated on its ``input_ids`` as
``oneshot`` below, saved with ``save_compressed=True`` to ``OUT_DIR/model`` (what
llm-compressor writes for that recipe: compressed-tensors when quantized); timings in
``OUT_DIR/oneshot.json``.

``oneshot``: ``oneshot`` with a ``GPTQModifier`` on the model folder of the request, calibrated
on the request's ``input_ids`` (one sample per window, in order, not shuffled), saved with
``save_compressed=True`` (compressed-tensors ``pack-quantized``) to ``OUT_DIR/model``; timings
in ``OUT_DIR/oneshot.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger("llmc_runner")

#: Distributions whose versions the anchor records (llm-compressor's venv).
PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "safetensors",
            "accelerate", "datasets", "numpy")
#: The variants of ``solve`` (see the module docstring).
VARIANTS = ("llmc", "llmc-f64")
#: The header key of an exchange file.
META_KEY = "anchor"


def save_exchange(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """One exchange file: ``tensors`` (contiguous CPU copies) and ``meta`` (JSON) in the
    safetensors header."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"exchange tensor {name!r} is a {type(value).__name__}: expected a "
                            "torch.Tensor")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
              metadata={META_KEY: json.dumps(meta)})


def load_exchange(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, meta)`` of an exchange file written by :func:`save_exchange`."""
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        if META_KEY not in header:
            raise ValueError(f"{path} is not an anchor exchange file: its safetensors header "
                             f"has no {META_KEY!r} entry (keys: {sorted(header)})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads(header[META_KEY])


def group_index(columns: int, group_size: int) -> torch.Tensor:
    """The group of each column (``group_size`` 0: one group, per output channel)."""
    if group_size == 0:
        return torch.zeros(columns, dtype=torch.long)
    if columns % group_size:
        raise ValueError(f"group size {group_size} does not divide {columns} columns")
    return torch.arange(columns) // group_size


def recover_integers(dequantized: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                     group_size: int, bits: int) -> torch.Tensor:
    """The integers ``q`` (int8, zero point included) with ``(q - zero_point) * scale ==
    dequantized`` in float32, as the runtime dequantizes; raises when the weights are not on
    the grid (then they were not produced by this scale and zero point)."""
    groups = group_index(dequantized.shape[1], group_size)
    s = scale.to(torch.float32)[:, groups]
    z = zero_point.to(torch.float32)[:, groups]
    q = torch.round(dequantized.to(torch.float64) / s.to(torch.float64)) + z.to(torch.float64)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if q.min() < low or q.max() > high:
        raise ValueError(f"recovered integers span [{int(q.min())}, {int(q.max())}]: expected "
                         f"{bits}-bit integers in [{low}, {high}]")
    back = (q.to(torch.float32) - z) * s
    off = (back != dequantized.to(torch.float32)).sum().item()
    if off:
        raise ValueError(f"{off} dequantized weights are not (q - zero_point) * scale for any "
                         "integer q: the weights are not on this scale's grid")
    return q.to(torch.int8)


def _quant_args(quant: dict):
    from compressed_tensors.quantization import QuantizationArgs

    group = int(quant["group_size"])
    actorder = None if quant["actorder"] == "none" else quant["actorder"]
    return QuantizationArgs(num_bits=int(quant["bits"]), type="int",
                            symmetric=bool(quant["symmetric"]),
                            strategy="group" if group else "channel",
                            group_size=group or None, actorder=actorder)


def observe_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's weight scale and zero point: the observer GPTQModifier attaches to a
    weight (``memoryless_minmax``) on the dense weight, ``[out, groups]``."""
    from llmcompressor.observers import Observer

    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qparams = observer.get_qparams()
    return qparams["scale"], qparams["zero_point"]


@contextlib.contextmanager
def _instrumented(variant: str, hessian64: torch.Tensor, record: dict):
    """Patch llm-compressor's GPTQ module for one call: record the pre-rounding values and the
    activation order; in the ``llmc-f64`` variant, order and factorize the float64 Hessian."""
    from llmcompressor.modifiers.gptq import gptq_quantize as gq

    original_fq = gq.fake_quantize
    original_order = gq.apply_activation_ordering
    original_factorize = gq.factorize_hessian

    def fake_quantize(x, scale, zero_point, args, global_scale=None):
        # the quantizer's own first steps (compressed-tensors' _quantize_dequantize)
        s = scale if global_scale is None else scale / global_scale
        pre = x / s
        if zero_point is not None:
            pre = pre + zero_point.to(x.dtype)
        record["pre"].append(pre.transpose(0, 1).clone())  # [batch, rows]
        return original_fq(x, scale, zero_point, args, global_scale)

    def order(weights, hessians, actorder):
        if variant == "llmc-f64":
            w, h64, perm = original_order(weights, hessian64.clone().unsqueeze(0), actorder)
            record["h64"] = h64
            record["perm"] = perm
            return w, h64.to(hessians.dtype), perm
        w, h, perm = original_order(weights, hessians, actorder)
        record["perm"] = perm
        return w, h, perm

    def factorize(weights, hessians, percdamp, used_rtn_fallback):
        if variant == "llmc-f64":
            h64 = record.get("h64", hessian64.unsqueeze(0)).clone()
            factor = original_factorize(weights, h64, percdamp, used_rtn_fallback)
            hessians.copy_(factor.to(hessians.dtype))
            return hessians
        return original_factorize(weights, hessians, percdamp, used_rtn_fallback)

    gq.fake_quantize, gq.apply_activation_ordering, gq.factorize_hessian = (
        fake_quantize, order, factorize)
    try:
        yield
    finally:
        gq.fake_quantize, gq.apply_activation_ordering, gq.factorize_hessian = (
            original_fq, original_order, original_factorize)


def solve_layer(weight: torch.Tensor, hessian: torch.Tensor, quant: dict, variant: str
                ) -> dict:
    """llm-compressor's GPTQ of one layer in one variant (see the module docstring)."""
    from llmcompressor.modifiers.gptq import gptq_quantize as gq

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    args = _quant_args(quant)
    weight = weight.to(torch.float32)
    scale, zero_point = observe_qparams(weight, args)
    record: dict = {"pre": []}
    start = time.perf_counter()
    with _instrumented(variant, hessian.to(torch.float64), record), torch.no_grad():
        dequant, losses, fallback = gq.quantize_weight(
            weights=weight.clone().unsqueeze(0),
            hessians=hessian.clone().unsqueeze(0),  # quantize_weight casts it to float32
            scale=scale.unsqueeze(0), zero_point=zero_point.unsqueeze(0), global_scale=None,
            quant_args=args, blocksize=int(quant["block_size"]),
            percdamp=float(quant["dampening"]))
    seconds = time.perf_counter() - start
    dequant = dequant[0]
    perm = record.get("perm")
    pre = torch.stack(record["pre"], dim=-1)[0]  # [rows, cols] in sweep order
    if perm is not None:
        perm = perm[0].to(torch.long)
        original = torch.empty_like(pre)
        original[:, perm] = pre
        pre = original
    q = recover_integers(dequant, scale, zero_point, int(quant["group_size"]),
                         int(quant["bits"]))
    out = {"q": q, "scale": scale.to(torch.float32), "zero_point": zero_point.to(torch.float32),
           "weight": dequant, "pre": pre,
           "meta": {"loss": float(losses[0]), "rtn_fallback": bool(fallback[0]),
                    "seconds": seconds}}
    if perm is not None:
        out["perm"] = perm
    return out


def solve(request: Path, answer: Path) -> None:
    tensors, meta = load_exchange(request)
    quant, variants = meta["quant"], meta.get("variants", list(VARIANTS))
    results: dict[str, torch.Tensor] = {}
    info: dict = {"versions": versions(), "layers": {}}
    for name in meta["layers"]:
        for variant in variants:
            found = solve_layer(tensors[f"{name}/weight"], tensors[f"{name}/hessian"], quant,
                                variant)
            info["layers"].setdefault(name, {})[variant] = found.pop("meta")
            for key, value in found.items():
                results[f"{variant}/{name}/{key}"] = value
            logger.info("%s %s: %.2fs", variant, name,
                        info["layers"][name][variant]["seconds"])
    save_exchange(answer, results, info)


def _oneshot(meta: dict, ids: torch.Tensor, out_dir: Path, recipe, label: str) -> None:
    """``oneshot`` of ``recipe`` (a modifier or a recipe file) on the model folder of ``meta``,
    calibrated on ``ids`` (one sample per window, in order, not shuffled), saved with
    ``save_compressed=True`` to ``out_dir/model``; timings in ``out_dir/oneshot.json``."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    timings: dict[str, float] = {}
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(meta["model_path"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(meta["model_path"])
    timings["load"] = time.perf_counter() - start
    dataset = Dataset.from_dict({"input_ids": ids.tolist(),
                                 "attention_mask": torch.ones_like(ids).tolist()})
    start = time.perf_counter()
    oneshot(model=model, tokenizer=tokenizer, dataset=dataset, recipe=recipe,
            num_calibration_samples=int(ids.shape[0]), max_seq_length=int(ids.shape[1]),
            shuffle_calibration_samples=False, batch_size=1)
    timings["oneshot"] = time.perf_counter() - start
    start = time.perf_counter()
    model.save_pretrained(out_dir / "model", save_compressed=True)
    tokenizer.save_pretrained(out_dir / "model")
    timings["save"] = time.perf_counter() - start
    (out_dir / "oneshot.json").write_text(json.dumps(
        {"timings": timings, "versions": versions(), "windows": list(ids.shape),
         "recipe": label}, indent=2) + "\n")


def oneshot_run(request: Path, out_dir: Path) -> None:
    """llm-compressor's whole pipeline: ``oneshot`` + ``GPTQModifier`` on the request's
    windows, saved compressed."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier

    tensors, meta = load_exchange(request)
    quant = meta["quant"]
    out_dir.mkdir(parents=True, exist_ok=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=_quant_args(quant))
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=meta.get("ignore",
                          ["lm_head"]), block_size=int(quant["block_size"]),
                          dampening_frac=float(quant["dampening"]))
    _oneshot(meta, tensors["input_ids"].to(torch.long), out_dir, recipe, str(recipe))


def recipe_run(request: Path, out_dir: Path) -> None:
    """llm-compressor's ``oneshot`` with the request's recipe (YAML text) on its windows."""
    tensors, meta = load_exchange(request)
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe_file = out_dir / "recipe.yaml"
    recipe_file.write_text(meta["recipe"])
    _oneshot(meta, tensors["input_ids"].to(torch.long), out_dir, str(recipe_file),
             meta["recipe"])


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="task", required=True)
    p = sub.add_parser("solve", help="quantize_weight on the request's (W, H) pairs")
    p.add_argument("request", type=Path)
    p.add_argument("answer", type=Path)
    p = sub.add_parser("oneshot", help="oneshot + GPTQModifier on the request's windows")
    p.add_argument("request", type=Path)
    p.add_argument("out_dir", type=Path)
    p = sub.add_parser("recipe", help="oneshot with the request's recipe on its windows")
    p.add_argument("request", type=Path)
    p.add_argument("out_dir", type=Path)
    p = sub.add_parser("versions", help="the versions of this venv's packages, as JSON")
    p.add_argument("out", type=Path)
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    if opts.task == "solve":
        solve(opts.request, opts.answer)
    elif opts.task == "oneshot":
        oneshot_run(opts.request, opts.out_dir)
    elif opts.task == "recipe":
        recipe_run(opts.request, opts.out_dir)
    else:
        opts.out.write_text(json.dumps(versions(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
