"""`jaxattn bench`: FLOP/byte counting and the timer on known answers, and a --quick run on the CPU
(columns, plausible values, the ratio to torch's fastest backend, files, plots, bad arguments)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

from jaxattn import cli
from jaxattn.bench import Case, Preset, _measure_row, _Run, default_impls, run_bench
from jaxattn.bench_report import COLUMNS, JSON_ONLY
from jaxattn.bench_timing import Clock, attention_flops, decode_bytes, measure, visible_pairs


# ------------------------------------------------------------------------------------------------
# Counting and timing


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (4, 4), (97, 97), (3, 5), (5, 3), (1, 4096), (130, 17)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_match_torch_causal_mask(q_len, kv_len, causal):
    # Oracle: the pairs torch's is_causal attends over, read off the mask torch documents for it.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        mask = mask.tril(diagonal=0)
    assert visible_pairs(q_len, kv_len, causal) == int(mask.sum())


def test_attention_flops_known_values():
    # 2 products x 2 FLOPs per multiply-add: 4*B*H*L*S*D without a mask (flash-attn's count) ...
    assert attention_flops(2, 16, 8192, 8192, 128, 128, causal=False, backward=False) == 4 * 2 * 16 * 8192 ** 2 * 128
    # ... L(L+1)/2 pairs with a causal mask, so close to half for long sequences ...
    full = attention_flops(1, 1, 4096, 4096, 64, 64, causal=False, backward=False)
    causal = attention_flops(1, 1, 4096, 4096, 64, 64, causal=True, backward=False)
    assert causal / full == pytest.approx(4097 / (2 * 4096))
    assert attention_flops(1, 1, 2, 2, 3, 3, causal=True, backward=False) == 2 * 3 * 6  # 3 pairs, D + Dv = 6
    # ... and 3.5x the forward with the backward (2 products forward, 5 backward).
    assert attention_flops(1, 2, 3, 4, 5, 6, False, True) == 3.5 * attention_flops(1, 2, 3, 4, 5, 6, False, False)
    with pytest.raises(ValueError, match="q_len=-1"):
        visible_pairs(-1, 3, True)


def test_decode_bytes_equal_the_tensors_moved():
    b, hq, hkv, t, s, d, dv = 3, 8, 2, 1, 40, 16, 24
    q = torch.randn(b, hq, t, d, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, s, dv, dtype=torch.bfloat16)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    moved = sum(x.numel() * x.element_size() for x in (q, k, v, out))
    assert decode_bytes(b, hq, hkv, t, s, d, dv, itemsize=2) == moved


def test_measure_reports_first_call_apart_and_excludes_warmup():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.15 if len(calls) == 1 else 0.002)  # a slow first call, as a compile

    timing = measure(fn, Clock("cpu"), repeats=3, warmup=2, target_s=0.01)
    assert timing.first_call_s >= 0.15
    assert 0.002 <= timing.min_s <= timing.median_s <= timing.max_s < 0.1  # the first call is not in the loops
    assert timing.repeats == 3 and 1 <= timing.iters <= 5
    assert len(calls) == 1 + 2 + 1 + 3 * timing.iters  # first, warm-up, calibration, timed loops


def test_measure_rejects_bad_settings():
    with pytest.raises(ValueError, match="repeats=0"):
        measure(lambda: None, Clock("cpu"), repeats=0)


# ------------------------------------------------------------------------------------------------
# A --quick run on the CPU


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = cli.main(["bench", "--quick", "--device", "cpu", "--out", str(out)])
    return {"status": status, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def _csv_rows(out):
    with open(out / "bench.csv", newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_quick_run_writes_csv_and_json_with_the_columns(quick_run):
    assert quick_run["status"] == 0
    fields, rows = _csv_rows(quick_run["out"])
    assert tuple(fields) == COLUMNS
    data = json.loads((quick_run["out"] / "bench.json").read_text())
    assert data["meta"]["complete"] is True and data["meta"]["device"] == "cpu"
    assert {"torch", "jax", "jaxattn"} <= set(data["meta"]["versions"])
    assert len(data["rows"]) == len(rows) > 0
    assert all(tuple(r) == COLUMNS + JSON_ONLY for r in data["rows"])
    assert {r["impl"] for r in data["rows"]} == set(default_impls())
    assert {"sdpa", "flash", "decode", "vanilla", "torch-math", "torch-cudnn"} <= set(default_impls())
    assert "auto" not in default_impls()
    # Every cell of the plan ran: forward and forward+backward for prefill, forward for decode.
    assert {(r["group"], r["mode"]) for r in data["rows"]} == {
        ("sweep", "fwd"), ("sweep", "fwd+bwd"), ("small", "fwd"), ("small", "fwd+bwd"), ("decode", "fwd")}
    assert "vs torch" in quick_run["stdout"] and "TFLOP/s" in quick_run["stdout"]
    assert f"/{len(rows)} " in quick_run["stderr"]  # the progress bar counted every row


def test_quick_run_values_are_plausible(quick_run):
    rows = json.loads((quick_run["out"] / "bench.json").read_text())["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {"sdpa", "vanilla", "decode", "torch-math", "torch-flash"} <= {r["impl"] for r in ok}
    for r in ok:
        for key in ("time_us", "min_us", "max_us", "first_call_s", "tflops"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["min_us"] <= r["time_us"] <= r["max_us"]
        assert r["iters"] >= 1 and r["repeats"] == 5 == len(r["repeat_us"])
        assert r["min_us"] == pytest.approx(min(r["repeat_us"])) and r["max_us"] == pytest.approx(max(r["repeat_us"]))
        assert r["spread"] == pytest.approx(r["max_us"] / r["min_us"]) and isinstance(r["unsteady"], bool)
        flops = attention_flops(r["batch"], r["q_heads"], r["q_len"], r["kv_len"], r["head_dim"], r["head_dim"],
                                r["causal"], r["mode"] == "fwd+bwd")
        assert r["tflops"] == pytest.approx(flops / (r["time_us"] * 1e-6) / 1e12)
        if r["decode"]:
            nbytes = decode_bytes(r["batch"], r["q_heads"], r["kv_heads"], r["q_len"], r["kv_len"], r["head_dim"],
                                  r["head_dim"], 4)
            assert r["gbps"] == pytest.approx(nbytes / (r["time_us"] * 1e-6) / 1e9)
        else:
            assert r["gbps"] is None
    # Backends that cannot run on the CPU are listed with their reason, not dropped.
    declined = {r["impl"]: r for r in rows if r["status"] == "unsupported"}
    assert {"flash", "torch-efficient", "torch-cudnn"} <= set(declined)
    assert "cpu" in declined["flash"]["reason"] and "CUDA-only" in declined["torch-cudnn"]["reason"]
    assert all(r["time_us"] is None and r["vs_torch_best"] is None for r in declined.values())


def test_ratio_is_against_torchs_fastest_backend_of_the_cell(quick_run):
    rows = json.loads((quick_run["out"] / "bench.json").read_text())["rows"]
    cells = {}
    for r in rows:
        cells.setdefault((r["case"], r["dtype"], r["mode"]), []).append(r)
    assert len(cells) == 9
    for cell in cells.values():
        torch_ok = [r for r in cell if r["family"] == "torch" and r["status"] == "ok"]
        assert len(torch_ok) >= 2  # math and torch's CPU flash: a real choice of the best
        best = min(torch_ok, key=lambda r: r["time_us"])
        for r in cell:
            assert r["torch_best"] == best["impl"]
            if r["status"] == "ok":
                assert r["vs_torch_best"] == pytest.approx(best["time_us"] / r["time_us"])
                # Paired: the same rounds of both sides, ratio per round.
                per_round = [b / o for b, o in zip(best["repeat_us"], r["repeat_us"])]
                assert r["vs_torch_min"] == pytest.approx(min(per_round))
                assert r["vs_torch_max"] == pytest.approx(max(per_round))
                assert r["vs_torch_min"] <= r["vs_torch_paired"] <= r["vs_torch_max"]
        assert max(r["vs_torch_best"] for r in torch_ok) == pytest.approx(1.0)
    _, csv_rows = _csv_rows(quick_run["out"])
    for c, j in zip(csv_rows, rows):
        assert (c["impl"], c["case"], c["mode"]) == (j["impl"], j["case"], j["mode"])
        if j["vs_torch_best"] is not None:
            assert float(c["vs_torch_best"]) == pytest.approx(j["vs_torch_best"])


def test_quick_run_writes_plots_and_summary(quick_run):
    pytest.importorskip("matplotlib")
    for name in ("tflops_vs_seqlen.png", "small_call_latency.png", "decode_gbps.png", "vs_torch.png"):
        data = (quick_run["out"] / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    summary = (quick_run["out"] / "summary.md").read_text()
    assert "TFLOP/s" in summary and "GB/s" in summary and "torch-cudnn, unsupported" in summary


def test_from_json_redraws_without_measuring(quick_run, tmp_path):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = cli.main(["bench", "--from-json", str(quick_run["out"] / "bench.json"), "--out", str(tmp_path),
                           "--no-plots"])
    assert status == 0
    assert (tmp_path / "summary.md").read_text() == (quick_run["out"] / "summary.md").read_text()
    assert not list(tmp_path.glob("*.png"))


# ------------------------------------------------------------------------------------------------
# The Python entry point and errors


def test_run_bench_returns_rows_for_the_chosen_implementations():
    rows = run_bench("quick", impls=["sdpa", "torch-math"], dtypes=["fp32"], fwd_only=True, device="cpu")
    assert {r["impl"] for r in rows} == {"sdpa", "torch-math"}
    assert {r["mode"] for r in rows} == {"fwd"} and {r["dtype"] for r in rows} == {"float32"}
    assert all(r["status"] == "ok" and r["time_us"] > 0 for r in rows)


def test_time_budget_and_score_limit_skip_with_a_reason():
    rows = run_bench("quick", impls=["sdpa"], fwd_only=True, device="cpu", max_minutes=1e-9)
    assert rows and all(r["status"] == "skipped" and "--max-minutes" in r["reason"] for r in rows)
    plan = Preset("tiny", (), ("float32",), (), repeats=1, target_s=1e-3, max_score_gib=1e-9)
    case = Case("sweep", 1, 1, 1, 8, 8, 4, True)
    row = _measure_row(_Run("cpu", plan, None, None), "torch-math", case, "float32", "fwd", None)
    assert row["status"] == "skipped" and "score matrix" in row["reason"]


@pytest.mark.parametrize("argv,expected", [
    (["--impl", "bogus"], ["--impl", "bogus", "torch-math", "sdpa"]),
    (["--dtype", "int8"], ["--dtype", "int8", "bfloat16"]),
    (["--max-minutes", "-1"], ["--max-minutes", "-1", "positive"]),
    (["--quick", "--full"], ["--full", "not allowed with"]),
    (["--device", "tpu"], ["--device", "tpu", "cuda"]),
])
def test_bad_arguments_error_clearly(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, (text, err)


def test_bad_python_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"impls=\['bogus'\].*torch-cudnn"):
        run_bench("quick", impls=["bogus"], device="cpu")
    with pytest.raises(ValueError, match=r"dtype='int4'"):
        run_bench("quick", dtypes=["int4"], device="cpu")
    with pytest.raises(ValueError, match=r"preset='huge'"):
        run_bench("huge", device="cpu")
    with pytest.raises(ValueError, match=r"device='tpu'"):
        run_bench("quick", device="tpu")


def test_from_json_with_a_missing_file_errors(tmp_path, capsys):
    assert cli.main(["bench", "--from-json", str(tmp_path / "none.json")]) == 2
    assert "--from-json" in capsys.readouterr().err
