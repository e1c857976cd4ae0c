"""The decode kernels launched from torch (`torch_api/native_decode.py`), through the public API.

On CPU the kernels run under Triton's interpreter on torch CPU tensors (conftest sets
TRITON_INTERPRET=1 without a GPU), forced with `sdpa_launcher("native")`; on a CUDA machine the same
tests run the compiled kernels. The oracle is the float64 reference of tests/attention_reference.py
(`decode_reference`) on ragged caches whose unwritten slots and unused pages hold NaN
(tests/decode_cases.py); the segment table is checked against a plain-Python walk over positions.
Bit-identity with the JAX launcher (jax-triton, the interpreter stand-in on CPU) is tested with
small tiles and few programs, so that segments are cut into several partial results.
"""


import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import decode_reference  # noqa: E402
from decode_cases import SmallLaunch, layout_cache, ragged_cache  # noqa: E402

from jaxattn.bridge import cache_info  # noqa: E402
from jaxattn.bridge.triton_launch import KernelLaunch, can_launch  # noqa: E402
from jaxattn.jax_core.kernels import decode_plan  # noqa: E402
from jaxattn.jax_core.kernels.decode_jax_triton import DecodeConfig, decode_attention_triton  # noqa: E402
from jaxattn.jax_core.kernels.decode_segments_triton import segment_offsets_entry  # noqa: E402
from jaxattn.torch_api import KVCache, decode_attention, sdpa_launcher  # noqa: E402
from jaxattn.torch_api import native_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not can_launch(torch.device(DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1")
# float32 runs its dots as tf32x3 on a GPU (near fp32); exact fp32 products under the interpreter.
TOL = 2e-4 if DEVICE == "cuda" else 2e-5

B, HKV, S, D = 4, 2, 40, 16
LENGTHS = torch.tensor([1, S, 23, 0], dtype=torch.int32)  # length 1, a full cache, an empty sequence
STARTS = torch.tensor([0, 3, 9, 0], dtype=torch.int32)


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


# --- the segment table ----------------------------------------------------------------------------


def _segments_by_walking(lengths, starts, t, capacity, window, causal, pos_shift, block_n, per_seq):
    """SegCum by its definition: per sequence, the key blocks from the first to the last position
    that some query sees (walking every position and query), repeated `per_seq` times, summed."""
    left, right = window
    cum = [0]
    for b, length in enumerate(lengths):
        length = min(length, capacity)
        start = 0 if starts is None else max(starts[b], 0)
        seen = [j for j in range(start, length)
                if any((not causal or j <= pos) and (left < 0 or j >= pos - left) and (right < 0 or j <= pos + right)
                       for pos in (length - t + q + pos_shift for q in range(t)))]
        blocks = seen[-1] // block_n - seen[0] // block_n + 1 if seen else 0
        base = cum[-1]
        cum += [base + blocks * (i + 1) for i in range(per_seq)]
    return cum


SEGMENT_CASES = [
    # (t, window, causal, pos_shift, block_n, per_seq, with starts)
    (1, (-1, -1), True, 0, 16, 2, True),
    (3, (5, -1), True, 0, 8, 3, True),
    (4, (7, 2), False, 0, 16, 1, False),
    (2, (-1, 3), False, -6, 8, 4, True),
    (3, (0, 0), False, 2, 4, 2, True),
    (16, (100, -1), True, 0, 16, 5, True),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=str)
def test_segment_table_matches_the_rule(case, monkeypatch):
    """Ragged lengths (0, 1, full, past nothing) and starts (also past the length), causal or not,
    windows on either side, shifted queries; 37 sequences in chunks of 16 (the carried total)."""
    t, window, causal, pos_shift, block_n, per_seq, with_starts = case
    monkeypatch.setattr(decode_plan, "SEGMENT_BLOCK_B", 16)
    gen = torch.Generator().manual_seed(sum(map(abs, window)) + t * 7 + block_n + per_seq)
    b, capacity = 37, 50
    lengths = torch.randint(0, capacity + 1, (b,), generator=gen, dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 1, capacity])
    starts = torch.randint(0, capacity, (b,), generator=gen, dtype=torch.int32) if with_starts else None
    cfg = DecodeConfig(scale=1.0, causal=causal, window=window, pos_shift=pos_shift)
    planned = decode_plan.segments_launch(b, t, capacity, cfg, block_n, per_seq, with_starts)
    assert planned.args["BLOCK_B"] == 16
    table = torch.full((b * per_seq + 1,), -7, dtype=torch.int32, device=DEVICE)
    fixed = {} if with_starts else {"Starts": torch.zeros(1, dtype=torch.int32, device=DEVICE)}
    names = ("Lengths", "Starts", "SegCum") if with_starts else ("Lengths", "SegCum")
    launch = KernelLaunch(segment_offsets_entry, planned.grid, planned.num_warps, planned.num_stages, names,
                          planned.args, fixed)
    launch(*[x.to(DEVICE) for x in ((lengths, starts) if with_starts else (lengths,))], table)
    want = _segments_by_walking(lengths.tolist(), None if starts is None else starts.tolist(), t, capacity, window,
                                causal, pos_shift, block_n, per_seq)
    assert table.cpu().tolist() == want


# --- through decode_attention ---------------------------------------------------------------------


def _case(seed, groups, t, layout, *, dtype=torch.float32):
    """q (B, Hq, T, D), dense ragged caches (NaN outside [start, length)), the caches in `layout`
    (BHSD-view: a (B, S, Hkv, D) tensor viewed as (B, Hkv, S, D)), and (Hq, 2) sink logits."""
    gen = torch.Generator().manual_seed(seed)
    hq = HKV * groups
    q = torch.randn(B, hq, t, D, generator=gen)
    k, v = ragged_cache(gen, B, S, HKV, D, LENGTHS, STARTS)
    if layout == "BHSD-view":
        kc, vc, table = k.transpose(1, 2), v.transpose(1, 2), None
    else:
        kc, vc, table = layout_cache(k, v, layout, gen=gen)
    sinks = torch.randn(hq, 2, generator=gen)
    dev = lambda x: None if x is None else x.to(DEVICE, dtype if x.is_floating_point() else x.dtype)  # noqa: E731
    return (dev(q), dev(kc), dev(vc), dev(table), sinks.to(DEVICE)), (q, k, v, sinks)


GRID = {
    # name: (layout, GQA ratio, T, options, q as a (B, T, Hq, D) view)
    "bshd-plain": ("BSHD", 1, 1, {}, False),
    "bshd-gqa-window-sinks-lse": ("BSHD", 4, 3, dict(window=9, sinks=True, return_lse=True), True),
    "bhsd-softcap": ("BHSD", 2, 3, dict(softcap=2.0, scale=0.3), False),
    "bhsd-view-gqa-window-softcap": ("BHSD-view", 4, 1, dict(window=5, softcap=3.0, return_lse=True), False),
    "paged-gqa-all": ("paged", 2, 3, dict(window=12, softcap=3.0, sinks=True, return_lse=True), True),
    "paged-plain": ("paged", 1, 1, {}, False),
}


@pytest.mark.parametrize("name", sorted(GRID))
def test_native_decode_matches_the_oracle(name):
    layout, groups, t, opts, q_view = GRID[name]
    opts = dict(opts)
    (q, kc, vc, table, sinks), (q_ref, k_ref, v_ref, sinks_ref) = _case(sum(map(ord, name)), groups, t, layout)
    if q_view:  # a (B, T, Hq, D) tensor viewed as (B, Hq, T, D): read in place, out in the same memory order
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with_sinks = opts.pop("sinks", False)
    return_lse = opts.get("return_lse", False)
    cache_layout = "BHSD" if layout.startswith("BHSD") else "BSHD"
    before = cache_info()
    with sdpa_launcher("native"):
        result = decode_attention(q, kc, vc, LENGTHS.to(DEVICE), cache_starts=STARTS.to(DEVICE), block_table=table,
                                  sinks=sinks if with_sinks else None, cache_layout=cache_layout, **opts)
    assert cache_info() == before, "an XLA executable ran for a native call"
    out, lse = result if return_lse else (result, None)
    want, want_lse = decode_reference(q_ref.double(), k_ref, v_ref, LENGTHS, STARTS, window=opts.get("window"),
                                      softcap=opts.get("softcap"), scale=opts.get("scale"),
                                      sinks=sinks_ref.double() if with_sinks else None)
    assert out.shape == want.shape and out.dtype == q.dtype
    if q_view and t > 1:
        assert out.stride(1) < out.stride(2), "the output is not in q's (B, T, Hq, D) memory order"
    assert (out.double().cpu() - want).abs().max().item() < TOL
    if return_lse:
        lse = lse.double().cpu()
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse[finite] - want_lse[finite]).abs().max().item() < TOL


