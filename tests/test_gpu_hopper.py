"""The Hopper (Pallas Mosaic GPU) flash kernels behind the torch drop-in: which calls take them, and
their outputs and gradients against torch's math on float32 copies or the float64 reference (the 2x
same-dtype rule).

The choice (`hopper_reasons`) is checked everywhere, and so is the torch side of the launch (padding
to whole tiles, the true key count, LSE and delta of padded rows, folded and transposed views) with
the kernels interpreted on the CPU; the kernels themselves run only on an sm90 GPU.
"""

import math

import pytest

torch = pytest.importorskip("torch")

from attention_reference import assert_dtype_rule, reference, reference_grads  # noqa: E402

from jaxattn.jax_core import calls  # noqa: E402
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
        ((q.float(), k.float(), k.float(), cfg), "dtype float32"),
        ((q[..., :80], k[..., :80], k[..., :80], cfg), "head dims 80/80"),
        ((q, k, k, FlashConfig(scale=0.1, causal=True, dropout_p=0.1)), "dropout or varlen"),
        ((q, k, k, FlashConfig(scale=0.1, varlen=(8192, 8192))), "dropout or varlen"),
        ((q[:, :, :2000], k, k, cfg), "lengths L=2000, S=8192 below 4096 with gradients"),
        ((q[:1, :, :2048], k[:1, :, :2048], k[:1, :, :2048], cfg), "lengths L=2048, S=2048 below 4096 with gradients"),
        ((q, k, k, cfg), "Mosaic GPU kernels run on CUDA devices (device meta)"),
    ]
    for args, want in cases:
        reasons = hopper_flash.hopper_reasons(*args, grad=True)
        assert any(want in r for r in reasons), (want, reasons)
    # Head dim 64 runs both kernels; 80 neither.
    device_only = ["Mosaic GPU kernels run on CUDA devices (device meta)"]
    for grad in (False, True):
        assert hopper_flash.hopper_reasons(q[..., :64], k[..., :64], k[..., :64], cfg, grad=grad) == device_only
    assert any("head dims 80/80" in r for r in hopper_flash.hopper_reasons(q[..., :80], k[..., :80], k[..., :80], cfg,
                                                                               grad=False))


def test_windows_soft_caps_and_any_lengths_take_the_hopper_kernels():
    """Sliding windows, a soft cap and lengths that are not whole tiles are no reason to leave the
    Hopper kernels: on the meta device the only reason left is the device."""
    q = torch.empty(1, 16, 8197, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4, 8193, 128, dtype=torch.bfloat16, device="meta")
    for cfg in (FlashConfig(scale=0.1, causal=True, window=(1024, 0), diag_offset=-4),
                FlashConfig(scale=0.1, window=(100, 300), softcap=30.0), FlashConfig(scale=0.1, softcap=5.0)):
        assert hopper_flash.hopper_reasons(q, k, k, cfg, grad=True) == [
            "Mosaic GPU kernels run on CUDA devices (device meta)"]


