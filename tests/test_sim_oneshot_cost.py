"""The pure parts of ``simulations/oneshot_cost.py`` (issue 63's one-shot round against
centralized pruning): reading a setting and what the server prunes. No model is loaded."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model, load_tool


@pytest.fixture(scope="module")
def sim():
    return load_tool("oneshot_cost", "simulations")


def test_settings_name_model_sites_windows_and_onload(sim):
    config = sim.parse_setting("qwen2.5-1.5b:16:4:onload", 256)
    assert (config.model, config.clients, config.samples_per_client, config.seqlen,
            config.onload, config.prune.onload) == ("qwen2.5-1.5b", 16, 4, 256, True, True)
    plain = sim.parse_setting("smollm2-135m:8:2", 128)
    assert (plain.clients, plain.samples_per_client, plain.seqlen, plain.onload) == \
        (8, 2, 128, False)
    assert sim.parse_setting("smollm2-135m:8:2", 128, onload=True).onload


@pytest.mark.parametrize("bad, match", [("smollm2-135m:16", "MODEL:CLIENTS:WINDOWS"),
                                        ("smollm2-135m:16:4:fast", "MODEL:CLIENTS:WINDOWS"),
                                        ("smollm2-135m:x:4", "integer CLIENTS")])
def test_bad_settings_say_what_is_expected(sim, bad, match):
    with pytest.raises(ValueError, match=match):
        sim.parse_setting(bad, 256)


def test_the_server_copies_a_whole_model_and_prunes_a_skeleton_itself(sim, monkeypatch):
    model = build_tiny_model("llama", n_layers=2)
    copy = sim.server_copy(model)
    assert copy is not model
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(copy.parameters(),
                                                            model.parameters()))
    monkeypatch.setattr(sim, "onloader_of", lambda m: object())
    assert sim.server_copy(model) is model
