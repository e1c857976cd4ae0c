"""`jaxattn bench` on synthetic repeats (no timing): the spread of each figure, the paired ratio to
torch, the unsteady mark and the closing warning, the notes column wrapped at word boundaries,
error-bar plots, and the default output folder."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

from jaxattn import bench_spread, cli
from jaxattn.bench import DEFAULT_OUT, Case
from jaxattn.bench_report import NOTE_WIDTH, finish_cell, format_table, markdown_summary, metrics, write_outputs
from jaxattn.bench_spread import SPREAD_LIMIT, loaded_warning, mark_unsteady, paired_ratios, spread
from jaxattn.bench_timing import Timing, round_orders

CASE = Case("sweep", 1, 2, 2, 64, 64, 32, True)


def _row(impl: str, mode: str, repeat_us, family: str = "ours") -> dict:
    timing = Timing.of_repeats(0.5, 10, [t * 1e-6 for t in repeat_us])
    return {"impl": impl, "family": family, "status": "ok", "reason": "", **metrics(CASE, "float32", mode, timing)}


def _cell(mode: str, torch_us, ours_us) -> list[dict]:
    return finish_cell([_row("torch-math", mode, torch_us, "torch"), _row("sdpa", mode, ours_us)], CASE, "float32",
                       mode)


def test_spread_and_paired_ratio_of_synthetic_repeats():
    assert spread([100.0, 120.0, 110.0]) == pytest.approx(1.2)
    assert paired_ratios([100.0, 300.0], [50.0, 100.0]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="reference_us has 2 repeats and row_us 1"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"values=\[0.0, 1.0\]"):
        spread([0.0, 1.0])
    # torch drifts 100 -> 200 µs over the rounds and so do we at half its time: every paired ratio
    # is 2 although each side alone spreads 2x.
    torch_us, ours_us = [100.0, 150.0, 200.0, 120.0, 180.0], [50.0, 75.0, 100.0, 60.0, 90.0]
    _, sdpa = _cell("fwd", torch_us, ours_us)
    assert (sdpa["min_us"], sdpa["time_us"], sdpa["max_us"]) == pytest.approx((50.0, 75.0, 100.0))
    assert sdpa["spread"] == pytest.approx(2.0)
    assert (sdpa["vs_torch_min"], sdpa["vs_torch_paired"], sdpa["vs_torch_max"]) == pytest.approx((2.0, 2.0, 2.0))
    assert sdpa["vs_torch_best"] == pytest.approx(150.0 / 75.0)


def test_steady_rows_are_not_marked_and_unsteady_ones_say_why():
    steady = _cell("fwd", [100.0, 104.0, 98.0], [50.0, 51.0, 49.0])
    assert mark_unsteady(steady) == 0 and not any(r["unsteady"] for r in steady)
    assert loaded_warning(steady, 5) is None
    # Ours spreads 3x (and its per-round ratios straddle 1 widely): marked, torch's own row is not.
    noisy = _cell("fwd", [100.0, 104.0, 98.0], [50.0, 150.0, 60.0])
    assert mark_unsteady(noisy) == 1
    torch_row, sdpa = noisy
    assert sdpa["unsteady"] and "repeats spread 3.0x" in sdpa["unsteady_why"] and "ratio" in sdpa["unsteady_why"]
    assert torch_row["unsteady"] is False
    # Just under and just over the limit.
    assert mark_unsteady(_cell("fwd", [100.0, 100.0], [50.0, 50.0 * SPREAD_LIMIT * 0.99])) == 0
    assert mark_unsteady(_cell("fwd", [100.0, 100.0], [50.0, 50.0 * SPREAD_LIMIT * 1.01])) == 1
    # A torch reference that spreads makes our ratio against it unsteady too.
    _, sdpa = rows = _cell("fwd", [100.0, 400.0, 100.0], [50.0, 51.0, 50.0])
    mark_unsteady(rows)
    assert "torch-math repeats spread 4.0x" in sdpa["unsteady_why"]


def test_forward_slower_than_forward_backward_is_marked():
    rows = _cell("fwd", [300.0, 301.0], [100.0, 101.0]) + _cell("fwd+bwd", [200.0, 201.0], [300.0, 301.0])
    assert mark_unsteady(rows) == 2  # torch-math fwd and fwd+bwd; sdpa's forward is faster than its fwd+bwd
    marked = [(r["impl"], r["mode"]) for r in rows if r["unsteady"]]
    assert marked == [("torch-math", "fwd"), ("torch-math", "fwd+bwd")]
    assert all("forward timed slower" in r["unsteady_why"] for r in rows if r["unsteady"])
    warning = loaded_warning(rows, 5)
    assert "2 of 4 timed rows are unsteady" in warning and "--repeats" in warning and "quiet machine" in warning


def test_table_shows_ranges_marks_and_a_legend():
    rows = _cell("fwd", [100.0, 104.0, 98.0], [50.0, 150.0, 60.0])
    table = format_table(rows)
    line = next(line for line in table.splitlines() if " sdpa " in line)
    assert "60 us [50-150]" in line and " ! " in line
    assert "1.63x [0.69-2.00]" in line  # per round 100/50, 104/150, 98/60: median 1.63, not 100/60 = 1.67
    assert bench_spread.LEGEND in table
    summary = markdown_summary(rows, {"repeats": 3})
    assert "sdpa 1.63x [0.69–2.00] !" in summary and "warning: 1 of 2 timed rows" in summary


def test_notes_wrap_at_word_boundaries():
    reason = " ".join(f"word{i}-with-hyphens" if i % 7 == 0 else f"reason{i}" for i in range(60))
    rows = finish_cell([{"impl": "flash", "family": "ours", "status": "unsupported", "reason": reason}], CASE,
                       "float32", "fwd")
    lines = [line for line in format_table(rows).splitlines() if "B1 H2" in line or line.startswith(" " * 40)]
    start = lines[0].index("unsupported")
    notes = [line[start:] for line in lines]
    assert len(notes) > 1 and all(len(n) <= NOTE_WIDTH for n in notes)
    assert all(line[:start].strip() == "" for line in lines[1:])  # continuation lines stay in the notes column
    assert " ".join(notes).split() == f"unsupported: {reason}".split()  # every word whole, none lost


def test_round_orders_alternate_who_runs_first():
    assert round_orders(["a", "b", "c"], 4) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]


def test_plots_have_error_bars(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxattn.bench_plots import error_bar

    rows = _cell("fwd", [100.0, 104.0, 98.0], [50.0, 150.0, 60.0])
    _, sdpa = rows
    below, above = error_bar(sdpa, "tflops")
    assert below == pytest.approx(sdpa["tflops"] * (1 - 60 / 150)) and above == pytest.approx(sdpa["tflops"] * 0.2)
    median, low, high = 98 / 60, 104 / 150, 100 / 50  # the rounds' ratios
    assert error_bar(sdpa, "vs_torch_paired") == pytest.approx((median - low, high - median))
    notes = write_outputs(rows, {"device": "cpu"}, str(tmp_path), plots=True, complete=True)
    assert (tmp_path / "tflops_vs_seqlen.png").exists() and (tmp_path / "vs_torch.png").exists()
    assert any(str(tmp_path) in n and "vs_torch.png" in n for n in notes)


def test_missing_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    notes = write_outputs(_cell("fwd", [100.0], [50.0]), {}, str(tmp_path), plots=True, complete=True)
    assert notes[-1].startswith("matplotlib is not installed: no PNG plots (the bench extra: pip install -e '.[bench]'")
    assert (tmp_path / "bench.json").exists() and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("limit,warned", [(1.0, True), (float("inf"), False)])
def test_cli_writes_to_the_default_folder_and_warns_when_loaded(tmp_path, monkeypatch, limit, warned):
    # A limit of 1 calls any two unequal repeats unsteady (a real loop never repeats to the
    # nanosecond); an infinite one calls nothing unsteady.
    monkeypatch.setattr(bench_spread, "SPREAD_LIMIT", limit)
    monkeypatch.chdir(tmp_path)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["bench", "--quick", "--device", "cpu", "--impl", "sdpa", "--impl", "torch-math",
                           "--fwd-only", "--repeats", "2", "--no-progress"])
    assert status == 0
    out = stdout.getvalue().splitlines()
    folder = tmp_path / DEFAULT_OUT
    assert (folder / "bench.json").exists()
    if _has_matplotlib():
        assert (folder / "tflops_vs_seqlen.png").exists()
        assert any(line.startswith(f"wrote plots to {folder}") for line in out)
    assert out[-1].startswith("warning: ") == warned
    if warned:
        assert "looks loaded" in out[-1] and "this run: 2" in out[-1]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_repeats_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--repeats", "0"])
    assert "--repeats '0'" in capsys.readouterr().err
    assert cli.main(["bench", "--models", "--repeats", "3"]) == 2
    assert "--repeats is not used with --models" in capsys.readouterr().err
