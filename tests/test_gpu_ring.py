"""Ring attention on two CUDA GPUs: bf16 parity of outputs and gradients (JAX API, torch shards and
full tensors), with flash-attn's rule: error against a float64 reference at most twice that of plain
torch ops in bf16. Skipped without two CUDA GPUs and jax-triton."""

import importlib.util

import numpy as np
import pytest
import torch

from attention_reference import assert_dtype_rule, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None, reason="needs jax-triton"),
]


def _inputs(seed, hq=8, hk=2, length=2048, e=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(1, h, length, e, device="cuda", generator=gen)  # noqa: E731
    q, k, v, cot = make(hq), make(hk), make(hk), make(hq)
    return q, k, v, cot


def _grads(fn, q, k, v, cot):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    out = torch.cat(out, dim=2) if isinstance(out, list) else out
    (out.float() * cot.float()).sum().backward()
    return [out.detach().double()] + [leaf.grad.double() for leaf in leaves]


def _check(got, q, k, v, cot, **kw):
    """Each of out, dq, dk, dv within 2x torch's bf16 error (plus a small floor)."""
    exact = _grads(lambda *a: reference(*a, **kw)[0], q.double(), k.double(), v.double(), cot.double())
    torch_bf16 = _grads(lambda *a: reference(*a, dtype=torch.bfloat16, **kw)[0], *(x.bfloat16() for x in (q, k, v)), cot)
    for name, g, t, e in zip(("out", "dq", "dk", "dv"), got, torch_bf16, exact):
        assert_dtype_rule(name, g, e, t, floor=1e-4)


@pytest.mark.parametrize("layout,accumulation", [("zigzag", "float32"), ("striped", "float32"),
                                                 ("contiguous", "float32"), ("zigzag", "input")])
def test_jax_ring_two_gpus_bf16(layout, accumulation):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from jaxattn.jax_core import ring_attention

    q, k, v, cot = _inputs(1)
    mesh = Mesh(np.array(jax.devices("gpu")[:2]), ("sp",))
    to_j = lambda t: jnp.asarray(t.transpose(1, 2).cpu().numpy(), jnp.bfloat16)  # noqa: E731
    qj, kj, vj, cj = (to_j(x.bfloat16().float()) for x in (q, k, v, cot))

    def loss(a, b, c):
        out = ring_attention(a, b, c, mesh=mesh, causal=True, layout=layout, accumulation=accumulation)
        return jnp.sum(out.astype(jnp.float32) * cj.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(qj, kj, vj)
    back = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).transpose(1, 2).double().to(q.device)  # noqa: E731
    _check([back(out)] + [back(g) for g in grads], *(x.bfloat16().float() for x in (q, k, v, cot)), causal=True)


def test_torch_ring_shards_and_full_tensors_bf16():
    from jaxattn.torch_api import ring_attention

    q, k, v, cot = (x.bfloat16() for x in _inputs(2, hq=8, hk=8, length=1024))
    fp = [x.float() for x in (q, k, v, cot)]

    def shards(a, b, c):
        parts = [[t.chunk(2, dim=2)[i].detach().to(f"cuda:{i}").requires_grad_(True) for i in range(2)] for t in (a, b, c)]
        outs = ring_attention(*parts, is_causal=True)
        assert [o.device.index for o in outs] == [0, 1]
        # route gradients back to the leaves of `_grads`
        return _Shards.apply(a, b, c, outs, parts)

    got_full = _grads(lambda a, b, c: ring_attention(a, b, c, is_causal=True, mesh=["cuda:0", "cuda:1"]), q, k, v, cot)
    _check(got_full, *fp, causal=True)
    got_shards = _grads(shards, q, k, v, cot)
    _check(got_shards, *fp, causal=True)


class _Shards(torch.autograd.Function):
    """Concatenates per-GPU output shards on cuda:0 and sends the gradient through the shard op."""

    @staticmethod
    def forward(ctx, a, b, c, outs, parts):
        ctx.outs, ctx.parts = outs, parts
        return torch.cat([o.detach().to("cuda:0") for o in outs], dim=2)

    @staticmethod
    def backward(ctx, grad):
        pieces = grad.chunk(2, dim=2)
        torch.autograd.backward(ctx.outs, [p.to(o.device) for p, o in zip(pieces, ctx.outs)])
        grads = [torch.cat([s.grad.to("cuda:0") for s in group], dim=2) for group in ctx.parts]
        return (*grads, None, None)
