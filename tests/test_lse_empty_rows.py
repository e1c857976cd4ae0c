"""One LSE convention for a query row that sees no key: -inf (the log of an empty sum), output 0.

flash-attn returns +inf there; jaxattn keeps -inf on every path that returns an LSE, so that merging
partial results by log-sum-exp (ring attention, split-K decoding) gives an empty part zero weight
without special cases. Paths: `flash_attention` on the native launcher and the XLA bridge (rows
hidden by causality, varlen padding rows), jax_core's flash (jax-triton) and vanilla, the decode
kernels (native and XLA) and ring attention.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import assert_close_finite, reference  # noqa: E402

from jaxattn.bridge.triton_launch import can_launch  # noqa: E402
from jaxattn.jax_core import AttentionMetadata, attention  # noqa: E402
from jaxattn.torch_api import decode_attention, flash_attention, ring_attention, sdpa_launcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels
pytestmark = pytest.mark.skipif(not can_launch(torch.device(DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1")
# compiled kernels (on CUDA) run float32 dots as tf32x3; the interpreter multiplies exactly
TOL = 2e-4 if DEVICE == "cuda" else 3e-5


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _assert_empty_rows(name, out, lse, empty):
    """Rows `empty` (bool over lse's shape): LSE exactly -inf and output 0; the others finite."""
    out, lse = out.detach().double().cpu(), lse.detach().double().cpu()
    assert torch.isneginf(lse[empty]).all(), f"{name}: LSE of empty rows {lse[empty].unique().tolist()}, expected -inf"
    assert torch.isfinite(lse[~empty]).all(), f"{name}: a row that sees keys has a non-finite LSE"
    assert (out.movedim(-1, 0)[:, empty] == 0).all(), f"{name}: empty rows have a nonzero output"


# L=9 queries against S=5 keys, causal aligned bottom-right: query i sees keys j <= i - 4, so rows
# 0..3 see nothing.
B, H, L, S, D = 2, 2, 9, 5, 16
EMPTY = torch.arange(L) < 4


def _qkv(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, t, D, generator=gen) for t in (L, S, S)]


@pytest.mark.parametrize("launcher", ["native", "xla"])
def test_flash_attention_rows_hidden_by_causality(launcher):
    q, k, v = _qkv(1)
    with sdpa_launcher(launcher):
        out, lse = flash_attention(*(x.to(DEVICE) for x in (q, k, v)), causal=True, causal_alignment="bottom_right",
                                   return_lse=True)
    _assert_empty_rows(launcher, out, lse, EMPTY.expand(B, H, L))
    ref, ref_lse = reference(q, k, v, causal=True, alignment="bottom_right")
    assert_close_finite("lse", lse.double().cpu(), ref_lse, TOL)


@pytest.mark.parametrize("launcher", ["native", "xla"])
def test_flash_attention_varlen_padding_rows(launcher):
    """Packed rows after cu_seqlens_q[-1] belong to no sequence."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(12, H, D, generator=gen, device="cpu").to(DEVICE)
    k = v = torch.randn(10, H, D, generator=gen, device="cpu").to(DEVICE)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6, 10], dtype=torch.int32, device=DEVICE)
    with sdpa_launcher(launcher):
        out, lse = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    empty = (torch.arange(12) >= 9).expand(H, 12)  # lse is (Hq, total_q)
    _assert_empty_rows(launcher, out.transpose(0, 1), lse, empty)


@pytest.mark.parametrize("implementation", ["flash", "vanilla"])
def test_jax_core_rows_hidden_by_causality(implementation):
    q, k, v = (jnp.asarray(x.transpose(1, 2).numpy()) for x in _qkv(3))
    md = AttentionMetadata(platform="gpu", backend="rocm") if implementation == "flash" and not ON_GPU else None
    res = attention(q, k, v, causal=True, causal_alignment="bottom_right", return_lse=True,
                    implementation=implementation, metadata=md)
    out = torch.from_numpy(np.array(res.attention_outputs)).transpose(1, 2)
    _assert_empty_rows(implementation, out, torch.from_numpy(np.array(res.lse)), EMPTY.expand(B, H, L))


@pytest.mark.parametrize("launcher", ["native", "xla"])
def test_decode_query_of_an_empty_cache(launcher):
    """Batch row 1 has an empty cache (length 0): its queries see nothing."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, D, generator=gen).to(DEVICE)
    kc, vc = (torch.randn(2, 16, 2, D, generator=gen).to(DEVICE) for _ in "kv")
    lengths = torch.tensor([7, 0], dtype=torch.int32, device=DEVICE)
    with sdpa_launcher(launcher):
        out, lse = decode_attention(q, kc, vc, lengths, return_lse=True,
                                    kernel="xla" if launcher == "xla" else None)
    empty = torch.zeros(2, 4, 1, dtype=torch.bool)
    empty[1] = True
    _assert_empty_rows(launcher, out, lse, empty)


@pytest.mark.skipif(len(jax.devices("cpu")) < 2, reason="needs 2 JAX CPU devices (XLA_FLAGS="
                    "--xla_force_host_platform_device_count, set by conftest where JAX runs on CPU)")
def test_ring_attention_query_without_a_key_of_its_segment():
    """Query 3's segment id has no key: its row is empty on whichever device holds it."""
    gen = torch.Generator().manual_seed(5)
    n = 8
    q, k, v = (torch.randn(1, H, n, D, generator=gen) for _ in "qkv")
    q_ids = torch.zeros(1, n, dtype=torch.int32)
    q_ids[0, 3] = 7
    kv_ids = torch.zeros(1, n, dtype=torch.int32)
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("sp",))
    out, lse = ring_attention(q, k, v, mesh=mesh, segment_ids=(q_ids, kv_ids), return_lse=True)
    empty = torch.zeros(1, H, n, dtype=torch.bool)
    empty[..., 3] = True
    _assert_empty_rows("ring", out, lse, empty)
