"""The Hopper kernels' timeline (`jax_core/kernels/mgpu_timeline.py`): the profiler switch and the trace
summary, on a CPU (the profiler itself runs on a GPU: `benchmarks/hopper_timeline_gpu.py`)."""

import os

import pytest

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

from jaxattn.jax_core.kernels.mgpu_timeline import compiler_params, recorded, summarise  # noqa: E402


def _track(tid, start_ns, records):
    """Chrome-trace events of one warpgroup: records are (name, "B" or "E", cycles since its first)."""
    return [dict(name=name, ph=ph, ts=(start_ns + cycles) / 1e3, pid=1, tid=tid) for name, ph, cycles in records]


def _trace(programs, warpgroups, clock_ghz):
    """Program p starts at 1000 * p ns; its warpgroup w records, at cycle offsets scaled by (1 + p + w):
    load [0, 100), walk [100, 350) with a nested wait [150, 200), load again [350, 400)."""
    events = []
    for p in range(programs):
        for w in range(warpgroups):
            f = 1 + p + w
            records = [("load", "B", 0), ("load", "E", 100 * f), ("walk", "B", 100 * f), ("wait", "B", 150 * f),
                       ("wait", "E", 200 * f), ("walk", "E", 350 * f), ("load", "B", 350 * f), ("load", "E", 400 * f)]
            events += _track(1 + w + warpgroups * p, 1000 * p, records)
    return dict(traceEvents=events)


def test_summary_counts_outermost_steps_per_warpgroup_and_program_ends():
    summary = summarise(_trace(programs=2, warpgroups=3, clock_ghz=2.0), warpgroups=3, clock_ghz=2.0)
    for w, part in enumerate(summary["warpgroups"]):
        mean_factor = ((1 + w) + (2 + w)) / 2  # programs 0 and 1
        assert part["span"] == pytest.approx(400 * mean_factor)
        assert part["steps"] == pytest.approx({"load": 150 * mean_factor, "walk": 250 * mean_factor})
        assert list(part["steps"]) == ["walk", "load"]  # the largest first; the nested wait is the walk's
        assert part["other"] == pytest.approx(0.0)
    # Program p ends at 1000 p ns + its slowest warpgroup's 400 (3 + p) cycles at 2 GHz.
    assert summary["ends_us"] == pytest.approx([(0 + 400 * 3 / 2) / 1e3, (1000 + 400 * 4 / 2) / 1e3])


def test_summary_reports_what_no_step_covers():
    events = _track(1, 0, [("a", "B", 0), ("a", "E", 10), ("b", "B", 40), ("b", "E", 50)])
    summary = summarise(dict(traceEvents=events), warpgroups=1, clock_ghz=1.0)
    assert summary["warpgroups"][0]["span"] == pytest.approx(50)
    assert summary["warpgroups"][0]["other"] == pytest.approx(30)


def test_compiler_params_record_only_inside_and_only_for_the_gpu(tmp_path):
    assert compiler_params(interpret=None, approx_math=True).profile_space == 0
    with recorded(str(tmp_path), 64):
        params = compiler_params(interpret=None, approx_math=True)
        assert (params.profile_space, params.profile_dir, params.approx_math) == (64, str(tmp_path), True)
        assert compiler_params(interpret=object(), approx_math=True).profile_space == 0
    assert compiler_params(interpret=None).profile_space == 0


@pytest.mark.parametrize("steps, match", [(0, "steps=0"), (True, "steps=True"), (2.5, "steps=2.5")])
def test_recorded_rejects_bad_steps(tmp_path, steps, match):
    with pytest.raises(ValueError, match=match):
        with recorded(str(tmp_path), steps):
            pass


def test_recorded_rejects_a_missing_directory(tmp_path):
    missing = os.path.join(str(tmp_path), "nowhere")
    with pytest.raises(ValueError, match="directory=.*nowhere.*makedirs"):
        with recorded(missing, 8):
            pass
