"""Streaming vote counts: the server counts each site's payload as it arrives and keeps only the
running counts (``MaskAggregator(streaming=True)``), with the same result as keeping them."""

from __future__ import annotations

import pytest
import torch

from fedcompress.methods.fedprllm.federated import MaskAggregator, ServerConfig, expected_shapes
from fedcompress.models import load_model


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, device="cpu")

@pytest.mark.parametrize("clients", [1, 5, 300])
def test_streaming_aggregator_counts_equal_the_kept_payloads(tiny, clients):
    """The running counts (each payload counted as it arrives, then dropped) equal the counts
    of every kept payload, also past 255 sites (wider counts); the global masks and the
    pruned model are the same; no payload is held."""
    shapes = expected_shapes(tiny.model)
    gen = torch.Generator().manual_seed(clients)
    kept = MaskAggregator(tiny.model, clients)
    streaming = MaskAggregator(tiny.model, clients, streaming=True)
    for _ in range(clients):
        masks = {k: torch.rand(s, generator=gen) < 0.5 for k, s in shapes.items()}
        kept.add(masks)
        streaming.add(masks)
        assert not any(streaming.payloads.values())
    for key in shapes:
        counts = streaming.layer_counts(key)
        assert counts.dtype == kept.layer_counts(key).dtype
        assert torch.equal(counts, kept.layer_counts(key)), key
    server = ServerConfig("row", scale=True)
    a, b = (load_model(tiny.path, device="cpu").model for _ in range(2))
    kept.prune(a, server, 0.5)
    streaming.prune(b, server, 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


def test_streaming_aggregator_refuses_what_needs_every_payload(tiny):
    streaming = MaskAggregator(tiny.model, 2, streaming=True)
    streaming.add({k: torch.zeros(s, dtype=torch.bool) for k, s in
                   expected_shapes(tiny.model).items()})
    for call in (lambda: streaming.subset([0]), lambda: streaming.with_sites({}),
                 lambda: streaming.defended(ServerConfig(defence="hamming"))):
        with pytest.raises(ValueError, match="keeps only the running vote counts"):
            call()


class _TrickleGrid:
    """A Grid with Flower's push/pull API over the in-process FedPrLLM ClientApp: each pull
    returns at most one reply, newest node first (arrival order is not node order), and
    records how many masks the strategy had counted when it was called."""

    def __init__(self, n: int, strategy_of):
        from conftest import InProcessFederation

        class Federation(InProcessFederation):
            app = "clients.app"

        self.federation = Federation(n)
        self.strategy_of = strategy_of
        self.waiting: list = []
        self.counted_at_pull: list[int] = []
        self.pull_interval = 0.0

    def get_node_ids(self):
        return self.federation.get_node_ids()

    def push_messages(self, messages):
        import uuid

        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(msg.metadata.message_id)
            self.waiting += self.federation.send_and_receive([msg])
        self.waiting.sort(key=lambda r: r.metadata.src_node_id)
        return ids

    def send_and_receive(self, messages, timeout=None):  # Flower's: every reply, then return
        ids = set(self.push_messages(messages))
        replies = []
        while ids:
            replies += self.pull_messages(ids)
            ids -= {r.metadata.reply_to_message_id for r in replies}
        return replies

    def pull_messages(self, message_ids):
        self.counted_at_pull.append(self.strategy_of().aggregator.clients)
        wanted = set(message_ids)
        for i in reversed(range(len(self.waiting))):
            if self.waiting[i].metadata.reply_to_message_id in wanted:
                return [self.waiting.pop(i)]
        return []


def test_the_strategy_counts_each_reply_as_it_arrives(tiny_dir, tiny):
    """Through Flower's round loop (``Strategy.start``) on a Grid that delivers one reply per
    pull: each site's masks are counted before the next reply is pulled (never all held), and
    the vote, its pruned model and the report's per-site records equal those of a run that
    holds every payload and counts in node order."""
    from flwr.app import ArrayRecord

    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from strategies.common import STARTUP_KEYS
    from strategies.fedprllm import FedPrLLM

    config = FedPrLLMConfig(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16,
                            batch_size=2)
    runs = {}
    for streaming in (True, False):
        strategy = FedPrLLM(config, tiny.model, streaming=streaming)
        grid = _TrickleGrid(4, lambda s=strategy: s)
        strategy.start(grid, ArrayRecord(), num_rounds=1, timeout=60)
        runs[streaming] = strategy, grid
    (streamed, grid), (held, _) = runs[True], runs[False]
    assert grid.counted_at_pull == [0, 1, 2, 3]  # reply k counted before pull k + 1
    assert not any(streamed.aggregator.payloads.values())
    assert held.aggregator.clients == streamed.aggregator.clients == 4
    for key, counts in held.aggregator.counts().items():
        assert torch.equal(counts, streamed.aggregator.layer_counts(key)), key
    a, b = (load_model(tiny_dir, device="cpu").model for _ in range(2))
    held.prune(a)
    streamed.prune(b)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))
    assert streamed.site_nodes == held.site_nodes == {1: [100, 101, 102, 103]}
    timing = ("seconds", "pid", *STARTUP_KEYS)
    strip = [{k: v for k, v in m.items() if k not in timing}
             for m in streamed.outcome.client_metrics]
    assert strip == [{k: v for k, v in m.items() if k not in timing}
                     for m in held.outcome.client_metrics]


def test_a_defence_that_compares_sites_keeps_every_payload(tiny_dir):
    from fedcompress.methods.fedprllm.federated import FedPrLLMConfig
    from strategies.fedprllm import FedPrLLM

    base = dict(model=tiny_dir, clients=4, samples_per_client=2, seqlen=16, batch_size=2)
    model = load_model(tiny_dir, device="cpu").model
    assert FedPrLLM(FedPrLLMConfig(**base, defence="trim", trim=1), model).streaming
    for defence, trim in (("hamming", 0), ("both", 1)):
        strategy = FedPrLLM(FedPrLLMConfig(**base, defence=defence, trim=trim), model)
        assert not strategy.streaming and not strategy.aggregator.streaming
