"""The Triton flash kernels on CUDA (through jax-triton): the feature grid in bf16/fp16, forward and
gradients, with flash-attn's rule: our error against a float64 reference is at most twice that of
plain torch ops in the same dtype. Skipped without a CUDA device or jax-triton."""

import importlib.util

import pytest
import torch

from attention_reference import (alibi_bias, assert_dtype_rule, reference, seqused_reference, used_rows,
                                 varlen_reference)

from jaxattn.torch_api import flash_attention, scaled_dot_product_attention, sdpa_launcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None, reason="needs jax-triton (the gpu extra: pip install -e '.[gpu]' in the jaxattn checkout)"),
]

DEV = "cuda"


@pytest.fixture(params=["native", "xla"], autouse=True)
def launcher(request):
    """Every test runs with both launchers of the same kernels."""
    with sdpa_launcher(request.param):
        yield request.param

CASES = [
    dict(b=2, hq=4, hk=4, l=97, s=1025, d=64),
    dict(b=2, hq=4, hk=4, l=128, s=128, d=128, causal=True),
    dict(b=1, hq=8, hk=2, l=97, s=130, d=80, causal=True),
    dict(b=1, hq=8, hk=1, l=97, s=1025, d=128, causal=True, alignment="bottom_right"),
    dict(b=1, hq=4, hk=4, l=1025, s=97, d=64, causal=True, alignment="bottom_right"),
    dict(b=1, hq=4, hk=2, l=256, s=256, d=96, window=(64, 0)),
    dict(b=1, hq=4, hk=4, l=200, s=300, d=64, window=(32, 16), alignment="bottom_right"),
    dict(b=1, hq=4, hk=4, l=256, s=256, d=128, causal=True, softcap=30.0),
    dict(b=1, hq=4, hk=2, l=97, s=1025, d=64, sinks=True),
    dict(b=1, hq=4, hk=4, l=128, s=256, d=192, causal=True),
    dict(b=1, hq=2, hk=2, l=130, s=130, d=256),
    dict(b=1, hq=4, hk=4, l=97, s=130, d=64, dv=32),
]


def _case_id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_kernels_feature_grid(case, dtype):
    case = dict(case)
    gen = torch.Generator(device=DEV).manual_seed(len(_case_id(case)) + (dtype == torch.float16))
    b, hq, hk, l, s, d = (case.pop(n) for n in ("b", "hq", "hk", "l", "s", "d"))
    dv = case.pop("dv", d)

    def make(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype).requires_grad_()

    q, k, v = make(b, hq, l, d), make(b, hk, s, d), make(b, hk, s, dv)
    sinks = torch.randn(hq, generator=gen, device=DEV).requires_grad_() if case.pop("sinks", False) else None
    alignment = case.pop("alignment", "top_left")
    kw = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"))

    out, lse = flash_attention(q, k, v, causal_alignment=alignment, sinks=sinks, return_lse=True,
                               implementation="flash", **kw)
    ref, ref_lse = reference(q, k, v, alignment=alignment, sinks=sinks, **kw)
    low, _ = reference(q, k, v, alignment=alignment, sinks=sinks, dtype=dtype, **kw)
    assert out.dtype == dtype
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-3

    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double())
    low_grads = torch.autograd.grad(low, inputs, dout)
    for name, g, rg, lg in zip("qkvs", grads, ref_grads, low_grads):
        assert_dtype_rule(f"d{name}", g, rg.double(), lg, floor=1e-3)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_flash_through_sdpa_with_masks(mask_kind):
    gen = torch.Generator(device=DEV).manual_seed(7)
    b, h, l, s, d = 2, 4, 97, 1025, 64
    q, k, v = (torch.randn(b, h, n, d, generator=gen, device=DEV).bfloat16().requires_grad_() for n in (l, s, s))
    if mask_kind == "bool":
        mask = torch.rand(b, 1, l, s, generator=gen, device=DEV) > 0.3
        mask[:, :, 5] = False  # a fully masked row
    else:
        mask = torch.randn(1, h, l, s, generator=gen, device=DEV).bfloat16().requires_grad_()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, implementation="flash")
    ref, _ = reference(q, k, v, **({"mask": mask} if mask_kind == "bool" else {"bias": mask}))
    low, _ = reference(q, k, v, dtype=torch.bfloat16, **({"mask": mask} if mask_kind == "bool" else {"bias": mask}))
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    inputs = [q, k, v] + ([mask] if mask_kind == "float" else [])
    dout = torch.randn(out.shape, generator=gen, device=DEV).bfloat16()
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double())
    low_grads = torch.autograd.grad(low, inputs, dout)
    for name, g, rg, lg in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, low_grads):
        assert_dtype_rule(name, g, rg.double(), lg, floor=1e-3)


