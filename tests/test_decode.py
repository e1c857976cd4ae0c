"""Decode attention on the CPU: the XLA path through the torch API over ragged batches in every cache
layout, the Pallas TPU kernel in interpret mode, the generic `attention()` interface, selection,
KVCache, errors, and the greedy-generation example. Oracle: the float64 reference of
tests/attention_reference.py (`decode_reference`: the cache's visible region from starts / lengths)."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attention_reference import assert_dtype_rule, decode_reference, from_bthd, reference
from decode_cases import layout_cache, ragged_cache

from jaxattn.jax_core import (AttentionInputs, AttentionMetadata, AttentionRegistry, attention, decode_attention,
                              mode_for)
from jaxattn.torch_api import AttentionInputError, KVCache
from jaxattn.torch_api import decode_attention as torch_decode

B, HKV, S, D = 4, 2, 48, 16
LENGTHS = torch.tensor([1, S, 29, 9], dtype=torch.int32)  # length 1 and a full cache
STARTS = torch.tensor([0, 0, 6, 2], dtype=torch.int32)

FEATURES = {
    "plain": {},
    "window": dict(window=5),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=11, softcap=3.0, sinks=True, scale=0.3),
}
# every layout x GQA ratio (1, 4, 8) x q_len (1, 4), each with one feature set, plus "all" per layout
GRID = [(layout, groups, t, name)
        for layout in ("BSHD", "BHSD", "paged")
        for i, (groups, t) in enumerate([(1, 1), (4, 4), (8, 1), (1, 4), (4, 1), (8, 4)])
        for name in (list(FEATURES)[(i + len(layout)) % 4],)]
GRID += [(layout, 4, 4, "all") for layout in ("BSHD", "BHSD", "paged")]
# the default run keeps "all" per layout and the first case of each single feature; --thorough the rest
_KEPT = {case for case in GRID if case[3] == "all"} | {next(c for c in GRID if c[3] == f) for f in FEATURES}
GRID = [case if case in _KEPT else pytest.param(*case, marks=pytest.mark.thorough) for case in GRID]


def _case(seed, groups, t, *, dtype=torch.float32, dv=D, starts=STARTS, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    hq = HKV * groups
    q = torch.randn(B, hq, t, D, generator=gen).to(dtype)
    k, v = ragged_cache(gen, B, S, HKV, D, lengths, starts, dv=dv, dtype=dtype)
    sinks = torch.randn(hq, generator=gen)
    return gen, q, k, v, sinks


def _feature_kwargs(name, sinks):
    kw = dict(FEATURES[name])
    kw["sinks"] = sinks if kw.get("sinks") else None
    return kw


def _close(got, want, tol):
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"


@pytest.mark.parametrize("layout,groups,t,feature", GRID, ids=lambda x: str(x))
def test_xla_matches_the_oracle_over_ragged_batches(layout, groups, t, feature):
    gen, q, k, v, sinks = _case(hash((layout, groups, t, feature)) % 1000, groups, t)
    kw = _feature_kwargs(feature, sinks)
    kc, vc, table = layout_cache(k, v, layout, gen=gen)
    out, lse = torch_decode(q, kc, vc, LENGTHS, cache_starts=STARTS, block_table=table,
                            cache_layout="BHSD" if layout == "BHSD" else "BSHD", return_lse=True, **kw)
    want, want_lse = decode_reference(q, k, v, LENGTHS, STARTS, **kw)
    assert out.shape == (B, HKV * groups, t, D) and out.dtype == torch.float32
    _close(out, want, 2e-6)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    _close(lse[finite], want_lse[finite], 2e-6)


def test_xla_with_window_softcap_and_sinks_matches_the_oracle():
    _, q, k, v, sinks = _case(3, 4, 4)
    kw = dict(window=7, softcap=4.0, sinks=sinks)
    out, lse = torch_decode(q, k, v, LENGTHS, cache_starts=STARTS, return_lse=True, **kw)
    want, want_lse = decode_reference(q, k, v, LENGTHS, STARTS, **kw)
    _close(out, want, 2e-6)
    _close(lse, want_lse, 2e-6)  # sinks: every row has a finite LSE


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.thorough)])
def test_low_precision_on_cpu(dtype):
    gen, q, k, v, sinks = _case(11, 4, 4, dtype=dtype)
    kc, vc, table = layout_cache(k, v, "paged", gen=gen)
    out = torch_decode(q, kc, vc, LENGTHS, cache_starts=STARTS, block_table=table, window=9, sinks=sinks)
    want, _ = decode_reference(q, k, v, LENGTHS, STARTS, window=9, sinks=sinks)
    low, _ = decode_reference(q, k, v, LENGTHS, STARTS, window=9, sinks=sinks, dtype=dtype)
    assert out.dtype == dtype
    assert_dtype_rule("out", out, want, low, floor=1e-3)


def test_empty_sequences_give_zeros():
    lengths = torch.tensor([0, 5, 7, 1], dtype=torch.int32)
    starts = torch.tensor([0, 5, 9, 1], dtype=torch.int32)  # start == length, start > length
    _, q, k, v, sinks = _case(5, 4, 1, lengths=lengths, starts=starts)
    out, lse = torch_decode(q, k, v, lengths, cache_starts=starts, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = torch_decode(q, k, v, lengths, cache_starts=starts, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sinks[None, :, None].expand_as(lse))


def test_dv_differs_and_multiple_sinks_per_head():
    gen, q, k, v, _ = _case(8, 4, 4, dv=24)
    sinks = torch.randn(HKV * 4, 3, generator=gen)
    out = torch_decode(q, k, v, LENGTHS, cache_starts=STARTS, sinks=sinks)
    want, _ = decode_reference(q, k, v, LENGTHS, STARTS, sinks=sinks)
    assert out.shape == (B, 8, 4, 24)
    _close(out, want, 2e-6)


def test_gradients_follow_the_reference():
    gen, q, k, v, sinks = _case(13, 4, 4)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = torch_decode(*leaves[:3], LENGTHS, cache_starts=STARTS, window=9, softcap=5.0, sinks=leaves[3])
    cot = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, cot)
    ref_leaves = [x.double().clone().requires_grad_() for x in (q, k, v, sinks)]
    want, _ = decode_reference(*ref_leaves[:3], LENGTHS, STARTS, window=9, softcap=5.0, sinks=ref_leaves[3])
    ref_grads = torch.autograd.grad(want, ref_leaves, cot.double())
    for g, rg in zip(grads, ref_grads):
        _close(g, rg, 1e-5)


# ------------------------------------------------------------------------------- generic interface


@pytest.mark.parametrize("causal,alignment,window,t,layout", [
    (True, "bottom_right", (4, 1), 4, "BTHD"), pytest.param(True, "top_left", None, 4, "BHTD", marks=pytest.mark.thorough),
    pytest.param(False, "top_left", (3, 2), 4, "BTHD", marks=pytest.mark.thorough), (False, "bottom_right", (5, -1), 1, "BHTD"),
])
def test_attention_interface_matches_the_oracle(causal, alignment, window, t, layout):
    keys = jax.random.split(jax.random.key(t + 7 * causal), 4)
    b, hq, hk, s, d = 2, 8, 2, 37, 16
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k, v = (jax.random.normal(x, (b, s, hk, d)) for x in keys[1:3])
    sinks = jax.random.normal(keys[3], (hq,))
    if layout == "BHTD":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    kw = dict(causal=causal, causal_alignment=alignment, sliding_window=window, logits_soft_cap=3.0, softmax_aux=sinks,
              return_lse=True, layout=layout)
    got = jax.jit(lambda q, k, v: attention(q, k, v, implementation="decode", **kw))(q, k, v)
    bthd = (lambda x: x) if layout == "BTHD" else (lambda x: jnp.swapaxes(x, 1, 2))
    want, want_lse = reference(*(from_bthd(bthd(x)) for x in (q, k, v)), causal=causal, alignment=alignment,
                               window=window, softcap=3.0, sinks=torch.from_numpy(np.asarray(sinks, np.float64)))
    _close(from_bthd(bthd(got.attention_outputs)), want, 2e-6)
    _close(torch.from_numpy(np.asarray(got.lse, np.float64)), want_lse, 2e-6)  # sinks: every LSE is finite


def test_mode_and_automatic_selection():
    assert mode_for(1) == mode_for(4, 100) == mode_for(16, 17) == "__autoregressive__"
    assert mode_for(4) == mode_for(17, 100) == mode_for(8, 8) == "__train__"
    impl = AttentionRegistry.get("decode")(AttentionMetadata())
    assert impl.get_mode(jnp.zeros((2, 4, 8, 16)), kv_len=64) == "__autoregressive__"
    assert impl.get_mode(jnp.zeros((2, 4, 8, 16))) == "__train__"
    assert AttentionRegistry.get("autoregressive_decodeattn") is AttentionRegistry.get("decode")

    def inputs(q_len, kv_len, platform, **kw):
        return AttentionInputs(batch=2, q_len=q_len, kv_len=kv_len, num_q_heads=8, num_kv_heads=2, head_dim=64,
                               value_head_dim=64, dtype="bfloat16", platform=platform, backend=platform,
                               features=frozenset({"gqa"}) | kw.get("features", frozenset()))

    decode = AttentionRegistry.get("decode")
    assert AttentionRegistry.select(inputs(1, 4096, "cpu")) is not decode  # CPU keeps sdpa / vanilla
    with pytest.raises(ValueError, match="q_len=32 > 16"):
        AttentionRegistry.select(inputs(32, 4096, "cpu"), implementation="decode")
    with pytest.raises(ValueError, match="feature 'bias' not supported"):
        AttentionRegistry.select(inputs(1, 64, "cpu", features=frozenset({"bias"})), implementation="decode")


def test_gpu_selection_takes_decode_for_few_queries(monkeypatch):
    """Selection for a GPU call. The Triton kernel needs triton and jax-triton installed; jax-triton
    (not in the test extra) is stood in for by the interpreter stand-in where missing, since selection
    only asks whether it is importable. Without triton the decode kernel cannot be selected at all."""
    pytest.importorskip("triton", reason="triton is needed for decode's GPU kernel to be selectable")
    if importlib.util.find_spec("jax_triton") is None:
        import jax_triton_interpret

        monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())

    def inputs(q_len, features=frozenset()):
        return AttentionInputs(batch=2, q_len=q_len, kv_len=4096, num_q_heads=8, num_kv_heads=2, head_dim=64,
                               value_head_dim=64, dtype="bfloat16", platform="gpu", backend="cuda",
                               features=frozenset({"gqa"}) | features)

    decode = AttentionRegistry.get("decode")
    assert decode.not_supported_reasons(inputs(1)) == []
    assert AttentionRegistry.select(inputs(1)) is decode
    assert AttentionRegistry.select(inputs(4, frozenset({"causal_bottom_right"}))) is decode
    assert AttentionRegistry.select(inputs(32)) is not decode  # a prefill
    assert AttentionRegistry.select(inputs(1, frozenset({"bias"}))) is not decode


# ----------------------------------------------------------------------------------- TPU (Pallas)


@pytest.mark.parametrize("layout,groups,t,feature", [
    ("BSHD", 4, 4, "all"), ("paged", 8, 1, "all"),
    pytest.param("BHSD", 1, 4, "window", marks=pytest.mark.thorough), pytest.param("paged", 4, 4, "plain", marks=pytest.mark.thorough),
])
def test_pallas_tpu_kernel_in_interpret_mode(layout, groups, t, feature):
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    gen, q, k, v, sinks = _case(17 + groups, groups, t)
    kw = _feature_kwargs(feature, sinks)
    kc, vc, table = layout_cache(k, v, layout, gen=gen)
    md = AttentionMetadata(platform="tpu", backend="tpu", softmax_scale=kw.get("scale"))
    with pltpu.force_tpu_interpret_mode():
        out = decode_attention(
            jnp.asarray(q.numpy()).swapaxes(1, 2), jnp.asarray(kc.numpy()), jnp.asarray(vc.numpy()),
            jnp.asarray(LENGTHS.numpy()), starts=jnp.asarray(STARTS.numpy()),
            block_table=None if table is None else jnp.asarray(table.numpy()), sliding_window=kw.get("window"),
            logits_soft_cap=kw.get("softcap"), softmax_aux=None if kw["sinks"] is None else jnp.asarray(sinks.numpy()),
            cache_layout="paged" if table is not None else layout, return_lse=True, metadata=md)
    want, want_lse = decode_reference(q, k, v, LENGTHS, STARTS, **kw)
    _close(torch.from_numpy(np.array(out.attention_outputs)).transpose(1, 2), want, 2e-6)
    lse = torch.from_numpy(np.array(out.lse))
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    _close(lse[finite], want_lse[finite], 2e-6)


# ------------------------------------------------------------------------------------------ KVCache


@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_appends_in_place(paged):
    gen = torch.Generator().manual_seed(21 + paged)
    b, hq, hkv, d, cap = 3, 8, 2, 16, 40
    cache = (KVCache.paged(b, cap, hkv, d, page_size=8) if paged else KVCache.contiguous(b, cap, hkv, d))
    cache.key.fill_(float("nan"))
    cache.value.fill_(float("nan"))
    pointers = (cache.key.data_ptr(), cache.value.data_ptr())
    cache.set_starts([2, 0, 5])
    ks, vs = [], []
    for t in (7, 1, 1, 4):  # a prefill, two tokens, a speculative block
        k, v = torch.randn(b, hkv, t, d, generator=gen), torch.randn(b, hkv, t, d, generator=gen)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
        q = torch.randn(b, hq, t, d, generator=gen)
        dense_k = torch.cat(ks, dim=2).transpose(1, 2)  # (B, L, Hkv, D)
        dense_v = torch.cat(vs, dim=2).transpose(1, 2)
        lengths = torch.full((b,), dense_k.shape[1], dtype=torch.int32)
        want, _ = decode_reference(q, dense_k, dense_v, lengths, cache.starts)
        _close(cache.attend(q), want, 2e-6)
    assert cache.host_lengths == [13] * b and torch.equal(cache.lengths, torch.full((b,), 13, dtype=torch.int32))
    assert (cache.key.data_ptr(), cache.value.data_ptr()) == pointers
    written = (~torch.isnan(cache.key)).any(-1).any(-1).sum().item()
    assert written == b * 13  # exactly the appended slots were written
    if paged:
        assert sorted(cache.block_table[:, :2].flatten().tolist()) == list(range(6))  # 2 pages each, from the pool
    with pytest.raises(AttentionInputError, match="beyond the capacity 40"):
        cache.append(torch.randn(b, hkv, 28, d), torch.randn(b, hkv, 28, d))
    cache.reset()
    assert cache.host_lengths == [0] * b and int(cache.lengths.sum()) == 0


def test_kv_cache_page_pool_exhaustion_and_bad_appends():
    cache = KVCache.paged(2, 64, 2, 16, page_size=8, num_pages=3)
    cache.append(torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))  # one page each
    with pytest.raises(AttentionInputError, match="page pool \\(3 pages\\) is exhausted"):
        cache.append(torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))
    with pytest.raises(AttentionInputError, match=r"key: expected a torch.float32 tensor of shape \(B, Hkv, T, D\)"):
        cache.append(torch.randn(2, 3, 1, 16), torch.randn(2, 2, 1, 16))
    with pytest.raises(AttentionInputError, match="page_size=0"):
        KVCache.paged(2, 64, 2, 16, page_size=0)


def test_cache_buffers_are_read_zero_copy(monkeypatch):
    import jaxattn.bridge.dlpack as dlpack

    seen = []
    original = dlpack.importable

    def spy(t):
        out = original(t)
        seen.append((t.data_ptr(), out.data_ptr()))
        return out

    monkeypatch.setattr(dlpack, "importable", spy)
    gen = torch.Generator().manual_seed(2)
    cache = KVCache.paged(2, 64, 2, 16, page_size=8)
    cache.append(torch.randn(2, 2, 5, 16, generator=gen), torch.randn(2, 2, 5, 16, generator=gen))
    seen.clear()
    cache.attend(torch.randn(2, 4, 1, 16, generator=gen))
    pointers = {before for before, _ in seen}
    assert {cache.key.data_ptr(), cache.value.data_ptr()} <= pointers
    assert all(before == after for before, after in seen)  # nothing was copied


# ------------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    _, q, k, v, sinks = _case(1, 4, 1)
    good = dict(cache_starts=STARTS)
    cases = [
        (dict(q=q[0]), AttentionInputError, r"q: expected a non-empty 4-D tensor \(B, Hq, T, D\)"),
        (dict(q=torch.randn(B, 8, 17, D)), AttentionInputError, "17 queries per sequence.*at most 16"),
        (dict(q=q.double()), AttentionInputError, "must share a dtype"),
        (dict(v_cache=v[:, :40]), AttentionInputError, "must agree on all but the last dim"),
        (dict(k_cache=k[..., :8]), AttentionInputError, "k_cache: head dim 8 != q head dim 16"),
        (dict(q=torch.randn(B, 3, 1, D)), AttentionInputError, "3 heads is not a multiple of the cache's 2 KV heads"),
        (dict(cache_seqlens=LENGTHS.float()), AttentionInputError, r"cache_seqlens: expected an int32 tensor of shape \(B,\)"),
        (dict(cache_seqlens=LENGTHS[:2]), AttentionInputError, r"shape \(B,\) = \(4,\)"),
        (dict(cache_seqlens=torch.tensor([1, 49, 2, 3], dtype=torch.int32)), AttentionInputError, r"lie in \[0, 48\]"),
        (dict(cache_starts=torch.tensor([0, -1, 0, 0], dtype=torch.int32)), AttentionInputError, "must be >= 0"),
        (dict(window=-1), AttentionInputError, "window=-1"),
        (dict(window=(4, 0)), AttentionInputError, "window=\\(4, 0\\)"),
        (dict(softcap=0.0), AttentionInputError, "softcap=0.0"),
        (dict(sinks=sinks[:3]), AttentionInputError, r"sinks: expected a \(Hq,\) or \(Hq, n\)"),
        (dict(scale=float("inf")), AttentionInputError, "scale=inf"),
        (dict(cache_layout="BTHD"), AttentionInputError, "cache_layout='BTHD'"),
        (dict(block_table=torch.zeros(4, 6, dtype=torch.int32), cache_layout="BHSD"), AttentionInputError, "paged caches"),
        (dict(block_table=torch.zeros(3, 6, dtype=torch.int32)), AttentionInputError, r"block_table: expected .* B=4"),
        (dict(kernel="cuda"), AttentionInputError, "kernel='cuda'"),
        (dict(kernel="pallas"), ValueError, "Pallas kernel runs on tpu, not cpu"),
        (dict(kernel="triton"), ValueError, "Triton kernel runs on gpu, not cpu"),
    ]
    for change, error, pattern in cases:
        args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=LENGTHS, **good)
        args.update(change)
        with pytest.raises(error, match=pattern):
            torch_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        torch_decode(q.numpy(), k, v, LENGTHS)


def test_jax_core_argument_errors():
    q = jnp.zeros((2, 1, 4, 16))
    k = jnp.zeros((2, 32, 2, 16))
    lengths = jnp.array([3, 4])
    with pytest.raises(ValueError, match=r"lengths: expected an integer array of shape \(B,\) = \(2,\)"):
        decode_attention(q, k, k, jnp.array([3.0, 4.0]))
    with pytest.raises(ValueError, match="block_table: required with cache_layout='paged'"):
        decode_attention(q, k, k, lengths, cache_layout="paged")
    with pytest.raises(ValueError, match="sliding_window=-2"):
        decode_attention(q, k, k, lengths, sliding_window=-2)
    with pytest.raises(ValueError, match="key_cache: batch 2 != query batch 3"):
        decode_attention(jnp.zeros((3, 1, 4, 16)), k, k, jnp.array([1, 2, 3]))
    with jax.enable_x64(True), pytest.raises(ValueError, match="float64 is not supported by the triton kernel"):
        decode_attention(q.astype(jnp.float64), k.astype(jnp.float64), k.astype(jnp.float64), lengths, kernel="triton",
                         metadata=AttentionMetadata(platform="gpu"))


# ------------------------------------------------------------------------------------------ example


def test_generate_tiny_example_matches_torch_sdpa(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        import generate_tiny
    finally:
        sys.path.pop(0)
    assert generate_tiny.main(["--device", "cpu", "--steps", "6"]) == 0
    assert capsys.readouterr().out.count("tokens match torch SDPA") == 2
