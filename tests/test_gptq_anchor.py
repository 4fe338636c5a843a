"""The GPTQ anchor's harness (simulations/gptq_anchor.py, simulations/anchor/llmc_runner.py)
without llm-compressor's venv: options, the tensor exchange format, integer recovery, and the
comparison / explanation of two integer matrices on synthetic arrays. The real runs (a venv of
its own, minutes of GPTQ) are the script's job, not the suite's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

SIMULATIONS = Path(__file__).resolve().parent.parent / "simulations"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


anchor = _load("gptq_anchor_script", SIMULATIONS / "gptq_anchor.py")
runner = _load("llmc_runner_script", SIMULATIONS / "anchor" / "llmc_runner.py")


# --- options ---------------------------------------------------------------------------------


def test_defaults_are_the_anchor_recipe_and_windows():
    opts = anchor.parse_args([])
    assert (opts.scheme, opts.group_size, opts.asymmetric, opts.actorder) == (
        "w4a16", 64, False, "static")
    assert (opts.dampening, opts.block_size) == (0.01, 128)
    assert (opts.clients, opts.samples_per_client, opts.seqlen, opts.seed) == (16, 4, 128, 0)
    assert (opts.eval_windows, opts.eval_seqlen) == (64, 256)
    assert opts.venv is None  # resolved to $FEDCOMPRESS_CACHE/llmc, outside the repository
    assert anchor.quant_request(opts) == {"bits": 4, "group_size": 64, "symmetric": True,
                                          "actorder": "static", "dampening": 0.01,
                                          "block_size": 128}


def test_options_map_onto_quant_config():
    from fedcompress.quant import QuantConfig

    opts = anchor.parse_args(["--scheme", "w8a16", "--group-size", "0", "--asymmetric",
                              "--actorder", "none", "--dampening", "0.05"])
    q = anchor.quant_request(opts)
    assert q == {"bits": 8, "group_size": 0, "symmetric": False, "actorder": "none",
                 "dampening": 0.05, "block_size": 128}
    config = QuantConfig(scheme="w8a16", group_size=q["group_size"], symmetric=q["symmetric"],
                         actorder=q["actorder"], dampening=q["dampening"])
    assert config.bits == q["bits"]


@pytest.mark.parametrize("argv", [["--group-size", "-1"], ["--dampening", "1.5"],
                                  ["--tie-tol", "0.5"], ["--actorder", "group"],
                                  ["--scheme", "w3a16"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        anchor.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_default_venv_is_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDCOMPRESS_CACHE", str(tmp_path))
    assert anchor.default_venv() == tmp_path / "llmc"


def test_pins_are_checked():
    anchor.check_pins({"torch": "2.13.0+cpu", "llmcompressor": "0.14.0.1"})
    with pytest.raises(RuntimeError, match="llmcompressor 0.13.0: expected 0.14.0.1"):
        anchor.check_pins({"torch": "2.13.0", "llmcompressor": "0.13.0"})
    with pytest.raises(RuntimeError, match="torch not installed"):
        anchor.check_pins({"llmcompressor": "0.14.0.1"})


def test_a_folder_that_is_not_a_venv_is_refused(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(FileNotFoundError, match="has no bin/python"):
        anchor.ensure_venv(tmp_path, "python3.11")


# --- the exchange format ---------------------------------------------------------------------


def test_exchange_round_trip_keeps_dtypes_values_and_header(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"0.mlp.down_proj/weight": torch.randn(6, 8, generator=g),
               "0.mlp.down_proj/hessian": torch.randn(8, 8, dtype=torch.float64, generator=g),
               "llmc/0.q/q": torch.randint(-8, 8, (6, 8), dtype=torch.int8, generator=g),
               "llmc/0.q/perm": torch.randperm(8, generator=g),
               "view": torch.arange(12.0).reshape(3, 4).T}  # not contiguous
    meta = {"quant": {"bits": 4, "group_size": 4}, "layers": ["0.mlp.down_proj"]}
    path = tmp_path / "x.safetensors"
    runner.save_exchange(path, tensors, meta)
    back, header = runner.load_exchange(path)
    assert header == meta
    assert set(back) == set(tensors)
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype
        assert torch.equal(back[key], value)


def test_exchange_refuses_foreign_files_and_non_tensors(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not an anchor exchange file"):
        runner.load_exchange(path)
    with pytest.raises(TypeError, match="'a' is a list"):
        runner.save_exchange(tmp_path / "y.safetensors", {"a": [1, 2]}, {})


def test_unpack_answer_splits_variant_layer_and_field():
    t = {"llmc/3.mlp.up_proj/q": torch.zeros(1), "llmc-f64/3.mlp.up_proj/scale": torch.ones(1)}
    found = anchor.unpack_answer(t, ["llmc", "llmc-f64"])
    assert set(found["llmc"]["3.mlp.up_proj"]) == {"q"}
    assert set(found["llmc-f64"]["3.mlp.up_proj"]) == {"scale"}


# --- integers back from dequantized weights ---------------------------------------------------


@pytest.mark.parametrize("bits,group,symmetric", [(4, 4, True), (4, 4, False), (8, 0, True),
                                                  (8, 8, False)])
def test_recover_integers_is_exact(bits, group, symmetric):
    g = torch.Generator().manual_seed(bits + group)
    rows, cols = 5, 8
    groups = cols // group if group else 1
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(low, high + 1, (rows, cols), generator=g)
    scale = torch.rand(rows, groups, generator=g) * 0.1 + 1e-3
    zp = (torch.randint(low, high + 1, (rows, groups), generator=g).float() if not symmetric
          else torch.zeros(rows, groups))
    index = runner.group_index(cols, group)
    deq = (q.float() - zp[:, index]) * scale[:, index]
    back = runner.recover_integers(deq, scale, zp, group, bits)
    assert back.dtype == torch.int8
    assert torch.equal(back.long(), q)


def test_recover_integers_refuses_weights_off_the_grid():
    scale = torch.full((2, 1), 0.1)
    zp = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="not on this scale's grid"):
        runner.recover_integers(torch.tensor([[0.1, 0.1234], [0.2, 0.3]]), scale, zp, 0, 4)
    with pytest.raises(ValueError, match=r"span \[-9, 1\]"):
        runner.recover_integers(torch.tensor([[-0.9, 0.1], [0.0, 0.0]]), scale, zp, 0, 4)
    with pytest.raises(ValueError, match="group size 3 does not divide 4"):
        runner.group_index(4, 3)


# --- comparison and explanation --------------------------------------------------------------


def test_boundary_margin_measures_the_distance_to_a_rounding_step():
    pre = torch.tensor([2.49, 2.5, 3.0, 7.4, 7.9, -8.7, -7.51, 0.0])
    m = anchor.boundary_margin(pre, -8, 7)
    expected = torch.tensor([0.01, 0.0, 0.5, 0.9, 1.4, 1.2, 0.01, 0.5], dtype=torch.float64)
    assert torch.allclose(m, expected, atol=1e-6)


def test_identical_integers():
    q = torch.randint(-8, 8, (4, 6), dtype=torch.int8)
    cmp = anchor.compare_integers(q, q.clone())
    assert cmp["identical_share"] == 1.0 and cmp["differing"] == 0 and cmp["max_abs_diff"] == 0
    ok, notes = anchor.explain(cmp)
    assert ok and notes == ["identical integers"]


def _diverging_pair():
    """Row 1 diverges at the 3rd column of the sweep order (a near-tie), then cascades; row 3
    diverges once at its last swept column."""
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    a = torch.zeros(4, 6, dtype=torch.int8)
    b = a.clone()
    b[1, 3], b[1, 2], b[1, 0] = 1, -2, 1  # sweep positions 2, 3, 5
    b[3, 0] = -1
    pre = torch.full((4, 6), 0.2)
    pre[1, 3] = 0.5004  # the root of row 1: 4e-4 from the boundary 0.5
    pre[3, 0] = -0.5001
    return a, b, order, pre


def test_roots_are_first_differences_in_sweep_order_and_near_ties_explain_them():
    a, b, order, pre = _diverging_pair()
    cmp = anchor.compare_integers(a, b, order, pre, bits=4, tie_tol=1e-3)
    assert cmp["differing"] == 4 and cmp["rows_diverging"] == 2 and cmp["cascade"] == 2
    assert cmp["max_abs_diff"] == 2
    assert cmp["identical_share"] == pytest.approx(20 / 24)
    assert cmp["roots_near_tie"] == 2
    assert cmp["root_margin_max"] == pytest.approx(4e-4, abs=1e-6)
    assert cmp["chance_near_tie"] == pytest.approx(2 / 24)
    ok, notes = anchor.explain(cmp)
    assert ok
    assert "2 rows diverge; 2 of them first at a weight within 0.001" in notes[0]
    assert "the other 2 differing integers follow" in notes[1]


def test_the_root_depends_on_the_sweep_order():
    a, b, _, pre = _diverging_pair()
    # in the columns' own order, row 1 first differs at column 0, whose value is no near-tie
    cmp = anchor.compare_integers(a, b, None, pre, bits=4, tie_tol=1e-3)
    assert cmp["roots_near_tie"] == 1
    ok, notes = anchor.explain(cmp)
    assert not ok
    assert "1 rows first differ at a weight farther than 0.001" in notes[-1]


def test_without_values_before_rounding_differences_stay_unexplained():
    a, b, order, _ = _diverging_pair()
    ok, notes = anchor.explain(anchor.compare_integers(a, b, order))
    assert not ok and "no values before rounding" in notes[0]


def test_scale_and_order_differences_are_named():
    a, b, order, pre = _diverging_pair()
    cmp = anchor.compare_integers(a, b, order, pre)
    ok, notes = anchor.explain(cmp, scales_equal=False)
    assert not ok and "scales or zero points differ" in notes[0]
    ok, notes = anchor.explain(cmp, order_differs=2, order_ties=2)
    assert ok and "tie order of the sort" in notes[0]
    ok, notes = anchor.explain(cmp, order_differs=3, order_ties=1)
    assert not ok and "2 without a tie" in notes[0]


def test_compare_refuses_mismatched_inputs():
    q = torch.zeros(3, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="same shape"):
        anchor.compare_integers(q, torch.zeros(3, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="not a permutation"):
        anchor.compare_integers(q, q, torch.tensor([0, 1, 1, 2]))
    with pytest.raises(ValueError, match="values before rounding of shape"):
        anchor.compare_integers(q, q, None, torch.zeros(4, 3))


def test_activation_order_and_its_ties():
    h = torch.diag(torch.tensor([1.0, 3.0, 3.0, 2.0], dtype=torch.float64))
    assert anchor.order_of(h, "none", torch.float32) is None
    order = anchor.order_of(h, "static", torch.float64)
    assert order[0].item() in (1, 2) and order[2:].tolist() == [3, 0]
    assert anchor.tied_columns(h, torch.tensor([1, 2])) == 2
    assert anchor.tied_columns(h, torch.tensor([0, 3])) == 0
    # distinct in float64, tied once cast to float32
    h32 = torch.diag(torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64))
    assert anchor.tied_columns(h32, torch.tensor([0, 1])) == 2


def test_per_layer_rows_compare_each_pair_present():
    a, b, order, pre = _diverging_pair()
    scale = torch.ones(4, 1)
    zp = torch.zeros(4, 1)

    def side(q):
        return {"0.mlp.up_proj": {"q": q, "scale": scale, "zero_point": zp, "weight": q.float(),
                                  "pre": pre, "perm": order}}

    recorded = {(0, "mlp.up_proj"): {"weight": torch.zeros(4, 6),
                                     "hessian": torch.eye(6, dtype=torch.float64)}}
    sides = {"llmc": side(b), "llmc-f64": side(a)}
    quant = {"bits": 4}
    rows = anchor.per_layer_rows(sides, recorded, quant, 1e-3)
    assert [r["pair"] for r in rows] == ["llmc-f64 vs llmc"]
    assert rows[0]["differing"] == 4 and rows[0]["explained"]
    assert rows[0]["max_weight_diff"] == 2.0 and rows[0]["scales_identical"]
    sides.update({"ours": side(a), "ours-f32": side(b)})
    rows = anchor.per_layer_rows(sides, recorded, quant, 1e-3)
    assert [r["pair"] for r in rows] == ["ours vs llmc", "ours vs llmc-f64", "ours-f32 vs llmc",
                                         "llmc-f64 vs llmc"]
    assert rows[1]["differing"] == 0 and rows[1]["explanation"] == "identical integers"
    assert rows[2]["differing"] == 0
    assert "ours vs llmc" in anchor.layer_table(rows)


def test_order_differences_at_tied_diagonals_are_explained():
    q = torch.zeros(2, 4, dtype=torch.int8)
    h = torch.diag(torch.tensor([2.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    base = {"q": q, "scale": torch.ones(2, 1), "zero_point": torch.zeros(2, 1),
            "weight": q.float(), "pre": torch.zeros(2, 4)}
    a = {**base, "perm": torch.tensor([0, 1, 2, 3])}
    b = {**base, "perm": torch.tensor([1, 0, 2, 3])}
    row = anchor.compare_pair(a, b, h, {"bits": 4}, 1e-3)
    assert row["order_columns_differing"] == 2 and row["explained"]
    assert "tie order of the sort" in row["explanation"]


def test_hessian_precision_swaps_the_named_constants_and_restores_them(monkeypatch):
    import sys
    import types

    from fedcompress.solver import obs as scores  # the OBS sweep's factorisation

    fake = types.ModuleType("fake_solver_module")
    fake.HESSIAN_DTYPE = torch.float64

    def solver(weight, hessian, config):
        return fake.HESSIAN_DTYPE, scores.HESSIAN_DTYPE

    solver.__module__ = fake.__name__
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    with anchor.hessian_precision(solver, torch.float32):
        assert solver(None, None, None) == (torch.float32, torch.float32)
    assert solver(None, None, None) == (torch.float64, torch.float64)
    with anchor.hessian_precision(solver, None):
        assert solver(None, None, None) == (torch.float64, torch.float64)
    with pytest.raises(RuntimeError), anchor.hessian_precision(solver, torch.float32):
        raise RuntimeError("restored even when the block fails")
    assert scores.HESSIAN_DTYPE == torch.float64
    del fake.HESSIAN_DTYPE
    with pytest.raises(AttributeError, match="fake_solver_module"), \
            anchor.hessian_precision(solver, torch.float32):
        pass


def test_llmc_only_needs_the_oneshot():
    with pytest.raises(SystemExit):
        anchor.parse_args(["--llmc-only", "--no-oneshot"])
    assert anchor.parse_args(["--llmc-only", "--reuse-llmc"]).reuse_llmc


def test_oneshot_fingerprint_follows_windows_recipe_model_and_venv():
    w = torch.arange(12).reshape(3, 4)
    q = {"bits": 4, "group_size": 64}
    v = {"llmcompressor": "0.14.0.1"}
    base = anchor.oneshot_fingerprint(w, q, Path("/m"), v)
    assert base == anchor.oneshot_fingerprint(w.clone(), dict(q), Path("/m"), dict(v))
    w2 = w.clone()
    w2[2, 3] = 0
    assert base != anchor.oneshot_fingerprint(w2, q, Path("/m"), v)
    assert base != anchor.oneshot_fingerprint(w, {**q, "group_size": 32}, Path("/m"), v)
    assert base != anchor.oneshot_fingerprint(w, q, Path("/other"), v)
    assert base != anchor.oneshot_fingerprint(w, q, Path("/m"), {"llmcompressor": "0.15"})


def test_an_earlier_llmc_model_is_reused_only_for_the_same_fingerprint(tmp_path):
    import json

    out, work = tmp_path / "out", tmp_path / "work"
    (out / anchor.LLMC_MODEL).mkdir(parents=True)
    work.mkdir()
    versions = {"llmcompressor": "0.14.0.1"}
    (work / "versions.json").write_text(json.dumps(versions))
    w = torch.arange(8).reshape(2, 4)
    q = {"bits": 4}
    fp = anchor.oneshot_fingerprint(w, q, Path("/m"), versions)
    (out / "llmc-oneshot.json").write_text(json.dumps({"fingerprint": fp,
                                                       "timings": {"oneshot": 840.0}}))
    info = anchor.llmc_oneshot(None, None, w, q, Path("/m"), out, work, tmp_path / "log", True)
    assert info["reused"] and info["timings"]["oneshot"] == 840.0
    assert info["model_dir"] == str(out / anchor.LLMC_MODEL)
    # from another run's folder
    mine = tmp_path / "mine"
    info = anchor.llmc_oneshot(None, None, w, q, Path("/m"), mine, work, tmp_path / "log", True,
                               out)
    assert info["reused"] and info["model_dir"] == str(out / anchor.LLMC_MODEL)

    class Stop(Exception):
        pass

    class Runner:  # another recipe: the model must be made again (stopped here)
        def save_exchange(self, *args):
            raise Stop

    with pytest.raises(Stop):
        anchor.llmc_oneshot(None, Runner(), w, {"bits": 8}, Path("/m"), out, work,
                            tmp_path / "log", True)


def test_llmc_perplexity_of_an_earlier_run_is_found_only_when_it_fits(tmp_path):
    import json

    opts = anchor.parse_args(["--out", str(tmp_path), "--reuse-llmc"])
    assert anchor.earlier_llmc_eval(tmp_path, opts) is None
    report = {"status": "ok", "started": "2026-11-26T08:34:00", "versions": {"git_commit": "abc"},
              "config": {"eval_windows": 64, "eval_seqlen": 256, "batch_size": 8,
                         "model": "smollm2-135m"},
              "results": [{"name": "llmc-gptq", "perplexity": 33.66}],
              "llmc_oneshot": {"fingerprint": "f00"}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    found = anchor.earlier_llmc_eval(tmp_path, opts)
    assert found == {"perplexity": 33.66, "fingerprint": "f00",
                     "from": "2026-11-26T08:34:00 at abc"}
    other = anchor.parse_args(["--out", str(tmp_path), "--eval-windows", "16"])
    assert anchor.earlier_llmc_eval(tmp_path, other) is None
    (tmp_path / "report.json").write_text(json.dumps({**report, "status": "failed"}))
    assert anchor.earlier_llmc_eval(tmp_path, opts) is None
