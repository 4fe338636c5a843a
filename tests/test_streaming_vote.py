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
