"""The Hopper (Pallas Mosaic GPU) flash kernels behind the torch drop-in: which calls take them, and
their outputs and gradients against torch's math on float32 copies (the 2x same-dtype rule).

The choice (`hopper_reasons`) is checked everywhere; the kernels run only on an sm90 GPU.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from jaxattn.jax_core.kernels.flash_plan import FlashConfig  # noqa: E402
from jaxattn.torch_api import hopper_flash, native_flash, scaled_dot_product_attention, sdpa_launcher  # noqa: E402


def _hopper_gpu() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return not hopper_flash.mosaic_reasons(torch.device("cuda"))


def test_reasons_name_what_keeps_a_call_off_the_hopper_kernels():
    cfg = FlashConfig(scale=0.1, causal=True)
    meta = dict(device="meta")
    q = torch.empty(1, 16, 8192, 128, dtype=torch.bfloat16, **meta)
    k = torch.empty(1, 4, 8192, 128, dtype=torch.bfloat16, **meta)
    cases = [
        ((q.float(), k.float(), k.float(), cfg), "dtype torch.float32"),
        ((q[..., :64], k[..., :64], k[..., :64], cfg), "head dims 64/64"),
        ((q, k, k, FlashConfig(scale=0.1, causal=True, window=(128, 0))), "window, soft cap"),
        ((q[:, :, :2000], k, k, cfg), "lengths L=2000, S=8192"),
        ((q[:1, :, :4096], k[:1, :, :4096], k[:1, :, :4096], cfg), "lengths L=4096, S=4096 below 8192 with gradients"),
        ((q, k, k, cfg), "Mosaic GPU kernels run on CUDA devices (device meta)"),
    ]
    for args, want in cases:
        reasons = hopper_flash.hopper_reasons(*args, grad=True)
        assert any(want in r for r in reasons), (want, reasons)


def test_deterministic_mode_keeps_calls_off_the_hopper_kernels():
    q = torch.empty(1, 16, 8192, 128, dtype=torch.bfloat16, device="meta")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        reasons = hopper_flash.hopper_reasons(q, q, q, FlashConfig(scale=0.1), grad=False)
    finally:
        torch.use_deterministic_algorithms(before)
    assert any("deterministic" in r for r in reasons)


def _math(q, k, v, causal, dtype, gqa):
    """torch's math SDPA in `dtype`, with its gradients of sum(out * cot)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    return out, leaves


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, hq, hk, l, s, causal, memory", [
    (2, 16, 16, 4096, 4096, True, "BHLD"),  # (B, H, L, D) memory: passed folded, no copy
    (2, 16, 16, 4096, 4096, True, "BLHD"),  # (B, L, H, D) memory seen transposed: passed as is
    (4, 16, 4, 2048, 4096, True, "BHLD"),   # GQA (copied to (B, L, H, D)), L < S: causal top-left
    (2, 16, 2, 4096, 4096, False, "BLHD"),
])
def test_drop_in_runs_the_hopper_kernels(monkeypatch, dtype, b, hq, hk, l, s, causal, memory):
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 2048)  # shorter shapes, the same kernels
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 2048)
    taken = []
    real = native_flash.hopper_flash
    monkeypatch.setattr(native_flash, "hopper_flash", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    def tensor(h, t):
        if memory == "BHLD":
            return torch.randn(b, h, t, 128, generator=gen, device="cuda")
        return torch.randn(b, t, h, 128, generator=gen, device="cuda").transpose(1, 2)
    q, k, v = tensor(hq, l), tensor(hk, s), tensor(hk, s)
    cot = torch.randn(b, hq, l, 128, generator=gen, device="cuda")
    gqa = hq != hk
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]  # .to keeps the memory layout
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    grads = torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)
    assert taken, "the call did not take the Hopper kernels"
    want, want_leaves = _math(q, k, v, causal, torch.float32, gqa)
    want_grads = torch.autograd.grad((want * cot).sum(), want_leaves)
    low, low_leaves = _math(q, k, v, causal, dtype, gqa)
    low_grads = torch.autograd.grad((low * cot.to(dtype)).sum(), low_leaves)
    for name, got, ref, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads), (low, *low_grads)):
        err = (got.float() - ref).abs().max().item()
        torch_err = (theirs.float() - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-3 * max(1.0, ref.abs().max().item()), (name, err, torch_err)
        assert math.isfinite(err)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
def test_kernels_run_on_the_current_stream():
    """Inputs made on a side stream and used at once: a launch on another stream would race them."""
    cfg = FlashConfig(scale=128 ** -0.5, causal=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy, so a race would read unwritten inputs
        q, k, v = (torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, _ = hopper_flash.hopper_forward(q, k, v, cfg)
    side.synchronize()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - want).abs().max().item() < 3e-2
