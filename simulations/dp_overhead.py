"""Cost of DP-SGD per training step, side by side: LoRA and full fine-tuning, with and without DP.

    python simulations/dp_overhead.py --out simulations/results/dp-overhead

For each model, each mode (``lora``, ``full``) and each of no-DP / DP-SGD, the library's
trainer (:func:`fedcompress.privacy.finetune.train_prepared`, the code every PrunePrivyTune site
runs) takes ``--steps`` steps on batches of ``--batch-size`` texts of ``--max-length`` tokens
(the bundled wiki corpus, causal LM loss for a decoder; the RTE stand-in
``epistemic_reasoning`` with a classification head for an encoder). The four variants of a model
run interleaved ``--repeats`` times (ABCD ABCD ...), so load on the machine affects them alike;
the reported time per step is the median over repeats, the ratio DP / no-DP is taken within
each repeat and its median reported. Under DP batches are Poisson samples of expected size
``--batch-size``; the first ``--warmup`` steps of every run are not timed (allocation, hooks).
Target (issue, step 7): one DP-LoRA step <= 2x a LoRA step on the embedded decoder.
Writes ``report.json``, ``report.md`` and ``config.toml`` to ``--out`` (:class:`RunReport`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedcompress.data.corpora import load_corpus
from fedcompress.data.tasks import classification_data
from fedcompress.models import load_model
from fedcompress.privacy.classifier import (
    encode_lm,
    encode_texts,
    encoder_classifier,
    is_encoder,
    pad_id,
)
from fedcompress.privacy.finetune import FinetuneConfig, prepare_trainable, train_prepared
from fedcompress.report import RunReport, markdown_table

VARIANTS = (("lora", False), ("lora", True), ("full", False), ("full", True))


def data_for(loaded, opts, n: int):
    tokenizer = loaded.tokenizer
    if is_encoder(loaded.model):
        task = classification_data("epistemic_reasoning", "train")
        return encode_texts(tokenizer, task.texts[:n], task.labels[:n], opts.max_length, False,
                            len(task.label_names))
    texts = [d.text for d in load_corpus("wiki", "train")][:n]
    return encode_lm(tokenizer, texts, opts.max_length)


def one_run(loaded, train, mode: str, private: bool, opts) -> tuple[float, int]:
    """Seconds per timed step of one training run (a fresh model each time)."""
    import copy

    if is_encoder(loaded.model):
        model = encoder_classifier(loaded.path, 2, seed=opts.seed)
    else:
        model = copy.deepcopy(loaded.model).float()
    config = FinetuneConfig(mode=mode, epochs=1.0, batch_size=opts.batch_size, lr=1e-4,
                            epsilon=8.0 if private else None, delta=1e-5, seed=opts.seed,
                            physical_batch_size=opts.physical_batch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts.seed)
        model, _ = prepare_trainable(model, config)
    stamps: list[float] = []
    result = train_prepared(model, train, config, pad_id(loaded.tokenizer), progress=False,
                            on_step=lambda step, loss: stamps.append(time.perf_counter()))
    timed = stamps[opts.warmup:]
    del model
    return (timed[-1] - timed[0]) / (len(timed) - 1), result.trainable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "minilm-l6"])
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"],
                        help="what is trained (full DP on a 0.5B model needs ~16 GB of "
                             "per-example gradients at batch 8: lower --physical-batch)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--physical-batch", type=int, default=0,
                        help="most examples per forward/backward (0: the whole batch)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (incl. warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="simulations/results/dp-overhead")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    rows = []
    with RunReport.for_script(__file__, opts, seeds={"seed": opts.seed}) as report:
        for spec in opts.models:
            loaded = load_model(spec, device="cpu")
            # steps x batch examples: under DP the Poisson sample has the same expected size
            train = data_for(loaded, opts, opts.steps * opts.batch_size)
            variants = [v for v in VARIANTS if v[0] in opts.modes]
            times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
            trainable: dict[str, int] = {}
            for _ in range(opts.repeats):
                for mode, private in variants:
                    with report.phase(f"{spec}/{mode}{'-dp' if private else ''}"):
                        seconds, trainable[mode] = one_run(loaded, train, mode, private, opts)
                    times[(mode, private)].append(seconds)
            for mode in opts.modes:
                plain, dp = times[(mode, False)], times[(mode, True)]
                record = {"name": f"{spec}/{mode}", "model": spec, "mode": mode,
                          "trainable": trainable[mode],
                          "step_seconds": statistics.median(plain),
                          "dp_step_seconds": statistics.median(dp),
                          "dp_ratio": statistics.median(d / p for d, p in zip(dp, plain)),
                          "step_seconds_all": plain, "dp_step_seconds_all": dp}
                report.add_result(record)
                rows.append([spec, mode, f"{trainable[mode]:,}", f"{record['step_seconds']:.3f}",
                             f"{record['dp_step_seconds']:.3f}", f"{record['dp_ratio']:.2f}x"])
            del loaded
        report.sections.append(("DP-SGD step cost", markdown_table(
            ["model", "mode", "trainable", "step (s)", "DP step (s)", "DP / no-DP"], rows)
            + f"\n\nBatch {opts.batch_size} x {opts.max_length} tokens (chunks of "
              f"{opts.physical_batch or opts.batch_size}), {opts.threads} threads, "
              f"median of {opts.repeats} interleaved repeats of {opts.steps - opts.warmup} "
              "timed steps each. Target: DP-LoRA <= 2x LoRA on the embedded decoder."))
    print(report.markdown())


if __name__ == "__main__":
    main()