@pytest.mark.parametrize("b, hq, hk, l, s, kw, memory", [
    # edge lengths, folded (B, H, T, D) memory, bottom-right causal window with a soft cap
    pytest.param(1, 2, 2, 130, 200, dict(causal=True, window=(40, 0), softcap=5.0, bottom_right=True), "BHLD",
                 id="edge-folded-window-softcap-br"),
    # GQA (folded, `batch_group`), two-sided window, L > S: rows that see no key
    pytest.param(1, 4, 2, 200, 97, dict(window=(10, 20), bottom_right=True), "BHLD", id="edge-gqa-window-empty-rows"),
    # whole tiles in (B, L, H, D) memory: passed as is
    pytest.param(1, 2, 2, 128, 256, dict(causal=True), "BLHD", id="whole-tiles-transposed"),
    # whole tiles folded, dO in (B, L, H, D) memory: copied into out's layout, q, k, v stay in place
    pytest.param(2, 2, 2, 128, 128, dict(causal=True, dout="BLHD"), "BHLD", id="whole-tiles-folded-dout-transposed"),
    # head dim 64: the forward's 256-key tiles (S=300 pads to 512 there, to 384 in the backward)
    pytest.param(1, 4, 2, 130, 300, dict(causal=True, d=64), "BHLD", id="d64-edge-gqa"),
    # sinks, one per query head: folded (B, H, T, D) memory takes one per (batch, head); -inf and large sinks
    pytest.param(2, 4, 4, 128, 256, dict(causal=True, sinks=True), "BHLD", id="sinks-folded"),
    pytest.param(1, 4, 2, 130, 200, dict(window=(30, 10), sinks=True), "BLHD", id="sinks-gqa-window-empty-rows"),
])
def test_torch_launch_against_float64_oracle_interpreted(monkeypatch, b, hq, hk, l, s, kw, memory):
    """`hopper_forward` / `hopper_backward` with the kernels interpreted on the CPU: padding to whole
    tiles (zero rows, the true key count, LSE +inf and delta 0 on padded rows), the folded and
    transposed views and the slices back give the float64 oracle's out, dq, dk, dv (2x rule)."""
    pytest.importorskip("jax")
    from mosaic_gpu_mode import MODE
    if MODE != "interpret":
        pytest.skip("runs the kernels in Mosaic GPU's interpret mode (a CPU backend)")
    from hopper_interpreted import use_interpreted_kernels
    use_interpreted_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    d, dtype = kw.get("d", 128), torch.float16

    def tensor(h, t, memory=memory):
        x = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
        return x if memory == "BHLD" else x.transpose(1, 2).contiguous().transpose(1, 2)
    q, k, v, do = tensor(hq, l), tensor(hk, s), tensor(hk, s), tensor(hq, l, kw.get("dout", memory))
    scale = 0.8 / d ** 0.5
    window, softcap = kw.get("window"), kw.get("softcap")
    offset = s - l if kw.get("bottom_right") else 0
    cfg = FlashConfig(scale=scale, causal=kw.get("causal", False), diag_offset=offset,
                      window=window or (-1, -1), softcap=softcap)
    q16, k16, v16, do16 = (x.to(dtype) for x in (q, k, v, do))  # .to keeps the memory layout
    sinks = None
    if kw.get("sinks"):
        sinks = torch.randn(hq, generator=gen, dtype=torch.float32) * 2
        sinks[0], sinks[-1] = -math.inf, 8.0  # a sink that adds nothing, one that takes most of the weight
    out, lse = hopper_flash.hopper_forward(q16, k16, v16, cfg, sinks)
    *grads, dsinks = hopper_flash.hopper_backward(q16, k16, v16, out, lse, do16, cfg, sinks)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert (dsinks is None) == (sinks is None)

    rkw = dict(causal=cfg.causal, alignment="bottom_right" if kw.get("bottom_right") else "top_left", window=window,
               softcap=softcap, scale=scale)
    exact = [x.double() for x in (q16, k16, v16, do16)]
    want, want_lse, (dq, dk, dv, _, want_dsinks) = reference_grads(*exact[:3], exact[3], sinks=sinks, **rkw)
    leaves = [x.to(dtype).requires_grad_(True) for x in exact[:3]]
    low, _ = reference(*leaves, sinks=sinks, dtype=dtype, **rkw)
    low_grads = torch.autograd.grad((low * do16).sum(), leaves)
    if sinks is not None:  # d sinks in float32 against float64: the sum of a row vector's products
        finite = torch.isfinite(sinks)
        assert dsinks[~finite].eq(0).all()
        assert torch.allclose(dsinks[finite].double(), want_dsinks[finite], rtol=2e-2, atol=2e-2), (dsinks, want_dsinks)
    assert_dtype_rule("out", out.double(), want, low.double(), floor=1e-3)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - want_lse[finite]).abs().max() < 1e-3
    for name, got, ref, theirs in zip(("dq", "dk", "dv"), grads, (dq, dk, dv), low_grads):
        assert_dtype_rule(name, got.double(), ref, theirs.double(), floor=4e-3)


def test_kernel_views_copy_only_partial_tiles():
    """Whole tiles pass as views of the inputs' memory (folded (B, H, T, D), GQA included, or (B, L,
    H, D) seen transposed); a length short of a tile takes one copy, zero past the true rows, and the
    results come back as views of the true rows."""
    x = torch.randn(2, 3, 256, 8)
    (view,), folded = hopper_flash._kernel_views((x,), (256,))
    assert folded and view.data_ptr() == x.data_ptr() and view.shape == (6, 256, 1, 8)
    blhd = torch.randn(2, 256, 3, 8).transpose(1, 2)
    (view,), folded = hopper_flash._kernel_views((blhd,), (256,))
    assert not folded and view.data_ptr() == blhd.data_ptr() and view.shape == (2, 256, 3, 8)
    short = torch.randn(2, 3, 97, 8)
    (padded,), folded = hopper_flash._kernel_views((short,), (128,))
    assert folded and padded.shape == (6, 128, 1, 8)
    back = hopper_flash._torch_view(padded, short, folded)
    assert torch.equal(back, short) and padded.view(2, 3, 128, 8)[:, :, 97:].eq(0).all()
    # GQA in contiguous (B, H, T, D) memory folds too (the kernels map the batches: `batch_group`)
    (padded, kv), folded = hopper_flash._kernel_views((short, torch.randn(2, 1, 97, 8)), (128, 128))
    assert folded and padded.shape == (6, 128, 1, 8) and kv.shape == (2, 128, 1, 8)
    # memory neither contiguous nor (B, L, H, D) seen transposed: one copy to (B, T', H, D)
    odd = torch.randn(2, 97, 8, 3).permute(0, 3, 1, 2)
    (padded,), folded = hopper_flash._kernel_views((odd,), (128,))
    assert not folded and padded.shape == (2, 128, 3, 8) and padded[:, 97:].eq(0).all()
    assert torch.equal(hopper_flash._torch_view(padded, odd, folded), odd)


