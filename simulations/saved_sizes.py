"""What a saved model weighs, and what transformers does with it on the CPU, side by side in one
run.

    python simulations/saved_sizes.py --out simulations/results/saved-sizes

The embedded model (default ``smollm2-135m``; its published checkpoint is bfloat16, it ships as
a GGUF dequantized to a float32 cache) saved by :func:`fedcompress.models.save_model`:

* ``dense-float32``: what every command wrote before it saved in the input model's dtype;
* ``dense-bfloat16``: the input model's dtype;
* ``wanda50-bfloat16``: Wanda 50% (unstructured, row groups) on ``--calib-windows`` windows:
  the zeros are stored, so the file is the dense model's;
* ``w4a16-g<G>`` and ``w8a16-channel``: compressed-tensors ``pack-quantized``
  (:func:`fedcompress.quant.compressed_tensors.save_quantized`), symmetric, with
  round-to-nearest integers made here from the dense weights (llm-compressor's min-max rule,
  scales rounded to bfloat16): a stand-in for the solver, enough for sizes and loading.

Each folder is then loaded in a fresh interpreter by ``transformers`` alone (no fedcompress
import): its load time, whether it keeps the packed integers on load and after the first
forward, the perplexity on ``--eval-windows`` windows of the bundled wiki test text (in the
saved dtype, as a user runs it), greedy decoding tokens/s (``--new-tokens``, batch 1,
``--threads`` torch threads) and the process's peak resident memory (``VmHWM``). The
perplexity of the in-memory model before saving (float32) is given for each too. Writes
``report.json``, ``report.md`` and ``config.toml`` to ``--out``
(:class:`~fedcompress.report.RunReport`); timings depend on the machine's load (the report
records the load average).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fedcompress.data.corpora import corpus_text, load_corpus
from fedcompress.eval.perplexity import perplexity
from fedcompress.models import load_model, model_size, save_model, source_dtype
from fedcompress.pruning.local import PruneConfig, apply_masks, local_masks
from fedcompress.quant.compressed_tensors import PackedLinear, save_quantized
from fedcompress.quant.config import QuantConfig
from fedcompress.report import RunReport

#: Runs in a fresh interpreter: transformers only.
LOADER = """
import json, math, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, ids_file, threads, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
ids = torch.load(ids_file)
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(folder).eval()
load = time.perf_counter() - start
probe = model.model.layers[0].mlp.up_proj
packed_on_load = hasattr(probe, "weight_packed")
tokenizer = AutoTokenizer.from_pretrained(folder)
prompt = tokenizer("The history of the city begins", return_tensors="pt").input_ids
with torch.no_grad():
    start = time.perf_counter()
    model(prompt)
    first = time.perf_counter() - start
    packed_after = hasattr(probe, "weight_packed")
    nll, count = 0.0, 0
    for window in ids:
        logits = model(window[None]).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += window.numel() - 1
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False)
    decode = time.perf_counter() - start
assert not any(name.startswith("fedcompress") for name in sys.modules)
print(json.dumps({"load_seconds": load, "packed_on_load": packed_on_load,
                  "first_forward_seconds": first, "packed_after_first_forward": packed_after,
                  "loaded_dtype": str(model.dtype).removeprefix("torch."),
                  "perplexity_loaded": math.exp(nll / count),
                  "tokens_per_second": new_tokens / decode,
                  "peak_rss_mib": int(next(line.split()[1] for line in open("/proc/self/status")
                                           if line.startswith("VmHWM:"))) / 1024}))
