"""The flash implementation's GPU path (JAX wrapper + custom VJP + Triton kernels) on the CPU.

`jax_triton.triton_call` is replaced by an interpreter stand-in (tests/jax_triton_interpret.py), so
segment ids, varlen packing and dropout run through exactly the code a GPU runs, on small shapes.
The oracle is a float64 torch computation of the documented math (dropout: the kernels' own keep
mask, materialised by `dropout_mask_kernel`, applied in float64). On a CUDA machine the same tests
run the compiled kernels (float32 inputs, tf32x3 dots): through jax-triton where JAX runs on the GPU
with it installed, through the stand-in otherwise.
"""


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import (assert_close_finite, from_bthd, reference, reference_grads,  # noqa: E402
                                 varlen_reference)
from thorough_grid import grid  # noqa: E402

from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402


ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _jnp(t):
    return jnp.asarray(t.numpy().astype(np.float32))


def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def _run(q, k, v, cot, *, extras, cfg, sinks=None):
    """Flash out, lse and grads (dq, dk, dv, dsinks) of sum(out * cot); torch BHTD in, torch out."""
    arrays = [_jnp(x) for x in (q, k, v)]
    if cfg.layout == "BTHD":
        arrays = [jnp.swapaxes(x, 1, 2) for x in arrays]
    cot_j = _jnp(cot) if cfg.layout == "BHTD" else jnp.swapaxes(_jnp(cot), 1, 2)
    sinks_j = None if sinks is None else _jnp(sinks)

    def loss(q, k, v, sinks):
        out, lse = fj.flash_attention_triton(q, k, v, None, None, sinks, extras, cfg)
        return jnp.sum(out * cot_j), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*arrays, sinks_j)
    back = (lambda x: x) if cfg.layout == "BHTD" else (lambda x: jnp.swapaxes(x, 1, 2))
    return _t(back(out)), _t(lse), [_t(back(g)) for g in grads[:3]] + [None if grads[3] is None else _t(grads[3])]


def _ref_grads(q, k, v, cot, sinks=None, **kw):
    """(out, lse, [dq, dk, dv, dsinks]) of the float64 oracle (`cu_seqlens=(cu_q, cu_k)`: packed)."""
    out, lse, (dq, dk, dv, _, dsinks) = reference_grads(q, k, v, cot, sinks=sinks, **kw)
    return out, lse, [dq, dk, dv, dsinks]


_close = assert_close_finite


# --------------------------------------------------------------------------------------------- segments