def test_kv_cache_attend_runs_natively():
    """KVCache (paged, pages from the pool) after a prefill and one appended token."""
    gen = torch.Generator().manual_seed(5)
    hq, d, t0 = 4, 16, 11
    cache = KVCache.paged(batch=2, max_len=32, kv_heads=HKV, head_dim=d, page_size=8, device=DEVICE)
    keys = torch.randn(2, HKV, t0 + 1, d, generator=gen).to(DEVICE)
    values = torch.randn(2, HKV, t0 + 1, d, generator=gen).to(DEVICE)
    cache.append(keys[:, :, :t0], values[:, :, :t0])
    cache.append(keys[:, :, t0:], values[:, :, t0:])
    q = torch.randn(2, hq, 1, d, generator=gen).to(DEVICE)
    before = cache_info()
    with sdpa_launcher("native"):
        out = cache.attend(q, window=6)
    assert cache_info() == before
    lengths = torch.full((2,), t0 + 1, dtype=torch.int32)
    want, _ = decode_reference(q.double().cpu(), keys.transpose(1, 2).cpu(), values.transpose(1, 2).cpu(), lengths,
                               None, window=6)
    assert (out.double().cpu() - want).abs().max().item() < TOL


def test_a_signature_is_planned_once(monkeypatch):
    """Calls of one signature reuse their launches (lengths changing between them)."""
    (q, kc, vc, table, _), (q_ref, k_ref, v_ref, _) = _case(3, 2, 1, "paged")
    planned = []
    real = native_decode._plan_launches
    monkeypatch.setattr(native_decode, "_plan_launches", lambda *a: planned.append(1) or real(*a))
    monkeypatch.setattr(native_decode, "_LAUNCHES", {})
    with sdpa_launcher("native"):
        for lengths in (LENGTHS, LENGTHS.clamp(max=17)):
            out = decode_attention(q, kc, vc, lengths.to(DEVICE), cache_starts=STARTS.to(DEVICE), block_table=table)
            want, _ = decode_reference(q_ref.double(), k_ref, v_ref, lengths, STARTS)
            assert (out.double().cpu() - want).abs().max().item() < TOL
    assert planned == [1]