def _math(q, k, v, causal, dtype, gqa):
    """torch's math SDPA in `dtype`, with its gradients of sum(out * cot)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    return out, leaves


def _count_hopper_calls(monkeypatch) -> list:
    """A list that gets one entry per call the native launcher hands to the Hopper kernels."""
    taken = []
    real = native_flash.hopper_flash
    monkeypatch.setattr(native_flash, "hopper_flash", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    return taken


def _cuda_tensor(gen, b, h, t, d, memory):
    """A (B, H, T, D) float32 CUDA tensor in (B, H, T, D) memory ("BHLD") or (B, T, H, D) memory seen
    transposed ("BLHD")."""
    if memory == "BHLD":
        return torch.randn(b, h, t, d, generator=gen, device="cuda")
    return torch.randn(b, t, h, d, generator=gen, device="cuda").transpose(1, 2)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, hq, hk, l, s, causal, memory", [
    (2, 16, 16, 4096, 4096, True, "BHLD"),  # (B, H, L, D) memory: passed folded, no copy
    (2, 16, 16, 4096, 4096, True, "BLHD"),  # (B, L, H, D) memory seen transposed: passed as is
    (4, 16, 4, 2048, 4096, True, "BHLD"),   # GQA folded too (`batch_group`), L < S: causal top-left
    (2, 16, 2, 4096, 4096, False, "BLHD"),
    (1, 16, 4, 4097, 4161, True, "BHLD"),   # lengths not whole tiles: padded (one copy), keys masked
    (1, 16, 16, 4161, 2113, False, "BLHD"),  # L > S, both partial
])
# 64: 128-row query blocks in the backward, dQ's rows split; 256: its warpgroups share keys, split columns
@pytest.mark.parametrize("d", [128, 64, 256])
def test_drop_in_runs_the_hopper_kernels(monkeypatch, dtype, b, hq, hk, l, s, causal, memory, d):
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 2048)  # shorter shapes, the same kernels
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 2048)
    taken = _count_hopper_calls(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (_cuda_tensor(gen, b, h, t, d, memory) for h, t in ((hq, l), (hk, s), (hk, s)))
    cot = torch.randn(b, hq, l, d, generator=gen, device="cuda")
    gqa = hq != hk
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]  # .to keeps the memory layout
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    grads = torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)
    assert taken, "the call did not take the Hopper kernels"
    _assert_against_math(out, grads, q, k, v, cot, causal, dtype, gqa)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
def test_gqa_backward_taking_its_groups_by_bytes(monkeypatch):
    """Model B's training call, (2, 32/8 heads, 4096, 64) in (B, L, H, D) memory: 8 KV heads' items
    fill a wave of the backward's persistent grid but share 64 MB of Q, dO and float32 dQ, so the
    grid takes 4 at a time (`persistent_waves.L2_GROUP_BYTES`); gradients within the 2x rule."""
    from jaxattn.jax_core.kernels import flash_bwd_mgpu

    dealt = []
    real = flash_bwd_mgpu.waves
    monkeypatch.setattr(flash_bwd_mgpu, "waves", lambda *a, **kw: dealt.append(real(*a, **kw)) or dealt[-1])
    taken = _count_hopper_calls(monkeypatch)
    b, hq, hk, l, d, dtype = 2, 32, 8, 4096, 64, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (_cuda_tensor(gen, b, h, l, d, "BLHD") for h in (hq, hk, hk))
    cot = torch.randn(b, hq, l, d, generator=gen, device="cuda")
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)
    assert taken, "the call did not take the Hopper kernels"
    assert dealt and {getattr(x, "group", None) for x in dealt} == {4}, dealt
    _assert_against_math(out, grads, q, k, v, cot, True, dtype, True)


def _assert_against_math(out, grads, q, k, v, cot, causal, dtype, gqa):
    """out and grads (of sum(out * cot)) within twice torch's math error in `dtype` of its float32 math."""
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
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_drop_in_runs_the_hopper_kernels(monkeypatch, mode):
    """torch.compile(fullgraph=True) over the drop-in runs the Hopper kernels (the `jaxattn::hopper_flash`
    ops) with values and gradients as eager; under reduce-overhead the ops stay out of the CUDA graphs
    (tagged cudagraph_unsafe) and still run, on every call."""
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 2048)  # shorter shapes, the same kernels
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 2048)
    launched = []
    for kernel in (hopper_flash._FORWARD, hopper_flash._BACKWARD):
        monkeypatch.setattr(kernel, "launch", lambda t, s, real=kernel.launch: launched.append(1) or real(t, s))
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    b, hq, hk, l, s, dtype = 1, 16, 4, 2113, 4161, torch.bfloat16  # GQA, partial tiles, L < S
    q, k, v = (_cuda_tensor(gen, b, h, t, 128, "BLHD") for h, t in ((hq, l), (hk, s), (hk, s)))
    cot = torch.randn(b, hq, l, 128, generator=gen, device="cuda")
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                             fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records its graphs after warm-up runs
        with sdpa_launcher("native"):
            out = compiled(*leaves)
        grads = torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)
    assert len(launched) == 6, f"{len(launched)} Hopper launches in 3 compiled forward and backward calls, not 6"
    _assert_against_math(out, grads, q, k, v, cot, True, dtype, True)
    torch._dynamo.reset()


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, hq, hk, l, s, causal, memory", [
    (2, 32, 8, 4096, 4096, True, "BLHD"),  # a Llama layout: GQA, (B, L, H, D) memory
    (1, 16, 16, 4097, 4500, False, "BHLD"),  # partial tiles of 256 keys
    (1, 8, 8, 4096, 8192, True, "BHLD"),  # L < S, causal top-left: key blocks past the last row skipped
])
@pytest.mark.parametrize("d", [64, 256])
def test_drop_in_runs_the_hopper_forward_without_gradients(monkeypatch, dtype, b, hq, hk, l, s, causal, memory, d):
    """Without gradients, head dim 64 (256-key tiles) and head dim 256 take the Hopper forward (and
    either would take both kernels with gradients)."""
    taken = _count_hopper_calls(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    q, k, v = (_cuda_tensor(gen, b, h, t, d, memory) for h, t in ((hq, l), (hk, s), (hk, s)))
    gqa = hq != hk
    with torch.no_grad(), sdpa_launcher("native"):
        out = scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=causal, enable_gqa=gqa)
    assert taken, "the call did not take the Hopper forward"
    with torch.no_grad():
        want, _ = _math(q, k, v, causal, torch.float32, gqa)
        low, _ = _math(q, k, v, causal, dtype, gqa)
    err, torch_err = ((x.float() - want).abs().max().item() for x in (out, low))
    assert err <= 2 * torch_err + 1e-3, (err, torch_err)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), FlashConfig(scale=0.125))
    assert not hopper_flash.hopper_reasons(*args, False)
    assert not hopper_flash.hopper_reasons(*args, True)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("tma_edges", [False, True])
