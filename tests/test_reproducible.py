"""The same config gives the same result: one small FedPrLLM vote run twice in separate
processes gives bit-identical global masks (Wanda and SparseGPT, plain and with seeded
attackers under the Hamming defence); report.json records what explains differences across
machines."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import hashlib, sys
from fedcompress.methods.fedprllm.attacks import attack_masks, is_attacker
from fedcompress.methods.fedprllm.federated import (
    FedPrLLMConfig, MaskAggregator, federation_windows, mask_key)
from fedcompress.models import load_model
from fedcompress.pruning.local import local_masks

model_dir = sys.argv[1]
for run in sys.argv[2:]:  # each "method,attack,attackers,defence" in this one process
    loaded = load_model(model_dir, device="cpu")  # afresh: a run may update weights
    method, attack, attackers, defence = run.split(",")
    cfg = FedPrLLMConfig(model=model_dir, clients=5, samples_per_client=2, seqlen=16,
                         batch_size=2, method=method, attack=attack, attackers=int(attackers),
                         defence=defence)
    windows = federation_windows(loaded.tokenizer, cfg)[0]
    agg = MaskAggregator(loaded.model, cfg.clients)
    for i, w in enumerate(windows):
        masks = (attack_masks(cfg.attack, loaded.model, w, cfg.prune, cfg.seed, i, 2, windows[0])
                 if is_attacker(i, cfg.attackers)
                 else local_masks(loaded.model, w, cfg.prune, batch_size=2).masks)
        agg.add({mask_key(j, n): m for j, layer in enumerate(masks) for n, m in layer.items()})
    masks = agg.global_masks(cfg.server, cfg.prune.plan)
    digest = hashlib.sha256()
    for key in sorted(masks):
        digest.update(key.encode())
        digest.update(masks[key].numpy().tobytes())
    print(run, digest.hexdigest(), agg.rejection.rejected if agg.rejection else None)
"""


#: The runs compared: Wanda and SparseGPT plain, Wanda with a seeded attacker under the Hamming
#: defence (method, attack, attackers, defence).
RUNS = ("wanda,none,0,none", "sparsegpt,none,0,none", "wanda,random,1,hamming")


def _run(tiny_dir) -> list[str]:
    """Every run of :data:`RUNS` in one new process (each from the model loaded afresh): a line
    per run, ``RUN DIGEST REJECTED``."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_dir, *RUNS], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def test_two_processes_give_bit_identical_masks(tiny_dir):
    first = _run(tiny_dir)
    assert first == _run(tiny_dir)
    assert [line.split()[0] for line in first] == list(RUNS)
    digests = [line.split()[1] for line in first]
    assert all(len(d) == 64 for d in digests) and len(set(digests)) == len(RUNS)
    assert not first[2].endswith(" None")  # the Hamming defence ran


def test_report_records_the_machine(tmp_path):
    from fedcompress.report import ISA_FLAGS, RunReport

    report = RunReport(tmp_path, "prune", {"seed": 0})
    machine = report.to_dict()["machine"]
    assert machine["torch_threads"] >= 1 and machine["cpu_count"] >= 1
    assert machine["cpu_model"] and set(machine.get("isa", [])) <= set(ISA_FLAGS)
    assert "cpu_capability" in machine
