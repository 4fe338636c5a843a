"""A site's privacy-ledger cost per message: check + record, for ledgers of growing size.

    python simulations/ledger_cost.py --out simulations/results/ledger-cost

Every message a site answers goes through its policy and its ledger (``clients/app.py``,
:mod:`fedcompress.privacy.site`): the policy is read from the node config, and the release is
checked against and recorded in the journal ``<state-dir>/ledger.jsonl`` (file lock, read what
other processes appended, check, append one line, fsync, replace the head file atomically).
This script measures, for ledgers already holding ``--sizes`` releases (spread over runs of
``--per-run`` releases), the seconds per message of:

* ``policy``: :func:`~fedcompress.privacy.policy.site_policy` of a node config;
* ``not-dp``: recording a release that is not DP (masks, statistics): every FedPrLLM message;
* ``dp-sgd``: checking and recording a DP-SGD round (the site's accountant over all the run's
  steps, opacus RDP): every PrivyTune training message;
* ``text``: checking and recording an exponential-mechanism release (PPC-GPT's round 1).

Each kind runs ``--messages`` times on a fresh copy of the ledger (in a temporary folder on
``--tmp``: the state folder's file system decides the fsync cost); reports the median and the
max per message, and the ledger's size on disk. Writes ``report.json``, ``report.md`` and
``config.toml`` to ``--out`` (:class:`~fedcompress.report.RunReport`). A timing benchmark: run
it on an idle machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fedcompress.privacy.accounting import noise_multiplier
from fedcompress.privacy.ledger import LEDGER_FILE, NOT_DP, DpSgdMechanism, Ledger
from fedcompress.privacy.policy import site_policy
from fedcompress.report import RunReport, markdown_table


def filled(folder: Path, size: int, per_run: int) -> None:
    """A ledger journal of ``size`` not-DP releases over runs of ``per_run`` releases, written
    in one transaction (one line per release, as one message at a time would leave it)."""
    ledger = Ledger(folder, 1e12)
    with ledger._transaction() as txn:  # noqa: SLF001 - seeding a big ledger quickly
        for i in range(size):
            run = f"old-{i // per_run}"
            entry = txn.run(run, "fedprllm")
            entry["releases"] += 1
            txn.releases.append({"time": "2026-01-01T00:00:00", "run": run,
                                 "method": "fedprllm", "action": "train.masks",
                                 "kind": "not-dp", "epsilon": NOT_DP})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 10000],
                        help="releases already in the ledger")
    parser.add_argument("--per-run", type=int, default=10, help="releases per earlier run")
    parser.add_argument("--messages", type=int, default=50, help="messages timed per kind")
    parser.add_argument("--tmp", default=None, help="folder of the temporary ledgers "
                                                    "(default: the system's)")
    parser.add_argument("--out", default="simulations/results/ledger-cost")
    opts = parser.parse_args()
    q, delta, steps = 0.02, 1e-5, 10
    sigma = noise_multiplier(8.0, delta, q, steps * opts.messages)
    mechanism = DpSgdMechanism(sigma=sigma, sample_rate=q, delta=delta, accountant="rdp",
                               target_epsilon=8.0)
    rows = []
    with RunReport.for_script(__file__, opts) as report:
        root = Path(tempfile.mkdtemp(prefix="ledger-cost-", dir=opts.tmp))
        try:
            for size in opts.sizes:
                kinds = {
                    "policy": lambda ledger, i: site_policy(
                        {"partition-id": 0, "state-dir": str(ledger.dir), "max-epsilon": 8.0}),
                    "not-dp": lambda ledger, i: ledger.not_dp("new", "fedprllm", "train.masks"),
                    "dp-sgd": lambda ledger, i: ledger.dp_sgd("new", "privytune",
                                                              "train.dplora", mechanism, steps),
                    "text": lambda ledger, i: ledger.text(f"new-{i}", "ppcgpt", "query.perturb",
                                                          1.0, 8.0),
                }
                for kind, call in kinds.items():
                    folder = root / f"{size}-{kind}"
                    filled(folder, size, opts.per_run)
                    ledger = Ledger(folder, 1e12)
                    seconds = []
                    with report.phase(f"{size}/{kind}"):
                        for i in range(opts.messages):
                            start = time.perf_counter()
                            call(ledger, i)
                            seconds.append(time.perf_counter() - start)
                    record = {"name": f"{size}/{kind}", "entries": size, "kind": kind,
                              "messages": opts.messages,
                              "median_ms": 1000 * statistics.median(seconds),
                              "max_ms": 1000 * max(seconds),
                              "ledger_bytes": (folder / LEDGER_FILE).stat().st_size}
                    report.add_result(record)
                    rows.append([str(size), kind, f"{record['median_ms']:.2f}",
                                 f"{record['max_ms']:.2f}", f"{record['ledger_bytes']:,}"])
                    shutil.rmtree(folder)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report.sections.append(("Ledger cost per message", markdown_table(
            ["entries", "kind", "median ms", "max ms", "ledger bytes"], rows) + (
            "\n\nSeconds per message of a site's policy read and of its ledger's check + "
            "record (file lock, check, one appended line with fsync, the head replaced "
            "atomically), on a ledger already holding that many releases, with a ledger "
            "object that has read it (a site agent's). dp-sgd includes the accountant "
            "(opacus RDP over all the run's steps).")))
    report.print_table()


if __name__ == "__main__":
    main()
