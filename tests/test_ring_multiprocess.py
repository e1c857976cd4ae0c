"""Ring attention across two processes on the CPU (JAX's gloo collectives), as torchrun would run it.

The test starts two `tests/ring_worker.py` processes; each passes its torch sequence shard to
`jaxattn.torch_api.ring_attention` and saves its output and gradient shards. The concatenated
shards must equal a single-process float64 reference.
"""

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from attention_reference import reference

HERE = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.thorough  # two fresh processes; the torch ring API runs in-process by default (test_ring.py)
def test_two_processes_pass_torch_shards(tmp_path):
    world, port = 2, _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TRITON_INTERPRET")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "ring_worker.py"), str(r), str(world), str(port),
                               str(tmp_path / f"rank{r}.pt")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the worker processes did not finish in 150 s")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"

    sys.path.insert(0, str(HERE))
    from ring_worker import global_inputs

    q, k, v, cot = (x.double() for x in global_inputs())
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out_ref, _ = reference(q, k, v, causal=True)
    (out_ref * cot).sum().backward()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, want in (("out", out_ref.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = torch.cat([res[name] for res in results], dim=2).double()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5, msg=f"{name} differs")