@pytest.mark.parametrize("hq, hk, l, s, kw", [
    (8, 2, 4097, 4161, dict(causal=True, window=(1000, 0), bottom_right=True, sinks=True)),
    (8, 4, 4104, 2056, dict(softcap=30.0, causal=True)),  # L > S, 8-row tiles
    (4, 4, 4096, 4096, dict(window=(700, 300))),  # whole tiles, two-sided window
])
def test_head_dim_256_forward_with_features_against_float64(monkeypatch, tma_edges, hq, hk, l, s, kw):
    """The head-dim-256 forward (one Q/O slot per warpgroup, 64-key blocks) with windows, a soft cap,
    sinks and edge lengths, padded or in place: out against the float64 reference under the 2x rule."""
    monkeypatch.setattr(calls, "HOPPER_TMA_EDGES", tma_edges)
    dtype, d = torch.bfloat16, 256
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    q = torch.randn(1, hq, l, d, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    k, v = (torch.randn(1, hk, s, d, generator=gen, device="cuda", dtype=torch.float64).to(dtype) for _ in range(2))
    sinks = torch.randn(hq, generator=gen, device="cuda") * 2 if kw.get("sinks") else None
    window, softcap = kw.get("window"), kw.get("softcap")
    cfg = FlashConfig(scale=d ** -0.5, causal=kw.get("causal", False),
                      diag_offset=s - l if kw.get("bottom_right") else 0, window=window or (-1, -1), softcap=softcap)
    with torch.no_grad():
        out = hopper_flash.hopper_flash(q, k, v, cfg, grad=False, sinks=sinks)
    rkw = dict(causal=cfg.causal, alignment="bottom_right" if kw.get("bottom_right") else "top_left", window=window,
               softcap=softcap, scale=cfg.scale, sinks=None if sinks is None else sinks.double())
    want, _ = reference(q.double(), k.double(), v.double(), **rkw)
    low, _ = reference(q, k, v, dtype=dtype, **rkw)
    floor = 2e-2 if softcap is not None else 4e-3
    assert_dtype_rule("out", out.double(), want, low.double(), floor=floor)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("hq, hk, d, memory", [
    (16, 16, 128, "BHLD"),  # folded (B*H, L, 1, D) views
    (16, 4, 128, "BLHD"),   # GQA in (B, L, H, D) memory: head splits, dK and dV summed by the results pass
    (16, 16, 64, "BLHD"),
    (32, 8, 64, "BLHD"),
])
def test_compiled_programs_run_the_hopper_kernels(monkeypatch, hq, hk, d, memory):
    """From a signature's second call on, the drop-in runs its compiled program (`hopper_program`):
    the same kernels with the same arguments as the Python path, so out, dK and dV equal the first
    call's bit for bit (dQ's float32 adds vary in order) and all are within the 2x rule of torch's
    float32 math, with the gradient of out in another layout (copied into out's) and without
    gradients (the forward-only program)."""
    from jaxattn.bridge import triton_program
    from jaxattn.torch_api import hopper_program

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    assert triton_program.wait(600), triton_program.build_error()
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 2048)  # shorter shapes, the same kernels
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 2048)
    monkeypatch.setattr(hopper_program, "_PROGRAMS", {})
    programs_run = []
    monkeypatch.setattr(triton_program, "apply", lambda *a, real=triton_program.apply: programs_run.append(1) or real(*a))
    python_path = []
    for kernel in (hopper_flash._FORWARD, hopper_flash._BACKWARD):
        monkeypatch.setattr(kernel, "launch", lambda t, s, real=kernel.launch: python_path.append(1) or real(t, s))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    b, l, dtype = 2, 2048, torch.bfloat16
    q, k, v = (_cuda_tensor(gen, b, h, l, d, memory) for h in (hq, hk, hk))
    cot = torch.randn(b, hq, l, d, generator=gen, device="cuda")
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]

    def step(cot16):
        with sdpa_launcher("native"):
            out = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=hq != hk)
        return out, torch.autograd.grad((out * cot16).sum(), leaves)

    first = step(cot.to(dtype))
    assert len(python_path) == 2 and len(hopper_program._PROGRAMS) == 1
    assert all(found >= 0 for found in hopper_program._PROGRAMS.values()), "no program was registered"
    other_layout = cot.to(dtype).transpose(0, 2).contiguous().transpose(0, 2)  # strides unlike out's
    second = step(other_layout)
    assert len(python_path) == 2 and programs_run == [1], "the second call did not run the program"
    for name, a, b_ in zip(("out", "dk", "dv"), (first[0], *first[1][1:]), (second[0], *second[1][1:])):
        assert torch.equal(a, b_), name
    _assert_against_math(second[0], second[1], q, k, v, cot, True, dtype, hq != hk)
    with torch.no_grad(), sdpa_launcher("native"):
        plain = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=hq != hk)
        assert len(python_path) == 3 and len(hopper_program._PROGRAMS) == 2
        again = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=hq != hk)
    assert len(python_path) == 3, "the forward-only program did not run"
    assert torch.equal(plain, first[0]) and torch.equal(again, first[0])


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
def test_head_dim_256_forward_runs_as_a_compiled_program_and_under_torch_compile(monkeypatch):
    """Head dim 256 without gradients, at 1024 tokens (the compiled-program threshold): the first call
    takes the Python path and registers the forward-only program, the second runs the program (the
    same out bit for bit); torch.compile runs the `jaxattn::hopper_flash` op (from the Python path's
    threshold, lowered to this length); all within the 2x rule of torch's float32 math. With gradients
    the call is not the Hopper kernels'."""
    from jaxattn.bridge import triton_program
    from jaxattn.torch_api import hopper_program

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    assert triton_program.wait(600), triton_program.build_error()
    monkeypatch.setattr(hopper_program, "_PROGRAMS", {})
    launched = []
    real = hopper_flash._FORWARD.launch
    monkeypatch.setattr(hopper_flash._FORWARD, "launch", lambda t, st: launched.append(1) or real(t, st))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    b, hq, hk, l, d, dtype = 16, 8, 4, 1024, 256, torch.bfloat16
    q, k, v = (_cuda_tensor(gen, b, h, l, d, "BLHD") for h in (hq, hk, hk))
    q16, k16, v16 = (x.to(dtype) for x in (q, k, v))
    cfg = FlashConfig(scale=d ** -0.5, causal=True)
    assert hopper_flash.hopper_reasons(q16, k16, v16, cfg, False) == []
    assert any("with gradients" in r for r in hopper_flash.hopper_reasons(q16, k16, v16, cfg, True))

    def call(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.no_grad(), sdpa_launcher("native"):
        first = call(q16, k16, v16)
        assert len(launched) == 1 and len(hopper_program._PROGRAMS) == 1
        second = call(q16, k16, v16)
    assert len(launched) == 1, "the forward-only program did not run"
    assert torch.equal(first, second)
    torch._dynamo.reset()
    # Compiled graphs take the Python path's threshold (4096: no program runs inside them): lowered here.
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 1024)
    compiled = torch.compile(call, fullgraph=True)
    with torch.no_grad(), sdpa_launcher("native"):
        traced = compiled(q16, k16, v16)
    assert len(launched) == 2, "the compiled call did not launch the Hopper forward"
    with torch.no_grad():
        want, _ = _math(q, k, v, True, torch.float32, True)
        low, _ = _math(q, k, v, True, dtype, True)
    torch_err = (low.float() - want).abs().max().item()
    for name, got in (("program", second), ("torch.compile", traced)):
        err = (got.float() - want).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, (name, err, torch_err)
    torch._dynamo.reset()


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
def test_calls_a_program_runs_take_the_hopper_kernels_from_shorter_lengths(monkeypatch):
    """Below `HOPPER_MIN_LENGTH` the kernels run where a compiled program would (whole tiles, inputs read
    in place, programs on, enough work): 1024 tokens, forward only or with gradients; a partial tile,
    programs off or a small call keep the Triton kernels."""
    from jaxattn.bridge import triton_program

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    cfg = FlashConfig(scale=0.1, causal=True)

    def reasons(b, hq, hk, l, d, memory="BHLD", grad=True):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (_cuda_tensor(gen, b, h, l, d, memory).to(torch.bfloat16) for h in (hq, hk, hk))
        return hopper_flash.hopper_reasons(q, k, v, cfg, grad)

    assert reasons(8, 16, 16, 1024, 128) == [] and reasons(16, 16, 16, 1024, 64) == []
    assert reasons(8, 16, 4, 1024, 128, "BLHD") == [] and reasons(8, 16, 16, 1024, 128, grad=False) == []
    short = "below 4096"
    assert any(short in r for r in reasons(8, 16, 16, 1000, 128))  # a partial tile: padded copies
    assert reasons(8, 16, 4, 1024, 128) == []  # GQA in (B, H, T, D) memory: folded into the batch, in place
    assert any(short in r for r in reasons(2, 16, 16, 1024, 128))  # host-bound either way
    assert reasons(16, 16, 16, 1024, 64, grad=False) == [] and reasons(8, 16, 16, 2048, 64, grad=False) == []
    assert any(short in r for r in reasons(64, 16, 16, 512, 64, grad=False))  # 512 tokens: below 1024
    monkeypatch.setenv(triton_program.ENV_SWITCH, "0")
    assert any(short in r for r in reasons(8, 16, 16, 1024, 128))


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


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, l, s, kw", [
    (8, 2, 4097, 4161, dict(causal=True, window=(1000, 0), bottom_right=True)),  # causal sliding window, edges
    (8, 8, 4096, 4096, dict(window=(700, 300))),  # two-sided window, whole tiles (zero-copy views)
    (8, 4, 4097, 2049, dict(softcap=30.0, causal=True)),  # soft cap, L > S
    (8, 2, 3000, 5000, dict(softcap=15.0, window=(512, 64), bottom_right=True)),  # all of them
    (8, 8, 4096, 4096, dict(causal=True, sinks=True)),  # sinks, folded: one per (batch, head) pair
    (8, 2, 4097, 4161, dict(causal=True, sinks=True, window=(1000, 0))),  # sinks, GQA, window, edges
    # Head dim 64 over 1025-2048 keys: the forward's 256-key blocks on short walks
    (8, 2, 1500, 2000, dict(causal=True, sinks=True, window=(700, 0), bottom_right=True, d=64)),
    (8, 8, 2048, 2048, dict(softcap=20.0, causal=True, d=64)),
    # Walks of at most 2048 query rows: the backward in clusters of two (`calls.hopper_backward_cluster`)
    (8, 8, 1024, 1024, dict(causal=True)),
    (8, 8, 1000, 1024, dict(softcap=20.0, window=(300, 0), bottom_right=True, sinks=True, d=64)),
    # Head dim 256: the backward whose warpgroups share an item's keys and split its columns
    (8, 2, 4097, 4161, dict(causal=True, sinks=True, window=(1000, 0), bottom_right=True, d=256)),
    (8, 4, 4097, 2049, dict(softcap=30.0, causal=True, d=256)),
])
def test_hopper_kernels_with_windows_soft_caps_and_edge_lengths(monkeypatch, dtype, hq, hk, l, s, kw):
    """The Hopper launch the native launcher takes (`hopper_flash`) on a window and/or a soft cap and
    lengths that are not whole tiles: out, dq, dk, dv against the float64 reference under the 2x rule,
    and both Mosaic GPU kernels ran."""
    _assert_hopper_flash_against_float64(monkeypatch, dtype, hq, hk, l, s, kw)


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hk, l, s, kw", [
    (8, 8, 4104, 4104, dict(causal=True)),  # folded (B, H, T, D), 8 rows past the last whole tile
    (8, 2, 1000, 1032, dict(causal=True, window=(300, 0), bottom_right=True, d=64)),  # GQA, L < S
    (8, 4, 2056, 1000, dict(softcap=30.0, causal=True)),  # L > S: rows that see every key
    (8, 2, 3000, 5000, dict(softcap=15.0, window=(512, 64), bottom_right=True, sinks=True)),  # all of them
    (8, 8, 1000, 3000, dict(window=(200, 140))),  # keys past the last true row's are loaded for none
    (8, 4, 2056, 1000, dict(softcap=30.0, causal=True, d=256)),  # head dim 256, L > S
])
def test_lengths_in_whole_tma_tiles_run_in_place(monkeypatch, dtype, hq, hk, l, s, kw):
    """With `calls.HOPPER_TMA_EDGES`, lengths that are whole 8-row TMA tiles but not whole kernel tiles
    go to the kernels in place (no padded copy; the last tiles run past the arrays' ends): out, dq, dk,
    dv (and the sinks' gradient) against the float64 reference under the 2x rule."""
    monkeypatch.setattr(calls, "HOPPER_TMA_EDGES", True)
    copies, real = [], hopper_flash._padded

    def padded(t, n, dim):
        if t.shape[dim] != n:
            copies.append((tuple(t.shape), n))
        return real(t, n, dim)
    monkeypatch.setattr(hopper_flash, "_padded", padded)
    _assert_hopper_flash_against_float64(monkeypatch, dtype, hq, hk, l, s, kw)
    assert copies == [], copies


