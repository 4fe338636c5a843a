"""Block Influence per layer of a model on bundled QA tasks, and what removing layers costs.

    python simulations/block_influence.py --out simulations/results/block-influence \\
        [--model smollm2-135m] [--tasks social_iqa,strategyqa] [--n 64] [--ratios 0.1,0.2,0.3]

What is computed (definitions in :mod:`fedcompress.layers`):

1. BI_label of every decoder layer (PPC-GPT Eq. 6, the original ShortGPT BI) on the first ``--n``
   examples of ``--split`` of each task in ``--tasks``, as (``"Question: {q}\\nAnswer:"``,
   ``" " + correct choice``) pairs: once over all positions of prompt + answer (the paper's
   expectation) and once over the answer's positions only. Rationale-free: the bundled tasks
   have no rationales (they come from the synthetic-data step, not built yet), so this is the
   "PPC-GPT w/o rationales" BI; ``BI_label + BI_rationale`` is the same code on two pair lists.
2. For each ratio in ``--ratios``: the layers the lowest-BI policy (BI of the first task, all
   positions) and the paper's "Seq" baseline (the deepest layers; with ``--seq-keep-last m``
   also the block just before the last ``m`` layers) remove, and, unless
   ``--no-eval``, the zero-shot accuracy of each pruned model (no retraining) on the first
   ``--eval-n`` examples of the first task's ``--eval-split``, and its perplexity on the first
   ``--ppl-windows`` 256-token windows of the bundled wiki test split.

Writes OUT/block_influence.json (config, versions, every score, plans, metrics, timings),
OUT/block_influence.md and OUT/block_influence.png (BI per layer, one bar group per variant).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedcompress.data.corpora import corpus_text, load_corpus  # noqa: E402
from fedcompress.data.tasks import load_task  # noqa: E402
from fedcompress.eval.perplexity import perplexity  # noqa: E402
from fedcompress.eval.zeroshot import zero_shot  # noqa: E402
from fedcompress.layers import (  # noqa: E402
    apply_plan,
    block_influence,
    lowest_score_plan,
    qa_label_pairs,
    removal_order,
    seq_plan,
)
from fedcompress.models import default_device, load_model, num_layers  # noqa: E402
from fedcompress.report import versions  # noqa: E402

logger = logging.getLogger("block_influence")


def plot(variants: dict[str, list[float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(next(iter(variants.values())))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(8, n * 0.35), 4))
    for k, (name, scores) in enumerate(variants.items()):
        ax.bar(np.arange(n) + (k - (len(variants) - 1) / 2) * width, scores, width, label=name)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("BI = 1 - E[cos(X_i, X_i+1)]")
    ax.set_yscale("log")
    ax.set_xticks(range(n))
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(model, tokenizer, records, wiki: str, opts) -> dict:
    start = time.perf_counter()
    acc = zero_shot(model, tokenizer, {"task": {"eval": records}}, split="eval",
                    batch_size=opts.batch_size, progress=False)["task"]
    ppl = perplexity(model, tokenizer, wiki, seqlen=256, max_windows=opts.ppl_windows,
                     batch_size=4, progress=False)
    return {"acc": acc.acc, "acc_stderr": acc.acc_stderr, "acc_norm": acc.acc_norm,
            "n": acc.n, "chance": acc.chance, "wiki_ppl": ppl.perplexity,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="simulations/results/block-influence")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks", default="social_iqa,strategyqa")
    parser.add_argument("--split", default="train")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--seq-keep-last", default="0,1",
                        help="Seq variants: final layers protected (0: the paper's Seq)")
    parser.add_argument("--eval-split", default="test")
    parser.add_argument("--eval-n", type=int, default=200)
    parser.add_argument("--ppl-windows", type=int, default=8)
    parser.add_argument("--no-eval", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = opts.tasks.split(",")
    ratios = [float(r) for r in opts.ratios.split(",")]
    keep_last = [int(k) for k in opts.seq_keep_last.split(",")]

    loaded = load_model(opts.model, device=opts.device or default_device(), dtype=opts.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    n_layers = num_layers(model)
    result: dict = {
        "command": "python simulations/block_influence.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(opts).items()
            if v not in (None, False)).replace(" True", ""),
        "config": vars(opts), "versions": versions(), "model": opts.model,
        "num_layers": n_layers, "bi": {}, "plans": {}, "eval": {}}

    variants: dict[str, list[float]] = {}
    importance = {}
    for task in tasks:
        pairs = qa_label_pairs(load_task(task, opts.split)[: opts.n])
        for positions in ("all", "target"):
            bi = block_influence(model, tokenizer, pairs, max_length=opts.max_length,
                                 batch_size=opts.batch_size, positions=positions)
            name = f"{task} ({positions})"
            importance[name] = bi
            variants[name] = list(bi.scores)
            result["bi"][name] = bi.to_dict()
    primary = importance[f"{tasks[0]} (all)"]

    plans = {}
    for ratio in ratios:
        plans[f"BI {ratio:g}"] = lowest_score_plan(primary, ratio)
        for keep in keep_last:
            name = f"Seq {ratio:g}" + (f" keep last {keep}" if keep else "")
            plans[name] = seq_plan(n_layers, ratio, keep_last=keep)
    result["plans"] = {name: plan.to_dict() for name, plan in plans.items()}

    if not opts.no_eval:
        records = load_task(tasks[0], opts.eval_split)[: opts.eval_n]
        wiki = corpus_text(load_corpus("wiki", "test"))
        result["eval"]["dense"] = evaluate(model, tokenizer, records, wiki, opts)
        logger.info("dense: %s", result["eval"]["dense"])
        for name, plan in plans.items():
            pruned = apply_plan(copy.deepcopy(model), plan)
            result["eval"][name] = evaluate(pruned, tokenizer, records, wiki, opts)
            logger.info("%s: %s", name, result["eval"][name])
            del pruned
    (out / "block_influence.json").write_text(json.dumps(result, indent=2))

    plot(variants, f"Block Influence per layer, {opts.model}, {opts.n} {opts.split} examples",
         out / "block_influence.png")

    names = list(variants)
    lines = [f"# Block Influence: {opts.model} ({n_layers} layers)", "",
             f"BI_label (PPC-GPT Eq. 6; rationale-free) on the first {opts.n} `{opts.split}` "
             f"examples of each task, as (`Question: {{q}}\\nAnswer:`, ` {{answer}}`) pairs, "
             f"max length {opts.max_length}. *all*: every prompt + answer position (the "
             "paper's); *target*: the answer's positions only. Higher = more important.", "",
             f"Command: `{result['command']}`", "",
             "| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i in range(n_layers):
        lines.append(f"| {i} | " + " | ".join(f"{variants[n][i]:.4f}" for n in names) + " |")
    lines += ["", "Tokens averaged over: " + ", ".join(
        f"{n}: {importance[n].n_tokens}" for n in names), "",
              "Removal order (lowest BI first), " + ", ".join(
        f"{n}: {list(removal_order(importance[n].scores)[:12])}" for n in names), "",
              "## Removal plans and their cost (no retraining)", "",
              f"Plans from BI of `{tasks[0]} (all)`; Seq removes the deepest layers (the paper's "
              "baseline); *Seq keep last m* removes the block just before the last m layers. "
              + ("" if opts.no_eval else
                 f"Accuracy: zero-shot on the first {opts.eval_n} `{opts.eval_split}` examples "
                 f"of {tasks[0]}; perplexity: first {opts.ppl_windows} 256-token windows of "
                 "the bundled wiki test split."), "",
              "| plan | layers removed | acc | acc_norm | wiki ppl |", "|---|---|---|---|---|"]
    ev = result["eval"]
    if ev:
        d = ev["dense"]
        lines.append(f"| dense | - | {d['acc']:.3f} | {d['acc_norm']:.3f} | {d['wiki_ppl']:.2f} |")
    for name, plan in plans.items():
        e = ev.get(name)
        metrics = (f"{e['acc']:.3f} | {e['acc_norm']:.3f} | {e['wiki_ppl']:.2f}" if e
                   else "- | - | -")
        lines.append(f"| {name} | {list(plan.removed)} | {metrics} |")
    if ev:
        d = ev["dense"]
        lines += ["", f"Chance accuracy {d['chance']:.3f}; acc stderr about "
                  f"{d['acc_stderr']:.3f} (n = {d['n']})."]
    (out / "block_influence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
