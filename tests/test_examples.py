"""The examples run on the CPU at small sizes; each checks itself against torch and returns 0 on success.
Their command lines answer `--help` without importing torch, and refuse a device this machine lacks
with one line.

(examples/generate_tiny.py is run by test_decode.py, examples/ring_simulated.py by the ring tests.)
"""

import importlib
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
SCRIPTS = ("quickstart", "train_nanogpt", "hf_generate", "mixed_pipeline", "generate_tiny", "ring_simulated")
WITH_DEVICE = SCRIPTS[:-1]  # ring_simulated runs on simulated CPU devices and has no --device
#: Imports that take seconds (or start a framework): none may happen before the options are parsed.
HEAVY = ("torch", "jax", "jaxlib", "jaxattn", "numpy", "transformers", "triton")


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


def _imported_modules(script: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Runs `python -X importtime examples/<script>.py args` and returns it with the modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", os.path.join(EXAMPLES, f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=120)
    # importtime writes "import time: <self us> | <cumulative us> | <indented module name>" to stderr
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_without_importing_torch_or_jax(script):
    proc, modules = _imported_modules(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "--help" in proc.stdout
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"examples/{script}.py --help imported {heavy[:8]}: parse the options before these imports"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_a_help_text(script):
    actions = [a for a in _example(script).build_parser()._actions if a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.option_strings for a in actions if not a.help]


@pytest.mark.parametrize("script", WITH_DEVICE)
def test_unavailable_device_is_refused_with_one_line(script, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    module = _example(script)
    with pytest.raises(SystemExit) as info:
        module.main(["--device", "cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: --device cuda: " in err[-1] and "use --device cpu" in err[-1], err
    assert all(line.startswith(("usage:", " ")) for line in err[:-1]), err  # argparse's usage, then that line


def test_unavailable_device_from_the_command_line_is_one_line_not_a_traceback():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "quickstart.py"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("quickstart.py: error: --device cuda: "), proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--device", "gpu"], "argument --device: 'gpu': expected auto, cpu, cuda or cuda:N"),
    (["--seq", "0"], "argument --seq: '0': expected a positive integer"),
])
def test_bad_options_name_the_option_and_what_it_expects(argv, message):
    proc, modules = _imported_modules("quickstart", *argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "torch" not in modules
