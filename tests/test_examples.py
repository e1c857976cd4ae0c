"""The examples run on the CPU at small sizes; each checks itself against torch and returns 0 on success.

(examples/generate_tiny.py is run by test_decode.py, examples/ring_simulated.py by the ring tests.)
"""

import importlib
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _example(name: str):
    sys.path.insert(0, EXAMPLES)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_quickstart(capsys):
    assert _example("quickstart").main(["--device", "cpu", "--seq", "61"]) == 0
    out = capsys.readouterr().out
    assert out.count(": PASS") == 7 and "all match torch" in out


def test_train_nanogpt_loss_decreases_like_torch(capsys):
    argv = ["--device", "cpu", "--steps", "12", "--batch", "8", "--block", "32", "--dim", "32"]
    assert _example("train_nanogpt").main(argv) == 0
    out = capsys.readouterr().out
    assert "(decreasing)" in out and "(agree)" in out


def test_hf_generate_through_the_plugin(capsys):
    pytest.importorskip("transformers")
    assert _example("hf_generate").main(["--device", "cpu", "--new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "static cache: 5 new tokens" in out and "tokens match transformers' sdpa" in out
    assert len([line for line in out.splitlines() if line.startswith("prompt ")]) == 3


def test_mixed_pipeline_gradients_end_to_end(capsys):
    assert _example("mixed_pipeline").main(["--device", "cpu", "--steps", "10", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "match the torch twin" in out and "loss decreasing" in out
    assert "grad embed.weight: PASS" in out and "grad queries: PASS" in out