"""


def round_to_nearest(weight: torch.Tensor, bits: int, group: int) -> PackedLinear:
    """Symmetric min-max round-to-nearest integers of ``weight`` (a stand-in for the solver):
    scale = max |w| of the group / ((2^bits - 1) / 2), rounded to bfloat16 (what the save
    holds), q = round(w / scale) clipped to the signed range."""
    out, width = weight.shape
    size = group or width
    grouped = weight.float().reshape(out, width // size, size)
    high, low = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    scale = (grouped.abs().amax(-1) / ((high - low) / 2)).clamp(min=torch.finfo(
        torch.float32).eps).to(torch.bfloat16).float()
    q = torch.round(grouped / scale[..., None]).clamp(low, high).to(torch.int8)
    return PackedLinear(q.reshape(out, width), scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("simulations/results/saved-sizes"))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the saved folders in OUT")
    opts = parser.parse_args()
    report = RunReport.for_script(__file__, opts)
    torch.set_num_threads(opts.threads)
    with report, tempfile.TemporaryDirectory() as tmp:
        work = opts.out / "models" if opts.keep else Path(tmp)
        loaded = load_model(opts.model, device="cpu", dtype="float32")
        model, tokenizer = loaded.model, loaded.tokenizer
        dense_dtype = source_dtype(loaded)

        def window_ids(split: str, count: int) -> torch.Tensor:
            text = corpus_text(load_corpus("wiki", split))
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
            return ids[: count * opts.seqlen].view(count, opts.seqlen)

        evaluation = window_ids("test", opts.eval_windows)
        ids_file = Path(tmp) / "ids.pt"
        torch.save(evaluation, ids_file)

        def record(name: str, saved, in_memory: torch.nn.Module) -> None:
            ppl = perplexity(in_memory, tokenizer, evaluation.flatten(), opts.seqlen,
                             progress=False).perplexity
            run = subprocess.run([sys.executable, "-c", LOADER, str(saved.path), str(ids_file),
                                  str(opts.threads), str(opts.new_tokens)],
                                 capture_output=True, text=True, check=True)
            loaded_side = json.loads(run.stdout.strip().splitlines()[-1])
            size = model_size(saved, model, dense_dtype)
            report.add_result({"name": name, "format": size["format"], "dtype": size["dtype"],
                               "weights_mib": size["weights_bytes"] / 2**20,
                               "saved_mib": size["saved_bytes"] / 2**20,
                               "dense_mib": size["dense_bytes"] / 2**20,
                               "ratio": size["ratio"], "perplexity_in_memory_fp32": ppl,
                               **loaded_side})

        for dtype in ("float32", "bfloat16"):
            saved = save_model(model, work / f"dense-{dtype}", tokenizer, dtype)
            record(f"dense-{dtype}", saved, model)

        pruned = load_model(opts.model, device="cpu", dtype="float32").model
        walk = local_masks(pruned, window_ids("train", opts.calib_windows),
                           PruneConfig(method="wanda", sparsity=0.5), batch_size=4)
        apply_masks(pruned, walk.masks)
        record("wanda50-bfloat16", save_model(pruned, work / "wanda50-bfloat16", tokenizer,
                                              "bfloat16"), pruned)
        del pruned, walk

        for bits, group in ((4, opts.group_size), (8, 0)):
            config = QuantConfig(scheme=f"w{bits}a16", group_size=group, actorder="none")
            layers = {name: round_to_nearest(module.weight.detach(), bits, group)
                      for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and ".layers." in name}
            name = f"w{bits}a16-{f'g{group}' if group else 'channel'}"
            saved = save_quantized(model, work / name, layers, config, tokenizer, "bfloat16")
            reference = load_model(opts.model, device="cpu", dtype="float32").model
            modules = dict(reference.named_modules())
            with torch.no_grad():
                for layer_name, layer in layers.items():
                    modules[layer_name].weight.copy_(layer.dequantize(group))
            record(name, saved, reference)
            del reference
        report.sections.append(("Reading", (
            "`weights_mib`: the safetensors files; `dense_mib`: the input model's parameter "
            f"bytes in its own dtype ({dense_dtype}). `perplexity_in_memory_fp32`: the model "
            "before saving, computed in float32 (quantized: the dequantized float32 weights, "
            "scales rounded to bfloat16); `perplexity_loaded`: the folder as transformers "
            "loads and runs it (in the saved dtype). The quantized integers are "
            "round-to-nearest made by this script (a stand-in for the solver).")))


if __name__ == "__main__":
    main()
