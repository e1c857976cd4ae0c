"""One rank of the two-process ring attention test (launched by tests/test_ring_multiprocess.py).

    python ring_worker.py RANK WORLD_SIZE PORT OUT_FILE

Sets torchrun's environment variables, starts JAX's multi-process runtime on the CPU (gloo
collectives), builds the same random global tensors as every rank, passes its own sequence shard
to `jaxattn.torch_api.ring_attention`, runs the backward with its shard of the cotangent, and saves
its output and gradient shards.
"""

import os
import sys

import torch


def global_inputs():
    """The same random global (B, H, L, E) q, k, v and output cotangent in every process."""
    gen = torch.Generator().manual_seed(1234)
    b, hq, hk, length, e = 1, 4, 2, 48, 16
    q = torch.randn(b, hq, length, e, generator=gen)
    k = torch.randn(b, hk, length, e, generator=gen)
    v = torch.randn(b, hk, length, e, generator=gen)
    cot = torch.randn(b, hq, length, e, generator=gen)
    return q, k, v, cot


def main(rank: int, world: int, port: str, out_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(int(port) - 1))
    os.environ.pop("XLA_FLAGS", None)  # one CPU device per process

    from jaxattn.bridge import initialize_from_torchrun

    settings = initialize_from_torchrun(platform="cpu")
    assert settings["coordinator_address"] == f"127.0.0.1:{port}"
    from jaxattn.torch_api import ring_attention

    q, k, v, cot = global_inputs()
    shard = lambda x: x.chunk(world, dim=2)[rank].clone()  # noqa: E731  (rank r: positions [r L/n, (r+1) L/n))
    qs, ks, vs = (shard(x).requires_grad_(True) for x in (q, k, v))
    out = ring_attention(qs, ks, vs, is_causal=True)
    (out * shard(cot)).sum().backward()
    torch.save({"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}, out_file)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