# ------------------------------------------------------------------ segment ids, varlen, dropout (torch API)

def _check_2x(out, ref, low, grads, ref_grads, low_grads):
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    for name, g, rg, lg in zip("qkv", grads, ref_grads, low_grads):
        assert_dtype_rule(f"d{name}", g, rg.double(), lg, floor=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_segment_ids_on_gpu(dtype, causal):
    gen = torch.Generator(device=DEV).manual_seed(21 + causal)
    b, hq, hk, l, s, d = 2, 8, 2, 1025, 1100, 80
    q = torch.randn(b, hq, l, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    k, v = (torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype).requires_grad_() for _ in "kv")
    # packed documents of unequal lengths, padding marked 0 at the end; the second row shifted
    q_ids = torch.tensor([1] * 300 + [2] * 97 + [3] * 600 + [0] * 28, device=DEV)
    kv_ids = torch.tensor([1] * 350 + [2] * 120 + [3] * 600 + [0] * 30, device=DEV)
    q_ids, kv_ids = torch.stack([q_ids, q_ids.roll(50)]), torch.stack([kv_ids, kv_ids.roll(70)])
    out = flash_attention(q, k, v, causal=causal, causal_alignment="bottom_right", segment_ids=(q_ids, kv_ids),
                          implementation="flash")
    mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    kw = dict(causal=causal, alignment="bottom_right", mask=mask)
    ref, _ = reference(q, k, v, **kw)
    low, _ = reference(q, k, v, dtype=dtype, **kw)
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    _check_2x(out, ref, low, torch.autograd.grad(out, (q, k, v), dout),
              torch.autograd.grad(ref, (q, k, v), dout.double()), torch.autograd.grad(low, (q, k, v), dout))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_flash_varlen_on_gpu(dtype, alignment):
    gen = torch.Generator(device=DEV).manual_seed(5 + len(alignment))
    lens_q, lens_k = [1, 97, 1025, 300], [5, 97, 1100, 257]
    hq, hk, d = 8, 4, 128
    q = torch.randn(sum(lens_q), hq, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), hk, d, generator=gen, device=DEV).to(dtype).requires_grad_() for _ in "kv")
    cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).int()
    out, lse = flash_attention(q, k, v, causal=True, causal_alignment=alignment, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                               return_lse=True, implementation="flash")
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    packed = [x.transpose(0, 1)[None] for x in (q, k, v)]  # (1, H, total, D)
    ref, low = (varlen_reference(*packed, cu_q, cu_k, causal=True, alignment=alignment, dtype=dt)[0][0].transpose(0, 1)
                for dt in (torch.float64, dtype))
    _check_2x(out, ref, low, torch.autograd.grad(out, (q, k, v), dout),
              torch.autograd.grad(ref, (q, k, v), dout.double()), torch.autograd.grad(low, (q, k, v), dout))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_seqused_on_gpu(dtype):
    """seqused_q and seqused_k: each sequence computed on its used rows only (`seqused_reference`);
    the unused rows and their output gradient hold NaN; unused query rows give 0, LSE -inf, dq 0."""
    gen = torch.Generator(device=DEV).manual_seed(9 + (dtype == torch.float16))
    lens_q, lens_k = [97, 1, 300, 40], [130, 5, 1025, 40]
    used_q, used_k = [60, 1, 257, 0], [130, 0, 700, 33]
    hq, hk, d = 8, 2, 80
    cu_q, cu_k = (torch.tensor([0] + lens, device=DEV).cumsum(0).int() for lens in (lens_q, lens_k))
    keep = []
    for cu, used, total in ((cu_q, used_q, sum(lens_q)), (cu_k, used_k, sum(lens_k))):
        mask = torch.zeros(total, dtype=torch.bool, device=DEV)
        mask[used_rows(cu.cpu(), used, total).to(DEV)] = True
        keep.append(mask[:, None, None])
    q, k, v = (torch.randn(len(mask), h, d, generator=gen, device=DEV).to(dtype).masked_fill(~mask, float("nan"))
               .requires_grad_() for mask, h in ((keep[0], hq), (keep[1], hk), (keep[1], hk)))
    out, lse = flash_attention(q, k, v, causal=True, causal_alignment="bottom_right", cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                               seqused_q=torch.tensor(used_q, dtype=torch.int32, device=DEV),
                               seqused_k=torch.tensor(used_k, dtype=torch.int32, device=DEV), return_lse=True,
                               implementation="flash")
    unused_q = ~keep[0][:, 0, 0]
    assert (out[unused_q] == 0).all() and torch.isneginf(lse[:, unused_q]).all()
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype).masked_fill(~keep[0], float("nan"))
    packed = [x.transpose(0, 1)[None] for x in (q, k, v)]  # (1, H, total, D)
    ref, low = (seqused_reference(*packed, cu_q, cu_k, used_q, used_k, causal=True, alignment="bottom_right",
                                  dtype=dt)[0][0].transpose(0, 1) for dt in (torch.float64, dtype))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check_2x(out, ref, low, grads, torch.autograd.grad(ref, (q, k, v), dout.double()),
              torch.autograd.grad(low, (q, k, v), dout))
    assert (grads[0][unused_q] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_varlen_on_gpu(dtype):
    """flash_attn_varlen_func with a block table: each sequence's keys live in shuffled pages of a
    NaN-padded pool (one page shared by two sequences); the float64 oracle reads the same keys
    gathered in order. Gradients reach the pools."""
    from jaxattn import flash_attn_interface as fai

    gen = torch.Generator(device=DEV).manual_seed(41 + (dtype == torch.float16))
    lens_q, lens_k = [97, 0, 300, 33], [130, 0, 1025, 33]
    page, hq, hk, d = 64, 8, 2, 80
    needed = [-(-n // page) for n in lens_k]
    num_pages = sum(needed) + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)).tolist()
    table = torch.full((len(lens_k), max(needed)), -1, dtype=torch.int32)
    for n, count in enumerate(needed):
        for j in range(count):
            table[n, j] = order.pop()
    table[3, 0] = table[0, 0]  # the last sequence reads sequence 0's first page (a shared prefix)
    used = torch.zeros(num_pages, page, dtype=torch.bool)
    for n, length in enumerate(lens_k):
        for j in range(length):
            used[table[n, j // page], j % page] = True
    table, used = table.to(DEV), used.to(DEV)
    k_pool, v_pool = (torch.randn(num_pages, page, hk, d, generator=gen, device=DEV).to(dtype)
                      .masked_fill(~used[:, :, None, None], float("nan")).requires_grad_() for _ in "kv")
    q = torch.randn(sum(lens_q), hq, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    cu_q, cu_k = (torch.tensor([0] + lens, device=DEV).cumsum(0).int() for lens in (lens_q, lens_k))
    out = fai.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                     block_table=table)

    def gathered(pool):  # (1, Hk, total_k, D), the sequences' keys in order
        rows = [pool[table[n, j // page], j % page] for n, length in enumerate(lens_k) for j in range(length)]
        return torch.stack(rows).transpose(0, 1)[None]

    def oracle(dt):
        packed = [q.transpose(0, 1)[None], gathered(k_pool), gathered(v_pool)]
        return varlen_reference(*packed, cu_q, cu_k, causal=True, alignment="bottom_right", dtype=dt)[0][0].transpose(0, 1)

    ref, low = oracle(torch.float64), oracle(dtype)
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    leaves = (q, k_pool, v_pool)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = [torch.nan_to_num(g) for g in torch.autograd.grad(ref, leaves, dout.double())]
    low_grads = [torch.nan_to_num(g) for g in torch.autograd.grad(low, leaves, dout)]
    _check_2x(out, ref, low, grads, ref_grads, low_grads)
    assert not any(g.isnan().any() for g in grads)


def test_flash_dropout_on_gpu_is_seeded_unbiased_and_differentiable():
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = (torch.randn(1, 4, 97, 64, generator=gen, device=DEV).bfloat16().requires_grad_() for _ in "qkv")

    def run(seed):
        torch.manual_seed(seed)
        out = flash_attention(q, k, v, causal=True, dropout_p=0.2, implementation="flash")
        return out, torch.autograd.grad(out.float().square().sum(), (q, k, v))

    (a, ga), (b, gb), (c, _) = run(0), run(0), run(1)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert not torch.equal(a, c)
    assert all(torch.isfinite(g).all() for g in ga)
    plain = flash_attention(q, k, v, causal=True, implementation="flash").double()
    with torch.no_grad():
        mean = sum(flash_attention(q, k, v, causal=True, dropout_p=0.2, implementation="flash").double()
                   for _ in range(400)) / 400
    assert (mean - plain).abs().mean() < 0.02 * plain.abs().mean() + 2e-3


def test_sdpa_dropout_on_gpu_selects_flash():
    q, k, v = (torch.randn(2, 4, 128, 64, device=DEV, dtype=torch.bfloat16) for _ in "qkv")
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    torch.manual_seed(0)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.1, implementation="flash")
    assert torch.equal(a, b)


ALIBI_CASES = [
    dict(b=2, hq=4, hk=2, l=97, s=1025, d=64, causal=True, alignment="bottom_right", per_batch=True),
    dict(b=1, hq=8, hk=2, l=130, s=97, d=80, causal=True),
    dict(b=1, hq=4, hk=4, l=200, s=300, d=128, window=(32, 16), alignment="bottom_right", softcap=30.0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ALIBI_CASES, ids=_case_id)
def test_flash_alibi_on_gpu(case, dtype):
    """ALiBi slopes against the float64 reference with the bias -slope * |i + S - L - j| written out."""
    case = dict(case)
    gen = torch.Generator(device=DEV).manual_seed(len(_case_id(case)) + (dtype == torch.float16))
    b, hq, hk, l, s, d = (case.pop(n) for n in ("b", "hq", "hk", "l", "s", "d"))
    q = torch.randn(b, hq, l, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    k, v = (torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype).requires_grad_() for _ in "kv")
    slopes = torch.rand(b, hq, generator=gen, device=DEV) * 0.3 if case.pop("per_batch", False) else \
        torch.rand(hq, generator=gen, device=DEV) * 0.3
    alignment = case.pop("alignment", "top_left")
    kw = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"))
    out = flash_attention(q, k, v, causal_alignment=alignment, alibi_slopes=slopes, implementation="flash", **kw)
    bias = alibi_bias(slopes, l, s, device=DEV)
    ref, _ = reference(q, k, v, alignment=alignment, bias=bias, **kw)
    low, _ = reference(q, k, v, alignment=alignment, bias=bias, dtype=dtype, **kw)
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    _check_2x(out, ref, low, torch.autograd.grad(out, (q, k, v), dout),
              torch.autograd.grad(ref, (q, k, v), dout.double()), torch.autograd.grad(low, (q, k, v), dout))
