"""Throughput of the exponential-mechanism text sanitizer on real text.

    python simulations/sanitizer_throughput.py      # -> simulations/results/sanitizer/wiki-test
    python simulations/sanitizer_throughput.py --split train --cache-mb 3072

Sanitises every document of a bundled corpus split (default: ``wiki`` ``test``, 43 Wikipedia
articles) with GloVe 6B 50d (:func:`fedcompress.data.embeddings.load_glove`) for each mechanism
(SanText over the first ``--candidates`` words; CusText with groups of ``--top-k``) and each
``eps``. Per cell:

* ``cold``: the first pass after :meth:`Sanitizer.clear_cache`, so every distinct word's sampling
  table is computed (the cost a client pays once per (word, eps));
* ``warm``: a second pass over the same text with another seed (tables from the cache: the
  steady state of a client that sanitises more text of the same vocabulary).

Words per second are reported on wall-clock time and on the process's CPU time (the machine is
shared: the load average at the start and end of each pass is recorded; BLAS may use both
cores, so CPU time can exceed wall time). Also: the setup time (GloVe load; CusText grouping),
the share of perturbed words that changed (a utility diagnostic) and the cache size. Writes
``report.json``, ``report.md`` and ``config.toml`` to ``--out`` (:class:`RunReport`).

Out-of-vocabulary words, side by side: ``--oov random,keep`` measures each policy on the same
text (``random``, the default, replaces them by a uniform candidate; ``keep`` copies them), and
``--oov-share 0,0.2`` also measures a copy of the text in which that share of the words (seeded
choice) is replaced by random identifier-like tokens (``k7q2-x93m``, out of GloVe), so the OOV
path is exercised, not just present.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import random
import re
import time
from pathlib import Path

from fedcompress.data.corpora import load_corpus
from fedcompress.data.embeddings import load_glove
from fedcompress.privacy.sanitize import TOKEN_PATTERN, WORD_PATTERN, Sanitizer, SanitizerConfig
from fedcompress.report import RunReport, markdown_table

log = logging.getLogger("sanitizer_throughput")


def measure(sanitizer: Sanitizer, texts: list[str], eps: float, seed: int) -> dict:
    load_start = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    results = sanitizer.sanitize_many(texts, eps=eps, seed=seed)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    words = sum(r.report.n_words for r in results)
    perturbed = sum(r.report.n_perturbed for r in results)
    return {
        "words": words, "seconds": wall, "cpu_seconds": cpu,
        "words_per_s": words / wall, "words_per_cpu_s": words / cpu,
        "perturbed": perturbed, "oov": sum(r.report.n_oov for r in results),
        "changed_share": sum(r.report.n_changed for r in results) / max(perturbed, 1),
        "eps_total_mean": sum(r.report.eps_total for r in results) / len(results),
        "load_start": load_start, "load_end": os.getloadavg()[0],
        "cache_mib": sanitizer.cache_info()["bytes"] / 2**20,
    }


def with_oov(texts: list[str], share: float, seed: int) -> list[str]:
    """``texts`` with ``share`` of their words (seeded choice) replaced by random
    identifier-like tokens that are not in GloVe."""
    if share <= 0:
        return texts
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

    def code() -> str:
        return ("".join(rng.choices(alphabet, k=4)) + "-" + "".join(rng.choices(alphabet, k=4))
                + "q9")  # the suffix keeps it out of GloVe

    return [re.sub(WORD_PATTERN, lambda m: code() if rng.random() < share else m.group(), t)
            for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder [default: simulations/results/sanitizer/CORPUS-SPLIT]")
    parser.add_argument("--corpus", default="wiki")
    parser.add_argument("--split", default="test")
    parser.add_argument("--mechanisms", default="santext,custext")
    parser.add_argument("--eps", default="1,3,10")
    parser.add_argument("--candidates", type=int, default=20_000)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--cache-mb", type=float, default=1024.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oov", default="random",
                        help="out-of-vocabulary policies to compare, e.g. random,keep")
    parser.add_argument("--oov-share", default="0",
                        help="shares of words replaced by out-of-vocabulary codes, e.g. 0,0.2")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.out is None:
        args.out = Path("simulations/results/sanitizer") / f"{args.corpus}-{args.split}"

    corpus = [doc.text for doc in load_corpus(args.corpus, args.split)]
    texts = corpus
    distinct = len({w.lower() for t in texts for w in re.findall(TOKEN_PATTERN, t)})
    start = time.perf_counter()
    table = load_glove()
    glove_seconds = time.perf_counter() - start
    log.info("GloVe loaded in %.2fs; %d documents of %s/%s", glove_seconds, len(texts),
             args.corpus, args.split)

    command = ("python simulations/sanitizer_throughput.py --out " + str(args.out)
               + f" --corpus {args.corpus} --split {args.split} --mechanisms {args.mechanisms}"
               + f" --eps {args.eps} --candidates {args.candidates} --top-k {args.top_k}"
               + f" --cache-mb {args.cache_mb:g} --seed {args.seed} --oov {args.oov}"
               + f" --oov-share {args.oov_share}")
    with RunReport(args.out, "sanitizer-throughput", vars(args) | {"out": str(args.out)},
                   seeds={"seed": args.seed}) as report:
        report.command_line = report.reproduce = command
        report.markdown_results = False  # the section below is the table
        report.extra.update({"glove_load_seconds": glove_seconds, "documents": len(corpus),
                             "distinct_words": distinct, "cpus": os.cpu_count()})
        rows = []
        for mechanism, share, oov in itertools.product(
                args.mechanisms.split(","), [float(x) for x in args.oov_share.split(",")],
                args.oov.split(",")):
            texts = with_oov(corpus, share, args.seed)
            config = SanitizerConfig(mechanism=mechanism, top_k=args.top_k,
                                     candidates=args.candidates, cache_mb=args.cache_mb, oov=oov)
            start = time.perf_counter()
            sanitizer = Sanitizer(table, config)
            setup = time.perf_counter() - start
            for eps in (float(e) for e in args.eps.split(",")):
                sanitizer.clear_cache()
                for phase, seed in (("cold", args.seed), ("warm", args.seed + 1)):
                    row = {"mechanism": mechanism, "oov_policy": oov, "oov_share": share,
                           "eps": eps, "phase": phase,
                           "setup_s": setup, **measure(sanitizer, texts, eps, seed)}
                    rows.append(row)
                    report.add_result({"name": f"{mechanism} {oov} {share:g} eps {eps:g} "
                                               f"{phase}", **row})
                    log.info("%s oov=%s share=%g eps=%g %s: %.0f words/s (%.0f per CPU s), "
                             "load %.1f", mechanism, oov, share, eps, phase, row["words_per_s"],
                             row["words_per_cpu_s"], row["load_end"])
        report.sections.append((
            f"Sanitizer throughput: {args.corpus}/{args.split} ({len(corpus)} documents, "
            f"{rows[0]['words'] if rows else 0:,} words), GloVe 6B 50d",
            explanation(args, distinct, glove_seconds) + "\n\n" + throughput_table(rows)))
    print(report.markdown())


def explanation(args, distinct: int, glove_seconds: float) -> str:
    return (
        f"SanText: {args.candidates:,} candidates; CusText: groups of {args.top_k}. `cold`: "
        "first pass with an empty table cache (every distinct word's table computed); `warm`: "
        "second pass, another seed. `words/CPU s` uses the process's CPU time (the machine is "
        "shared; `load avg` is the 1-minute load at the start and end of the pass on "
        f"{os.cpu_count()} CPUs). `changed`: perturbed words whose output differs from the "
        f"input. {distinct:,} distinct words. GloVe loaded in {glove_seconds:.2f} s. CusText's "
        "first cold pass also maps every distinct word outside the candidates to its nearest "
        "group (once per sanitizer, kept by `clear_cache`). `oov`: the out-of-vocabulary "
        "policy (`random`, the default: replaced by a uniform candidate; `keep`: copied); "
        "`oov share`: share of the words replaced by random out-of-vocabulary codes (seeded) "
        "before sanitising.")


def throughput_table(rows: list[dict]) -> str:
    columns = ["mechanism", "oov", "oov share", "eps", "phase", "words", "oov words",
               "words/s", "words/CPU s", "seconds", "load avg", "changed", "cache MiB",
               "setup s"]
    return markdown_table(columns, [
        [r["mechanism"], r["oov_policy"], f"{r['oov_share']:g}", f"{r['eps']:g}", r["phase"],
         str(r["words"]), str(r["oov"]), f"{r['words_per_s']:,.0f}",
         f"{r['words_per_cpu_s']:,.0f}", f"{r['seconds']:.2f}",
         f"{r['load_start']:.1f}-{r['load_end']:.1f}", f"{r['changed_share']:.1%}",
         f"{r['cache_mib']:.0f}", f"{r['setup_s']:.2f}"] for r in rows])


if __name__ == "__main__":
    main()