# --- selection ------------------------------------------------------------------------------------


def test_xla_launcher_and_auto_on_cpu_keep_the_xla_path():
    (q, kc, vc, _, _), (q_ref, k_ref, v_ref, _) = _case(8, 2, 3, "BSHD")
    want, _ = decode_reference(q_ref.double(), k_ref, v_ref, LENGTHS, STARTS)
    launchers = ["xla"] + (["auto"] if DEVICE == "cpu" else [])  # on CPU "auto" keeps the XLA path
    for launcher in launchers:
        before = cache_info()
        with sdpa_launcher(launcher):
            out = decode_attention(q, kc, vc, LENGTHS.to(DEVICE), cache_starts=STARTS.to(DEVICE))
        after = cache_info()
        assert after.hits + after.misses > before.hits + before.misses, f"{launcher}: no XLA executable ran"
        assert (out.double().cpu() - want).abs().max().item() < TOL


def test_a_call_needing_gradients_runs_on_the_xla_path():
    """Under sdpa_launcher("native") too: the XLA path serves it, with the XLA formulation's gradients."""
    (q, kc, vc, table, sinks), (q_ref, k_ref, v_ref, sinks_ref) = _case(21, 2, 3, "paged")
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)
    q = q.clone().requires_grad_(True)
    sinks = sinks[:, 0].clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(4)
    cot = torch.randn(q.shape, generator=gen).to(DEVICE)
    before = cache_info()
    with sdpa_launcher("native"):
        out = decode_attention(q, kc, vc, LENGTHS.to(DEVICE), cache_starts=STARTS.to(DEVICE), block_table=table,
                               window=10, sinks=sinks)
    after = cache_info()
    assert after.hits + after.misses > before.hits + before.misses, "the XLA path did not run"
    (out * cot).sum().backward()
    leaves = [q_ref.double().requires_grad_(True), sinks_ref[:, 0].double().requires_grad_(True)]
    want, _ = decode_reference(leaves[0], k_ref, v_ref, LENGTHS, STARTS, window=10, sinks=leaves[1])
    (want * cot.double().cpu()).sum().backward()
    assert (out.detach().double().cpu() - want.detach()).abs().max().item() < TOL
    assert (q.grad.double().cpu() - leaves[0].grad).abs().max().item() < TOL
    assert (sinks.grad.double().cpu() - leaves[1].grad).abs().max().item() < TOL