def _assert_hopper_flash_against_float64(monkeypatch, dtype, hq, hk, l, s, kw):
    ran = []
    for name in ("_FORWARD", "_BACKWARD"):
        kernel = getattr(hopper_flash, name)
        monkeypatch.setattr(kernel, "launch", lambda t, s, _real=kernel.launch, _name=name: ran.append(_name) or _real(t, s))
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    d = kw.get("d", 128)
    q, do = (torch.randn(1, hq, l, d, generator=gen, device="cuda", dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, hk, s, d, generator=gen, device="cuda", dtype=torch.float64) for _ in range(2))
    q, k, v, do = (x.to(dtype).double() for x in (q, k, v, do))  # exactly representable inputs
    scale = d ** -0.5
    window, softcap = kw.get("window"), kw.get("softcap")
    cfg = FlashConfig(scale=scale, causal=kw.get("causal", False), diag_offset=s - l if kw.get("bottom_right") else 0,
                      window=window or (-1, -1), softcap=softcap)
    reasons = hopper_flash.hopper_reasons(q.to(dtype), k.to(dtype), v.to(dtype), cfg, grad=True)
    assert all("measured faster" in r for r in reasons), reasons  # only the length thresholds, if any
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    sinks = (torch.randn(hq, generator=gen, device="cuda") * 2).requires_grad_(True) if kw.get("sinks") else None
    out = hopper_flash.hopper_flash(*leaves, cfg, grad=True, sinks=sinks)
    grads = torch.autograd.grad((out * do.to(dtype)).sum(), leaves + ([sinks] if kw.get("sinks") else []))
    assert ran == ["_FORWARD", "_BACKWARD"], ran

    rkw = dict(causal=cfg.causal, alignment="bottom_right" if kw.get("bottom_right") else "top_left", window=window,
               softcap=softcap, scale=scale, sinks=None if sinks is None else sinks.detach().double())
    want, _, (dq, dk, dv, _, want_dsinks) = reference_grads(q, k, v, do, **rkw)
    low_leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    low, _ = reference(*low_leaves, dtype=dtype, **rkw)
    low_grads = torch.autograd.grad((low * do.to(dtype)).sum(), low_leaves)
    if sinks is not None:
        *grads, dsinks = grads
        assert torch.allclose(dsinks.double(), want_dsinks, rtol=2e-2, atol=2e-2 * want_dsinks.abs().max().item())
    # The kernels' soft cap uses tanh.approx.f32 (relative error below 2**-10.9): a larger floor.
    floor = 2e-2 if softcap is not None else 4e-3
    for name, got, ref, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, dq, dk, dv), (low, *low_grads)):
        assert_dtype_rule(name, got.double(), ref, theirs.double(), floor=floor * max(1.0, ref.abs().max().item()))


