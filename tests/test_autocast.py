"""torch's autocast policy for SDPA, followed by the drop-in, `flash_attention`, `patch_sdpa` and the
transformers plug-in; the oracle is torch's own SDPA under the same autocast (CPU here; the GPU
machine runs the CUDA case)."""

import pytest
import torch
import torch.nn.functional as F

from attention_reference import assert_dtype_rule

from jaxattn.torch_api import flash_attention, patch_sdpa, scaled_dot_product_attention

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _qkv(device, l=13, s=21, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).to(device)  # noqa: E731
    return make(2, 4, l, 16), make(2, 2, s, 16), make(2, 2, s, 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_drop_in_follows_torch_autocast(device, amp, mask):
    if device == "cpu" and amp == torch.float16:
        pytest.importorskip("torch", minversion="2.5")  # fp16 CPU autocast
    q, k, v = _qkv(device)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 13, 21, device=device) > 0.3
    elif mask == "float":
        m = torch.randn(2, 1, 13, 21, device=device)  # float32: autocast casts it too
    ref32 = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    with torch.autocast(device, dtype=amp):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        out = scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    assert out.dtype == ref.dtype == amp
    assert_dtype_rule("out", out, ref32, ref, floor=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_and_gradients_under_autocast(device):
    q, k, v = (t.double().requires_grad_(True) for t in _qkv(device, dtype=torch.float64))
    with torch.autocast(device, dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.dtype == ref.dtype == torch.float64  # autocast leaves float64 alone
    q32 = torch.randn(1, 2, 5, 8, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = scaled_dot_product_attention(q32, q32, q32)
    y.float().sum().backward()
    assert q32.grad.dtype == torch.float32 and torch.isfinite(q32.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_under_autocast(device):
    q, k, v = _qkv(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = flash_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    ref32 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_dtype_rule("out", out, ref32, ref, floor=1e-3)


def test_multihead_attention_with_padding_mask_under_autocast_and_patch(monkeypatch):
    """nn.MultiheadAttention (training mode: its functional path) merges a key_padding_mask into a
    float32 mask; with bf16 q under autocast that mixed call must be reconciled as torch does."""
    from jaxattn.torch_api import sdpa as sdpa_module

    reached = []
    prepared_call = sdpa_module._PreparedSdpa.__call__
    monkeypatch.setattr(sdpa_module._PreparedSdpa, "__call__",
                        lambda self, *a, **kw: reached.append(1) or prepared_call(self, *a, **kw))
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 9, 32)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
        with patch_sdpa():
            out, _ = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    assert reached and out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