@pytest.mark.parametrize("bad,match", [
    (dict(kernel="xla"), r"kernel='xla' runs through JAX"),
    (dict(dtype=torch.float64), r"float64 is not supported by the Triton decode kernels"),
])
def test_native_launcher_refuses_what_it_cannot_run(bad, match):
    (q, kc, vc, _, _), _ = _case(2, 1, 1, "BSHD")
    dtype = bad.pop("dtype", torch.float32)
    with sdpa_launcher("native"), pytest.raises(ValueError, match=r"sdpa_launcher\('native'\) cannot run .*" + match):
        decode_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), LENGTHS.to(DEVICE), **bad)


# --- the two launchers ----------------------------------------------------------------------------




@pytest.mark.parametrize("layout", ["BSHD", "paged"])
def test_native_and_jax_launchers_bit_identical(layout):
    """The torch launcher on a (B, T, Hq, D) view of q equals the JAX launcher bit for bit (out and
    LSE), and the float64 oracle; the launch cut segments into several partial results."""
    (q, kc, vc, table, sinks), (q_ref, k_ref, v_ref, _) = _case(33, 4, 3, layout)
    sinks = sinks[:, 0].contiguous()
    cfg = SmallLaunch(scale=D ** -0.5, programs=5, min_share=1, window=(20, -1), softcap=4.0, q_layout="BHTD", cache_layout=layout)
    lengths, starts = LENGTHS.to(DEVICE), STARTS.to(DEVICE)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    spec = native_decode.NativeDecodeSpec(cfg)
    out, lse = native_decode.DECODE_OP(spec, q_view, kc, vc, lengths, starts, table, sinks)
    assert native_decode._launches(spec, q_view, kc, vc, starts, table, sinks).part_shape[3] > 1

    j = lambda x: None if x is None else jnp.asarray(x.cpu().numpy())  # noqa: E731
    jout, jlse = decode_attention_triton(j(q), j(kc), j(vc), j(lengths), j(starts), j(table), j(sinks), cfg)
    assert torch.equal(out.cpu(), torch.from_numpy(np.array(jout)))
    assert torch.equal(lse.cpu(), torch.from_numpy(np.array(jlse)))
    want, _ = decode_reference(q_ref.double(), k_ref, v_ref, LENGTHS, STARTS, window=20, softcap=4.0,
                               sinks=sinks.double().cpu())
    assert (out.double().cpu() - want).abs().max().item() < TOL
