"""`jaxattn bench --models`: the tiny configuration on the CPU, in-process (structure of models.json,
plausible times, identical greedy tokens in float32, the profile), the interleaved timer on a
fake clock-free call, and the command line's argument errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from jaxattn import bench_models, cli  # noqa: E402
from jaxattn.bench_models import (  # noqa: E402
    MODES, ImplementationFailed, Timings, _cell, _fill, error_text, run_models, time_interleaved,
)
from jaxattn.bench_timing import Clock  # noqa: E402

CELL_KEYS = {"model", "case", "mode", "sdpa_ms", "jaxattn_ms", "sdpa_spread", "jaxattn_spread", "ratio", "error"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    # One torch thread: two OpenMP threads on two cores that another process also uses can stall
    # each op for most of a second, which would only make this test slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_models("tiny", device="cpu", profile=True, out_dir=str(out))
    finally:
        torch.set_num_threads(threads)
    return {"report": report, "out": out, "data": json.loads((out / "models.json").read_text())}


def test_json_has_the_header_and_one_cell_per_model_case_and_mode(tiny):
    data = tiny["data"]
    assert data == json.loads(json.dumps(tiny["report"]))  # the file is what run_models returned
    header = data["header"]
    assert header["complete"] is True and header["device"] == "cpu" and header["size"] == "tiny"
    assert header["dtype"] == "float32" and header["date"] and header["device_name"]
    assert {"torch", "jax", "transformers", "jaxattn"} <= set(header["versions"])
    assert header["attn_implementation"] == {"sdpa": "sdpa", "jaxattn": "jaxattn"}
    assert header["models"]["tiny"]["params"] > 0 and header["models"]["tiny"]["layers"] == 2
    cells = data["cells"]
    assert [c["mode"] for c in cells] == ["small-fwd", "small-fwd+bwd", "train", "prefill", "generate-dynamic",
                                          "generate-dynamic", "generate-static", "generate-static"]
    assert set(c["mode"] for c in cells) == set(MODES)
    assert all(CELL_KEYS <= set(c) for c in cells)
    assert {c["case"] for c in cells if c["mode"] in ("train", "prefill")} == {"B2 L32"}
    assert [c["case"] for c in cells if c["mode"] == "generate-dynamic"] == ["B1 P16 N4", "B2 P16 N4"]


def test_every_cell_has_positive_times_or_an_error(tiny):
    cells = tiny["data"]["cells"]
    for c in cells:
        if c["error"] is not None:
            assert isinstance(c["error"], str) and c["error"].startswith(("error: ", "skipped: ")), c
            assert c["sdpa_ms"] is None and c["ratio"] is None
            continue
        for impl in ("sdpa", "jaxattn"):
            ms, (low, high) = c[f"{impl}_ms"], c[f"{impl}_spread"]
            assert isinstance(ms, float) and math.isfinite(ms) and ms > 0, c
            assert 0 < low <= ms <= high, c
            assert c["warmup_s"][impl] > 0
        assert c["ratio"] == pytest.approx(c["sdpa_ms"] / c["jaxattn_ms"])
        lo, hi = c["paired_ratio_quartiles"]
        assert lo <= c["paired_ratio"] <= hi
        assert c["repeats"] == (3 if c["mode"].startswith("generate") else 5) and c["calls_per_loop"] >= 1
    # Every cell runs on the CPU (the static cache is not compiled there): an error here is a failure.
    assert [c["error"] for c in cells] == [None] * len(cells)


def test_generate_cells_give_identical_tokens_in_float32(tiny):
    generate = [c for c in tiny["data"]["cells"] if c["mode"].startswith("generate")]
    assert len(generate) == 4
    for c in generate:
        assert c["tokens_match"] is True, c
        for impl in ("sdpa", "jaxattn"):
            want = c["batch"] * c["new_tokens"] / (c[f"{impl}_ms"] / 1e3)
            assert c["tokens_per_s"][impl] == pytest.approx(want)
        assert c["tokens_per_s"]["jaxattn"] / c["tokens_per_s"]["sdpa"] == pytest.approx(c["ratio"])


def test_small_call_cells_report_microseconds(tiny):
    small = [c for c in tiny["data"]["cells"] if c["mode"].startswith("small")]
    assert {c["case"] for c in small} == {"B1 H4 L128 D64 causal"}
    for c in small:
        assert c["sdpa_us"] == pytest.approx(c["sdpa_ms"] * 1e3) and c["jaxattn_us"] > 0


def test_profile_records_kernel_times_for_train_and_prefill_cells_only(tiny):
    for c in tiny["data"]["cells"]:
        if c["mode"] not in ("train", "prefill"):
            assert "kernels" not in c
            continue
        assert "profile_error" not in c, c.get("profile_error")
        assert set(c["kernels"]) == set(c["kernel_total_us"]) == set(c["profile_step_ms"]) == {"sdpa", "jaxattn"}
        assert all(total > 0 for total in c["kernel_total_us"].values())
        # torch's CPU attention ops are named "..._flash_attention_for_cpu": found by the name filter.
        names = [k["name"] for k in c["kernels"]["sdpa"]]
        assert names and all(set(k) == {"name", "us", "calls"} for k in c["kernels"]["sdpa"])
        assert any("flash" in n for n in names)


def test_markdown_and_stdout_tables(tiny, capsys):
    text = (tiny["out"] / "models.md").read_text()
    assert "| model | case | mode | sdpa | jaxattn | ratio | note |" in text
    assert text.count("\n| tiny |") == 6 and "tok/s" in text and "Device:" in text
    print(bench_models.format_table(tiny["data"]["cells"]))
    assert "generate-static" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# The timer and error records


def test_time_interleaved_alternates_after_the_warm_up():
    order = []
    calls = {"sdpa": lambda: order.append("s"), "jaxattn": lambda: order.append("j")}
    selected = []
    timings = time_interleaved(calls, selected.append, Clock("cpu"), repeats=3, loop_s=0.0, max_calls=1, warmup=1)
    # first call + warm-up each, then one loop each per round, the order reversed every other round
    assert order == ["s", "s", "j", "j"] + ["s", "j", "j", "s", "s", "j"]
    assert selected == ["sdpa", "jaxattn"] + ["sdpa", "jaxattn", "jaxattn", "sdpa", "sdpa", "jaxattn"]
    assert timings.calls_per_loop == 1 and len(timings.per_call_s["jaxattn"]) == 3
    lo, hi = timings.spread_ms("sdpa")
    assert 0 < lo <= timings.median_ms("sdpa") <= hi


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    WARM = {"sdpa": 1.0, "jaxattn": 1.0}
    # Round times drift (the second implementation is always 10% slower within a round, while whole
    # rounds move by 2x): the ratio of medians mixes rounds, the paired median does not.
    timings = Timings({"sdpa": [1.0, 2.0, 1.0, 4.0, 1.0], "jaxattn": [1.1, 2.2, 1.1, 4.4, 1.1]}, WARM, 1)
    assert timings.paired_ratios("sdpa", "jaxattn") == pytest.approx([1 / 1.1] * 5)
    cell = _fill(_cell("m", "c", "train"), timings)
    assert cell["paired_ratio"] == pytest.approx(1 / 1.1)
    assert cell["paired_ratio_quartiles"] == pytest.approx([1 / 1.1, 1 / 1.1])
    uneven = Timings({"sdpa": [1.0, 1.0, 1.0, 1.0], "jaxattn": [1.0, 2.0, 4.0, 5.0]}, WARM, 1)
    cell = _fill(_cell("m", "c", "train"), uneven)
    assert cell["paired_ratio"] == pytest.approx((0.5 + 0.25) / 2)
    assert cell["paired_ratio_quartiles"] == pytest.approx([0.2 + 0.05 * 0.75, 0.5 + 0.5 * 0.25])


def test_time_interleaved_names_the_failing_implementation():
    def broken():
        raise RuntimeError("compile failed\ndetails on the next line")

    with pytest.raises(ImplementationFailed) as info:
        time_interleaved({"sdpa": lambda: None, "jaxattn": broken}, lambda impl: None, Clock("cpu"), repeats=1,
                         loop_s=0.0, max_calls=1)
    assert info.value.impl == "jaxattn"
    assert error_text(info.value.__cause__) == "error: RuntimeError: compile failed"
    with pytest.raises(ValueError, match="repeats=0"):
        time_interleaved({}, lambda impl: None, Clock("cpu"), repeats=0, loop_s=0.0, max_calls=1)


# ------------------------------------------------------------------------------------------------
# Command line


def test_cli_passes_the_options_to_run_models(monkeypatch, tmp_path):
    seen = {}

    def fake(size, *, device, implementation, profile, out_dir, progress, print_table):
        seen.update(size=size, device=device, implementation=implementation, profile=profile, out_dir=out_dir)
        return {}

    monkeypatch.setattr(bench_models, "run_models", fake)
    argv = ["bench", "--models", "--models-size", "tiny", "--device", "cpu", "--implementation", "vanilla",
            "--profile", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert seen == {"size": "tiny", "device": "cpu", "implementation": "vanilla", "profile": True,
                    "out_dir": str(tmp_path)}


@pytest.mark.parametrize("argv,expected", [
    (["--models", "--impl", "sdpa"], "--impl is not used with --models"),
    (["--models", "--fwd-only"], "--fwd-only is not used with --models"),
    (["--profile"], "--profile is only used with --models"),
    (["--models-size", "tiny"], "--models-size is only used with --models"),
])
def test_options_that_do_not_fit_are_errors(argv, expected, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("argv,expected", [
    (["--models", "--models-size", "huge"], "invalid choice: 'huge'"),
    (["--models", "--implementation", "bogus"], "--implementation 'bogus': expected one of"),
])
def test_bad_values_are_argparse_errors(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2 and expected in capsys.readouterr().err


def test_bad_python_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"size='huge'"):
        run_models("huge", device="cpu")
    with pytest.raises(ValueError, match=r"device='tpu'"):
        run_models("tiny", device="tpu")
    with pytest.raises(ValueError, match=r"implementation='bogus'.*vanilla"):
        run_models("tiny", device="cpu", implementation="bogus")


def test_long_plan_is_one_head_dim_128_model_at_long_contexts():
    # The sizes where the Hopper kernels run (torch_api/hopper_flash.py HOPPER_MIN_LENGTH, head dim 128).
    from jaxattn.torch_api.hopper_flash import HOPPER_MIN_LENGTH

    plan = bench_models.plan("long", "cuda")
    (model,) = plan.models
    assert model.describe()["head_dim"] == 128 and model.kv_heads < model.heads
    assert all(length >= HOPPER_MIN_LENGTH["train"] for _, length in model.cases)
    assert plan.dtype == "bfloat16" and not model.generate_batches


def test_wide_plan_is_one_head_dim_256_model_where_both_hopper_kernels_run():
    from jaxattn.torch_api.hopper_flash import HOPPER_HEAD_DIMS, HOPPER_MIN_LENGTH

    plan = bench_models.plan("wide", "cuda")
    (model,) = plan.models
    d = model.describe()["head_dim"]
    assert d == 256 and d in HOPPER_HEAD_DIMS["forward"] and d in HOPPER_HEAD_DIMS["train"]
    assert all(length >= max(HOPPER_MIN_LENGTH.values()) for _, length in model.cases)
    assert plan.dtype == "bfloat16" and model.kv_heads < model.heads
