"""Parametrisation grids that keep a representative subset in the default run: every combination
is a case, and those not kept are marked `thorough` (skipped unless `pytest --thorough`; see
tests/conftest.py). Test ids are those of the full grid, so a case keeps its id in both runs."""

import itertools

import pytest


def grid(*axes, keep):
    """The cases of `itertools.product(*axes)` (of `axes[0]` alone when there is one axis), in that
    order; those not in `keep` are marked thorough."""
    cases = list(itertools.product(*axes)) if len(axes) > 1 else list(axes[0])
    unknown = [k for k in keep if k not in cases]
    assert not unknown, f"kept cases that are not in the grid: {unknown}"
    return [c if c in keep else pytest.param(*(c if len(axes) > 1 else (c,)), marks=pytest.mark.thorough)
            for c in cases]
