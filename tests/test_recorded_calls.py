"""Calls that are recorded rather than run: under FakeTensorMode (shape propagation, torch.export's
tracer) a call answers its output's shape, dtype and device without reading values; under
torch.jit.trace the trace holds jaxattn's custom op, so the traced function computes torch's result
for new values (nothing baked in), on the XLA path and on the native launcher."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from jaxattn.bridge.triton_launch import can_launch
from jaxattn.torch_api import flash_attention, scaled_dot_product_attention, sdpa_launcher

LAUNCHERS = ["xla", pytest.param("native", marks=pytest.mark.skipif(
    not can_launch(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 on CPU"))]


def _qkv(gen, b=2, hq=4, hk=2, l=9, s=13, d=16):
    return (torch.randn(b, hq, l, d, generator=gen), torch.randn(b, hk, s, d, generator=gen),
            torch.randn(b, hk, s, d, generator=gen))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_fake_tensor_mode_answers_shapes(launcher):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen)
    mask = torch.rand(2, 1, 9, 13, generator=gen) > 0.3
    with FakeTensorMode() as mode, sdpa_launcher(launcher):
        fq, fk, fv, fmask = (mode.from_tensor(t) for t in (q, k, v, mask))
        out = scaled_dot_product_attention(fq, fk, fv, is_causal=True, enable_gqa=True)
        masked = scaled_dot_product_attention(fq, fk, fv, attn_mask=fmask, enable_gqa=True)
        flash, lse = flash_attention(fq, fk, fv, causal=True, return_lse=True)
    for t, shape in ((out, (2, 4, 9, 16)), (masked, (2, 4, 9, 16)), (flash, (2, 4, 9, 16)), (lse, (2, 4, 9))):
        assert isinstance(t, FakeTensor) and tuple(t.shape) == shape
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_jit_trace_records_the_op_not_the_values(launcher):
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen)
    with sdpa_launcher(launcher):
        traced = torch.jit.trace(lambda a, b, c: scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                             enable_gqa=True), (q, k, v))
        fresh = _qkv(gen)
        got = traced(*fresh)
    want = F.scaled_dot_product_attention(*(t.double() for t in fresh), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    assert "jaxattn" in str(traced.graph), "the trace does not hold jaxattn's op"