SEGMENT_PATTERNS = {
    # packed documents, then padding marked 0 (not sorted)
    "packed-padded": (lambda l, s: ([1] * 40 + [2] * 70 + [3] * (l - 130) + [0] * 20,
                                    [1] * 60 + [2] * 50 + [3] * (s - 130) + [0] * 20)),
    # interleaved ids: spans cover everything, only the equality check separates them
    "interleaved": (lambda l, s: ([i % 3 for i in range(l)], [(i // 7) % 3 for i in range(s)])),
    # one id per 64-row query block, contiguous key runs: the kernels' span-as-window path
    "block-runs": (lambda l, s: ([1] * 64 + [2] * 64 + [3] * (l - 128), [1] * 50 + [2] * 90 + [3] * (s - 140))),
    # a query id absent from the keys: those rows see nothing
    "absent": (lambda l, s: ([5] * 30 + [1] * (l - 30), [1] * s)),
}


@pytest.mark.parametrize("causal,pattern", grid([False, True], sorted(SEGMENT_PATTERNS),
                                                keep=[(True, "packed-padded")]))
def test_segment_ids_forward_and_gradients(pattern, causal):
    gen = torch.Generator().manual_seed(hash(pattern) % 1000 + causal)
    B, Hq, Hk, L, S, D = 2, 4, 2, 150, 170, 32
    q, k, v, cot = _rand(gen, B, Hq, L, D), _rand(gen, B, Hk, S, D), _rand(gen, B, Hk, S, D), _rand(gen, B, Hq, L, D)
    q_ids, kv_ids = (torch.tensor(x) for x in SEGMENT_PATTERNS[pattern](L, S))
    q_ids = torch.stack([q_ids, q_ids.roll(9 if pattern != "block-runs" else 0)])  # batch rows differ
    kv_ids = torch.stack([kv_ids, kv_ids.roll(4)])
    extras = fj.FlashExtras(segment_ids=(jnp.asarray(q_ids.numpy()), jnp.asarray(kv_ids.numpy())))
    cfg = fj.FlashConfig(scale=D ** -0.5, causal=causal, diag_offset=S - L, layout="BHTD")
    out, lse, grads = _run(q, k, v, cot, extras=extras, cfg=cfg)
    mask = (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    r_out, r_lse, r_grads = _ref_grads(q, k, v, cot, causal=causal, alignment="bottom_right", mask=mask)
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    for name, g, rg in zip("qkv", grads, r_grads):
        _close(f"d{name}", g, rg)


def test_segment_tables_spans():
    q_ids = jnp.array([[3, 3, 1, 1, 7]])
    kv_ids = jnp.array([[1, 3, 1, 3, 0, 0]])
    seg_q, seg_k = fj.segment_tables(q_ids, kv_ids)
    # key spans of ids 3, 3, 1, 1 and (absent) 7
    # key spans of ids 3, 3, 1, 1 (not contiguous runs) and 7 (>= S: the whole span)
    np.testing.assert_array_equal(seg_q[0], [[3, 3, 1, 1, 7], [1, 1, 0, 0, 0], [4, 4, 3, 3, 6], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(seg_k[0], [[1, 3, 1, 3, 0, 0], [2, 0, 2, 0, 0, 0], [4, 2, 4, 2, 0, 0],
                                             [1, 1, 1, 1, 1, 1]])
    # out-of-range ids (negative, >= S) get the whole span, marked not contiguous
    seg_q, _ = fj.segment_tables(jnp.array([[-1, 9, 2]]), jnp.array([[2, 2, -1]]))
    np.testing.assert_array_equal(seg_q[0, 1:], [[0, 0, 0], [3, 3, 2], [0, 0, 1]])
    # an in-range id absent from the keys: an empty span, trivially contiguous
    seg_q, _ = fj.segment_tables(jnp.array([[1, 0]]), jnp.array([[0, 0, 0]]))
    np.testing.assert_array_equal(seg_q[0, 1:], [[0, 0], [0, 3], [1, 1]])


def _spans_by_rule(ids, other):
    """Plain-Python spans: per id, [lo, hi) of its positions in `other`, and whether they fill it."""
    n, rows = len(other), []
    for i in ids:
        if not 0 <= i < n:
            rows.append((i, 0, n, 0))
            continue
        where = [j for j, o in enumerate(other) if o == i]
        lo, hi = (where[0], where[-1] + 1) if where else (0, 0)
        rows.append((i, lo, hi, int(len(where) == hi - lo)))
    return np.array(rows, dtype=np.int32).T


@pytest.mark.parametrize("b,l,s", [(2, 97, 300), (3, 300, 41), (1, 1, 1)])
def test_segment_table_kernel_reads_strided_ids(b, l, s):
    """The torch launcher's entry (runtime sizes and strides) on non-contiguous int64 ids, against
    the rule written out in Python."""
    from jaxattn.jax_core.kernels.segment_table_triton import (segment_table_entry_dynamic, segment_table_launch,
                                                               segment_table_shapes)

    gen = torch.Generator().manual_seed(b * 1000 + l + s)
    q_ids = torch.randint(-1, 5, (b, 2 * l), generator=gen)[:, ::2].sort(dim=1).values
    kv_ids = torch.randint(-2, 7, (s, b), generator=gen).t()  # column-major: strides (1, b)
    tables = [torch.full(shape, -7, dtype=torch.int32) for shape in segment_table_shapes(b, l, s)]
    grid, _, args = segment_table_launch(b, l, s, q_ids.stride(), kv_ids.stride())
    segment_table_entry_dynamic[grid](q_ids, kv_ids, *tables, **args)
    for row in range(b):
        qi, ki = q_ids[row].tolist(), kv_ids[row].tolist()
        np.testing.assert_array_equal(tables[0][row].numpy(), _spans_by_rule(qi, ki))
        np.testing.assert_array_equal(tables[1][row].numpy(), _spans_by_rule(ki, qi))


# --------------------------------------------------------------------------------------------- varlen

def _varlen_case(gen, lens_q, lens_k, tail_q, tail_k, Hq=4, Hk=2, D=24, Dv=16):
    tq, tk = sum(lens_q) + tail_q, sum(lens_k) + tail_k
    q, k, v = _rand(gen, 1, Hq, tq, D), _rand(gen, 1, Hk, tk, D), _rand(gen, 1, Hk, tk, Dv)
    cot = _rand(gen, 1, Hq, tq, Dv)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, k, v, cot, cu_q, cu_k


VARLEN_CASES = {
    "plain": dict(),
    "causal-top-left": dict(causal=True),
    "causal-bottom-right": dict(causal=True, alignment="bottom_right"),
    "window-softcap-sinks": dict(window=(6, 2), alignment="bottom_right", softcap=3.0, sinks=True),
}


@pytest.mark.parametrize("case,layout", grid(sorted(VARLEN_CASES), ["BHTD", "BTHD"],
                                             keep=[("causal-bottom-right", "BHTD"), ("window-softcap-sinks", "BTHD")]))
def test_varlen_forward_and_gradients(case, layout):
    kw = dict(VARLEN_CASES[case])
    gen = torch.Generator().manual_seed(len(case) * 7 + len(layout))
    lens_q, lens_k = [5, 1, 70, 9], [7, 3, 66, 81]  # L_n != S_n, a length-1 sequence, multi-block ones
    q, k, v, cot, cu_q, cu_k = _varlen_case(gen, lens_q, lens_k, tail_q=6, tail_k=3)
    sinks = _rand(gen, q.shape[1]) if kw.pop("sinks", False) else None
    alignment = kw.get("alignment", "top_left")
    cfg = fj.FlashConfig(
        scale=q.shape[-1] ** -0.5, causal=kw.get("causal", False), window=kw.get("window") or (-1, -1),
        softcap=kw.get("softcap"), layout=layout, varlen=(max(lens_q), max(lens_k)),
        varlen_bottom_right=alignment == "bottom_right",
    )
    extras = fj.FlashExtras(cu_seqlens=(jnp.asarray(cu_q), jnp.asarray(cu_k)))
    out, lse, grads = _run(q, k, v, cot, extras=extras, cfg=cfg, sinks=sinks)
    r_out, r_lse, r_grads = _ref_grads(q, k, v, cot, sinks=sinks, cu_seqlens=(cu_q, cu_k), **kw)
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    for name, g, rg in zip(["dq", "dk", "dv", "dsinks"], grads, r_grads):
        if rg is not None:
            _close(name, g, rg)


# --------------------------------------------------------------------------------------------- dropout

def _keep_mask(seed, bh, l, s, p):
    return torch.from_numpy(np.array(fj.dropout_keep_mask(jnp.asarray(seed, jnp.int32), bh, l, s, p)))


def test_dropout_mask_is_bernoulli_and_seeded():
    a = _keep_mask([123, 456], 4, 64, 96, 0.3)
    b = _keep_mask([123, 456], 4, 64, 96, 0.3)
    c = _keep_mask([124, 456], 4, 64, 96, 0.3)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.2
    assert abs(a.float().mean().item() - 0.7) < 0.02
    assert abs(a[0].float().mean() - a[3].float().mean()) < 0.05 and not torch.equal(a[0], a[1])


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.thorough), True])
def test_dropout_forward_and_gradients(causal):
    gen = torch.Generator().manual_seed(11 + causal)
    B, Hq, Hk, L, S, D, p = 2, 2, 1, 97, 75, 32, 0.25
    q, k, v, cot = _rand(gen, B, Hq, L, D), _rand(gen, B, Hk, S, D), _rand(gen, B, Hk, S, D), _rand(gen, B, Hq, L, D)
    seed = [987654, -12345]
    keep = _keep_mask(seed, B * Hq, L, S, p).reshape(B, Hq, L, S)
    extras = fj.FlashExtras(seed=jnp.asarray(seed, jnp.int32))
    cfg = fj.FlashConfig(scale=D ** -0.5, causal=causal, dropout_p=p, layout="BHTD")
    out, lse, grads = _run(q, k, v, cot, extras=extras, cfg=cfg)

    r_out, r_lse, r_grads = _ref_grads(q, k, v, cot, causal=causal, dropout_keep=keep, dropout_p=p)
    _close("out", out, r_out)
    _close("lse", lse, r_lse)  # dropout never changes the normaliser
    for name, g, rg in zip("qkv", grads, r_grads):
        _close(f"d{name}", g, rg)


@pytest.mark.thorough  # dropout and varlen are each tested above
def test_dropout_with_varlen_uses_packed_coordinates():
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k, p = [20, 45], [33, 45], 0.4
    q, k, v, cot, cu_q, cu_k = _varlen_case(gen, lens_q, lens_k, tail_q=0, tail_k=0, Hq=2, Hk=2)
    seed = [42, 7]
    keep = _keep_mask(seed, q.shape[1], q.shape[2], k.shape[2], p).reshape(1, q.shape[1], q.shape[2], k.shape[2])
    cfg = fj.FlashConfig(scale=q.shape[-1] ** -0.5, causal=True, layout="BTHD", varlen=(64, 64),
                         varlen_bottom_right=True, dropout_p=p)
    extras = fj.FlashExtras(cu_seqlens=(jnp.asarray(cu_q), jnp.asarray(cu_k)), seed=jnp.asarray(seed, jnp.int32))
    out, lse, grads = _run(q, k, v, cot, extras=extras, cfg=cfg)
    r_out, r_lse, r_grads = _ref_grads(q, k, v, cot, cu_seqlens=(cu_q, cu_k), dropout_keep=keep, dropout_p=p,
                                       causal=True, alignment="bottom_right")
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    for name, g, rg in zip(["dq", "dk", "dv"], grads, r_grads):
        _close(name, g, rg)


# --------------------------------------------------------------------------------------------- dispatch

@pytest.mark.thorough  # the same path per feature: test_conformance.py's flash-jax cases
def test_flash_gpu_path_through_attention_matches_the_oracle():
    """`attention(implementation="flash")` on the GPU path, packed and with segment ids, equals the
    float64 oracle."""
    from jaxattn.jax_core import AttentionMetadata, attention

    md = AttentionMetadata(platform="gpu", backend="cuda")
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (1, 70, 4, 32))
    k, v = (jax.random.normal(kk, (1, 90, 2, 32)) for kk in ks[1:3])
    cu = (jnp.array([0, 10, 70], jnp.int32), jnp.array([0, 25, 90], jnp.int32))
    ids = (jnp.array([[1] * 30 + [2] * 40]), jnp.array([[1] * 50 + [2] * 40]))
    qt, kt, vt = (from_bthd(x) for x in (q, k, v))
    ids_t = tuple(torch.from_numpy(np.array(x)) for x in ids)
    cases = [
        (dict(cu_seqlens=cu, causal=True, causal_alignment="bottom_right", max_seqlen=(64, 128)),
         varlen_reference(qt, kt, vt, *(np.asarray(c) for c in cu), causal=True, alignment="bottom_right")[0]),
        (dict(segment_ids=ids, causal=True), reference(qt, kt, vt, segment_ids=ids_t, causal=True)[0]),
    ]
    for kw, want in cases:
        got = attention(q, k, v, implementation="flash", metadata=md, **kw)
        _close("out", from_bthd(got.attention_outputs), want, 2e-5)
    drop = md.replace(dropout_prob=0.3)  # same rng -> same mask; another rng -> another
    a, b = (attention(q, k, v, implementation="flash", metadata=drop, dropout_rng=ks[3]).attention_outputs for _ in "ab")
    c = attention(q, k, v, implementation="flash", metadata=drop, dropout_rng=jax.random.fold_in(ks[3], 1))
    np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(a - c.attention_outputs).max()) > 0.1


def test_cuda_selection_prefers_flash_except_long_sequences_with_small_heads():
    from jaxattn.jax_core import AttentionInputs
    from jaxattn.jax_core.registry import AttentionRegistry, platform_order

    def inputs(l, d, features=(), backend="cuda"):
        return AttentionInputs(2, l, l, 8, 8, d, d, "bfloat16", "gpu", backend, frozenset(features))

    assert platform_order(inputs(8192, 128))[:2] == ("sdpa", "flash")
    assert platform_order(inputs(1024, 128))[:2] == ("flash", "sdpa")
    assert platform_order(inputs(8192, 256))[:2] == ("flash", "sdpa")
    assert platform_order(inputs(1024, 64, backend="rocm"))[:2] == ("sdpa", "flash")
    # a flash-only feature goes to flash even where cuDNN would be first
    assert AttentionRegistry.select(inputs(8192, 128, {"softcap"})).canonical_name() == "flash"