def _pass_device(by: str, kernel: str, monkeypatch) -> str:
    """The device a test of one of the backward's passes runs on; `by` "torch" takes the pass's kernel
    away (the torch ops that stand in without Triton)."""
    from jaxattn.bridge.triton_launch import can_launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if by == "triton" and not can_launch(torch.device(device)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if by == "torch":
        monkeypatch.setattr(hopper_flash, kernel, None)
    return device


@pytest.mark.parametrize("by", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["BHLD", "BLHD", "strided-dout"])
@pytest.mark.parametrize("accum_rows", [128, 104])
def test_backward_operands_against_float64(layout, by, accum_rows, monkeypatch):
    """The backward's row operands (`backward_operands`: the Triton pass, under TRITON_INTERPRET=1 on the
    CPU, or the torch ops that stand in without Triton) against float64: delta = rowsum(dO * O), the LSE
    in log2 units with +inf for rows that saw no key, 0 and +inf on the padded rows, and the dQ
    accumulator zeroed, for the memory layouts the drop-in hands it. Buffers start as NaN. An
    accumulator of fewer rows than the row vectors (the queries read in place, `calls.HOPPER_TMA_EDGES`)
    is zeroed on its own rows only: the rows after them in its buffer stay NaN."""
    device = _pass_device(by, "hopper_backward_operands_kernel", monkeypatch)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    b, h, l, d, rows = 2, 3, 97, 80, 128
    out, dout = (torch.randn(b, l, h, d, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    if layout == "BHLD":
        out, dout = (x.transpose(1, 2).contiguous() for x in (out, dout))
    else:  # (B, L, H, D) memory seen as (B, H, L, D)
        out, dout = (x.transpose(1, 2) for x in (out, dout))
    if layout == "strided-dout":
        dout = torch.randn(b, h, l, 2 * d, generator=gen).to(device, torch.bfloat16)[..., ::2]
    # The forward's LSE is a view of its padded rows; two rows saw no key.
    lse = (torch.randn(b, h, 2 * rows, generator=gen) * 3).to(device)[..., :l]
    lse[0, 1, 5] = lse[1, 2, 96] = -math.inf
    folded = layout == "BHLD"
    accum_shape = (b * h, rows, 1, d) if folded else (b, rows, h, d)
    delta, lse_log2 = (torch.full((b, h, rows), math.nan, device=device) for _ in range(2))
    buffer = torch.full(accum_shape, math.nan, device=device)
    accum = buffer[:, :accum_rows]
    hopper_flash.backward_operands(out, dout, lse, delta, lse_log2, accum, folded)
    assert buffer[:, accum_rows:].isnan().all()

    want_delta = (out.double() * dout.double()).sum(-1)
    assert (delta[..., :l].double() - want_delta).abs().max().item() < 1e-4 * max(1.0, want_delta.abs().max().item())
    assert torch.equal(delta[..., l:], torch.zeros_like(delta[..., l:]))
    want_lse = torch.where(lse.isneginf(), math.inf, lse.double() / math.log(2))
    assert torch.equal(lse_log2[..., :l].isinf(), want_lse.isinf()) and (lse_log2[..., :l] > 0)[want_lse.isinf()].all()
    finite = ~want_lse.isinf()
    assert (lse_log2[..., :l].double() - want_lse)[finite].abs().max().item() < 1e-5 * want_lse[finite].abs().max()
    assert (lse_log2[..., l:] == math.inf).all()
    assert torch.equal(accum, torch.zeros_like(accum))


@pytest.mark.parametrize("by", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_results_against_float64(dtype, by, monkeypatch):
    """The split backward's results (`backward_results`: one Triton pass, or torch ops without Triton):
    dq cast from its float32 accumulator, dk and dv the sums of their float32 partials over the splits,
    each within one rounding of the float64 sum, in shapes that end inside a block."""
    device = _pass_device(by, "hopper_backward_results_kernel", monkeypatch)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    splits, b, rows, keys, hq, hk, d = 3, 2, 97, 75, 6, 2, 80
    dq = torch.randn(b, rows, hq, d, generator=gen).to(device)
    dk_parts, dv_parts = (torch.randn(splits, b, keys, hk, d, generator=gen).to(device) for _ in range(2))
    got = hopper_flash.backward_results(dq, dk_parts, dv_parts, dtype)
    wants = (dq.double(), dk_parts.double().sum(0), dv_parts.double().sum(0))
    alone = hopper_flash.backward_results(dq, None, None, dtype)  # no head splits: dQ's cast only
    assert alone[1:] == (None, None) and torch.equal(alone[0], got[0])
    eps = torch.finfo(dtype).eps
    for name, g, want in zip(("dq", "dk", "dv"), got, wants):
        assert g.dtype == dtype and g.shape == want.shape and g.is_contiguous(), (name, g.dtype, g.shape)
        assert ((g.double() - want).abs() <= eps * want.abs() + 1e-6).all(), name
    assert len({g.untyped_storage().data_ptr() for g in got}) == 3  # no shared storage


@pytest.mark.skipif(not _hopper_gpu(), reason="needs an sm90 GPU with Pallas Mosaic GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_back_to_back_forwards_read_what_the_call_before_wrote(monkeypatch, causal, d):
    """Under programmatic dependent launch a kernel may start while the one before it on the stream
    still runs, and must wait for it before reading. Pairs of calls with no synchronisation between
    them: a long one on a few multiprocessors (one head, 32 tiles of queries each walking 64K keys),
    then one whose values are its output. The second call's programs find idle multiprocessors at
    once, so a kernel that read before the wait would read those values before they are written.
    Each call against torch's math on its own inputs. (A forward whose wait is kept but never runs
    fails it with NaN outputs; one without the wait at all launches in stream order and passes.)"""
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 2048)
    taken = _count_hopper_calls(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, ())))
    dtype, l, s = torch.bfloat16, 4096, 65536

    def randn(t):
        return torch.randn(1, 1, t, d, generator=gen, device="cuda").to(dtype)
    # All inputs first: a kernel of torch's between the two calls would wait for the first to end.
    pairs = [(randn(l), randn(s), randn(s), randn(l), randn(l)) for _ in range(3)]
    results = []
    with torch.no_grad(), sdpa_launcher("native"):
        for q, k, v, q2, k2 in pairs:
            out = scaled_dot_product_attention(q, k, v)
            results += [(q, k, v, False, out),
                        (q2, k2, out, causal, scaled_dot_product_attention(q2, k2, out, is_causal=causal))]
    assert len(taken) == len(results), "the calls did not take the Hopper kernels"
    for i, (q, k, v, is_causal, out) in enumerate(results):
        q, k, v = (t.float() for t in (q, k, v))
        want, _ = _math(q, k, v, is_causal, torch.float32, False)
        low, _ = _math(q, k, v, is_causal, dtype, False)
        err, torch_err = ((t.float() - want).abs().max().item() for t in (out, low))
        assert err <= 2 * torch_err + 1e-4 * want.abs().max().item(), (i, err, torch_err)
