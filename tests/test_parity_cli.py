"""`jaxattn parity` and `jaxattn doctor` on the CPU."""

import pytest
import torch

import jaxattn.torch_api as torch_api
from jaxattn import cli, parity


@pytest.mark.thorough  # every implementation compiled on CPU; test_a_wrong_implementation_fails runs the CLI by default
def test_parity_table_on_cpu(capsys):
    status = cli.main(["parity", "--shapes", "small", "--dtypes", "bfloat16",
                       "--implementations", "vanilla", "sdpa", "decode", "flash"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "jaxattn parity on cpu" in out and "2 x torch's same-dtype error" in out
    rows = [line for line in out.splitlines() if line.startswith(("vanilla", "sdpa", "decode", "flash"))]
    assert len(rows) == 4 * len(parity.CASES["small"])
    for line in rows:
        if line.startswith(("vanilla", "sdpa")):
            assert line.rstrip().endswith("PASS"), line
    flash = [line for line in rows if line.startswith("flash")]
    assert all("n/a: " in line and "cpu" in line for line in flash)  # with the declared reason
    decode = [line for line in rows if line.startswith("decode")]
    assert sum(line.rstrip().endswith("PASS") for line in decode) == 1  # the decoding case
    assert all("q_len=" in line for line in decode if "n/a" in line)


def test_rows_hold_forward_and_gradient_reports():
    rows = parity.run_parity(["vanilla"], ["bfloat16"], "small")
    assert [r.case for r in rows] == list(parity.CASES["small"])
    for row in rows:
        assert row.status == "PASS"
        assert row.forward.dtype == "bfloat16" and row.forward.baseline_error > 0
        assert [g.name for g in row.gradients] == ["grad q", "grad k", "grad v"]
        assert all(g.passed and g.candidate_error > 0 for g in row.gradients)


def test_a_wrong_implementation_fails(monkeypatch, capsys):
    """Errors of 1% on top of a correct result break the 2x rule; the table says FAIL and exits 1."""
    real = torch_api.scaled_dot_product_attention

    def off_by_one_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr(torch_api, "scaled_dot_product_attention", off_by_one_percent)
    status = cli.main(["parity", "--shapes", "small", "--dtypes", "float32", "--implementations", "vanilla"])
    out = capsys.readouterr().out
    assert status == 1
    rows = [line for line in out.splitlines() if line.startswith("vanilla") and not line.endswith(":")]
    assert len(rows) == len(parity.CASES["small"]) and all(line.rstrip().endswith("FAIL") for line in rows)
    assert "output: FAIL" in out and "grad q: FAIL" in out  # the failing reports are printed


def test_an_implementation_that_raises_is_an_error_row(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(torch_api, "scaled_dot_product_attention", broken)
    row = parity.run_case("vanilla", "float32", parity.CASES["small"][0])
    assert row.status == "ERROR" and "kernel exploded" in row.note


def test_forward_only_and_bad_arguments():
    row = parity.run_case("sdpa", "float32", parity.CASES["small"][1], grad=False)
    assert row.status == "PASS" and row.gradients == ()
    with pytest.raises(ValueError, match="not registered"):
        parity.run_parity(["no_such_impl"], ["float32"], "small")
    with pytest.raises(ValueError, match="shapes="):
        parity.run_parity(["vanilla"], ["float32"], "huge")
    with pytest.raises(SystemExit):
        cli.main(["parity", "--dtypes", "int8"])


def test_doctor_reports_memory_settings_and_reasons(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" in out and "JAX on a GPU" in out
    assert f"torch       {torch.__version__}" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("cpu ")]
    by = {(r[1], r[2], r[3]): " ".join(r[4:]) for r in rows}  # (probe, dtype, implementation) -> status
    assert all(by[(p, d, "flash")].startswith("no: ") and "cpu" in by[(p, d, "flash")]
               for p in ("prefill", "decode") for d in ("bfloat16", "float32"))
    assert by[("prefill", "float32", "decode")].startswith("no: q_len=128")
    assert by[("decode", "float32", "decode")] == "ok" and by[("prefill", "float32", "vanilla")] == "ok"
