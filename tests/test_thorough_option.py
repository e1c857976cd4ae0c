"""The `--thorough` option of tests/conftest.py: a test or parametrisation marked thorough is skipped
by default with a reason saying how to run it, and runs under `--thorough`; `-m thorough` then
selects only those. The scratch project uses a copy of the real conftest.py, so this checks the
suite's own option, not a re-implementation."""

import pathlib

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py").read_text()

SCRATCH_TESTS = """
import pytest

@pytest.mark.thorough
def test_long():
    pass

@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.thorough)])
def test_grid(n):
    pass

def test_quick():
    pass
"""


@pytest.fixture
def scratch(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    thorough: long\n")
    pytester.makepyfile(test_scratch=SCRATCH_TESTS)
    return pytester


def test_default_run_skips_thorough_tests_saying_how_to_run_them(scratch):
    result = scratch.runpytest("-rs")
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED*run with --thorough*"])
    assert "test_grid[1] PASSED" in scratch.runpytest("-v").stdout.str()


def test_thorough_runs_everything(scratch):
    scratch.runpytest("--thorough").assert_outcomes(passed=4)


def test_thorough_with_marker_selection_runs_only_the_thorough_ones(scratch):
    result = scratch.runpytest("--thorough", "-m", "thorough", "-v")
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(["*test_long PASSED*", "*test_grid?2? PASSED*"])
