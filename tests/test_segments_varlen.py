"""Segment ids and varlen packing in jax_core (masks, `vanilla`, selection, meshes, errors).

The oracle is the float64 reference of tests/attention_reference.py: its visibility builders for the
masks, `reference` with segment ids, and `varlen_reference` (each packed sequence on its own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from attention_reference import (from_bthd, reference, reference_grads, segment_visibility, to_bthd, varlen_reference,
                                 varlen_visibility, visibility)

from jaxattn.jax_core import AttentionInputs, AttentionMetadata, AttentionRegistry, PartitionAxis, attention
from jaxattn.jax_core.masks import segment_mask, varlen_mask


# ----------------------------------------------------------------------------------------------
# the oracle on (B, T, H, D) arrays
# ----------------------------------------------------------------------------------------------


def oracle(q, k, v, **kw):
    """`reference` on (B, T, H, D) arrays: (out (B, T, Hq, Dv), lse (B, Hq, T)) as float64 NumPy."""
    out, lse = reference(from_bthd(q), from_bthd(k), from_bthd(v), **kw)
    return to_bthd(out), lse.numpy()


def oracle_grads(q, k, v, cotangent, **kw):
    """float64 gradients of sum(out * cotangent) w.r.t. q, k, v, as (B, T, H, D) NumPy arrays."""
    _, _, grads = reference_grads(from_bthd(q), from_bthd(k), from_bthd(v), from_bthd(cotangent), **kw)
    return [to_bthd(g) for g in grads[:3]]


def per_sequence_reference(q, k, v, lengths, causal, alignment, window):
    """Each packed sequence through the oracle on its own; padding rows 0 and -inf."""
    cu_q, cu_k = cu_of(lengths)
    out, lse = varlen_reference(from_bthd(q), from_bthd(k), from_bthd(v), cu_q, cu_k, causal=causal,
                                alignment=alignment, window=window)
    return to_bthd(out), lse.numpy()


def cu_of(lengths):
    cu_q = np.concatenate([[0], np.cumsum([lq for lq, _ in lengths])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([lk for _, lk in lengths])]).astype(np.int32)
    return cu_q, cu_k


def qkv(seed, b, t, s, hq=4, hk=2, d=16, dv=12):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, t, hq, d)).astype(np.float32), rng.standard_normal((b, s, hk, d)).astype(np.float32),
            rng.standard_normal((b, s, hk, dv)).astype(np.float32))


def close(actual, expected, atol=3e-5, rtol=3e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol)


def close_lse(actual, expected):
    actual = np.asarray(actual, np.float64)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite)
    assert np.all(actual[~finite] == -np.inf)
    close(actual[finite], expected[finite])


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------


def test_segment_mask_matches_the_oracle():
    rng = np.random.default_rng(0)
    q_ids, kv_ids = rng.integers(-2, 3, (2, 9)), rng.integers(-2, 3, (2, 11))
    got = jax.jit(segment_mask)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    assert got.shape == (2, 1, 9, 11) and got.dtype == jnp.bool_
    np.testing.assert_array_equal(got, segment_visibility(q_ids, kv_ids).numpy())


@pytest.mark.parametrize("causal,alignment,window", [
    (False, "top_left", None), (True, "top_left", None), (True, "bottom_right", None),
    (False, "bottom_right", (2, 1)), (True, "top_left", (3, -1)), (False, "top_left", (-1, 0)),
])
def test_varlen_mask_matches_the_oracle(causal, alignment, window):
    lengths = [(4, 7), (1, 1), (0, 3), (6, 2), (5, 0), (3, 3)]
    cu_q, cu_k = cu_of(lengths)
    t_total, s_total = int(cu_q[-1]) + 3, int(cu_k[-1]) + 2  # trailing padding rows and columns
    f = jax.jit(lambda cq, ck: varlen_mask(cq, ck, t_total, s_total, causal=causal, causal_alignment=alignment,
                                           sliding_window=window))
    got = f(jnp.asarray(cu_q), jnp.asarray(cu_k))  # cu_seqlens traced
    assert got.shape == (1, 1, t_total, s_total)
    np.testing.assert_array_equal(got, varlen_visibility(cu_q, cu_k, t_total, s_total, causal=causal,
                                                         alignment=alignment, window=window).numpy())


# ----------------------------------------------------------------------------------------------
# vanilla: segment ids
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BTHD", pytest.param("BHTD", marks=pytest.mark.thorough)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 2))])
def test_vanilla_segment_ids_match_explicit_mask(layout, causal, window):
    b, t, s = 2, 23, 29
    q, k, v = qkv(1, b, t, s)
    rng = np.random.default_rng(10)
    # unsorted, non-contiguous ids; a query id (9) that no key has gives empty rows
    q_ids = rng.choice(np.array([7, -3, 2, 9]), (b, t)).astype(np.int32)
    kv_ids = rng.choice(np.array([2, 7, -3]), (b, s)).astype(np.int64)
    visible = (segment_visibility(q_ids, kv_ids) & visibility(t, s, causal=causal, window=window)).numpy()
    ref_out, ref_lse = oracle(q, k, v, segment_ids=(q_ids, kv_ids), causal=causal, window=window)
    args = (q, k, v) if layout == "BTHD" else tuple(np.swapaxes(x, 1, 2) for x in (q, k, v))
    res = attention(*args, segment_ids=(q_ids, kv_ids), causal=causal, sliding_window=window, return_lse=True,
                    layout=layout)  # automatic selection: sdpa declines segment ids, vanilla runs
    out = res.attention_outputs if layout == "BTHD" else np.swapaxes(res.attention_outputs, 1, 2)
    close(out, ref_out)
    close_lse(res.lse, ref_lse)
    assert np.any(~visible.any(-1)) and np.all(np.asarray(out)[~visible[:, 0].any(-1)] == 0)


def test_vanilla_segment_ids_gradients():
    b, t, s = 2, 17, 21
    q, k, v = qkv(2, b, t, s)
    rng = np.random.default_rng(20)
    q_ids, kv_ids = rng.integers(0, 3, (b, t)), rng.integers(0, 3, (b, s))
    ct = rng.standard_normal((b, t, 4, 12)).astype(np.float32)
    f = lambda q, k, v: jnp.sum(attention(q, k, v, segment_ids=(q_ids, kv_ids), causal=True).attention_outputs * ct)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    ref = oracle_grads(q, k, v, ct, segment_ids=(q_ids, kv_ids), causal=True)
    for g, r in zip(grads, ref):
        close(g, r, atol=5e-5, rtol=5e-5)


# ----------------------------------------------------------------------------------------------
# vanilla: varlen
# ----------------------------------------------------------------------------------------------

LENGTHS = [(5, 9), (1, 1), (7, 3), (13, 13), (0, 4), (3, 0), (1, 6)]  # L_n != S_n, empty sides, length 1


@pytest.mark.parametrize("layout", ["BTHD", pytest.param("BHTD", marks=pytest.mark.thorough)])
@pytest.mark.parametrize("causal,alignment,window", [
    (False, "top_left", None), (True, "top_left", None), (True, "bottom_right", None),
    (False, "bottom_right", (2, 1)), (True, "top_left", (3, -1)),
])
def test_vanilla_varlen_matches_per_sequence(layout, causal, alignment, window):
    cu_q, cu_k = cu_of(LENGTHS)
    t_total, s_total = int(cu_q[-1]) + 4, int(cu_k[-1]) + 3
    q, k, v = qkv(3, 1, t_total, s_total)
    ref_out, ref_lse = per_sequence_reference(q, k, v, LENGTHS, causal, alignment, window)
    args = (q, k, v) if layout == "BTHD" else tuple(np.swapaxes(x, 1, 2) for x in (q, k, v))
    f = jax.jit(lambda q, k, v, cq, ck: attention(
        q, k, v, cu_seqlens=(cq, ck), max_seqlen=(13, 13), causal=causal, causal_alignment=alignment,
        sliding_window=window, return_lse=True, layout=layout))
    res = f(*args, cu_q, cu_k)
    out = res.attention_outputs if layout == "BTHD" else np.swapaxes(res.attention_outputs, 1, 2)
    close(out, ref_out)
    close_lse(res.lse, ref_lse)
    assert np.all(np.asarray(out)[0, cu_q[-1]:] == 0)  # trailing padding rows
    assert np.all(np.asarray(res.lse)[0, :, cu_q[-1]:] == -np.inf)


def test_vanilla_varlen_forward_and_gradients_match_the_oracle():
    lengths = [(6, 4), (1, 1), (9, 11)]
    cu_q, cu_k = cu_of(lengths)
    q, k, v = qkv(4, 1, int(cu_q[-1]) + 2, int(cu_k[-1]))
    kw = dict(causal=True, causal_alignment="bottom_right")
    packed = jax.jit(lambda q, k, v: attention(q, k, v, cu_seqlens=(cu_q, cu_k), **kw).attention_outputs)(q, k, v)
    close(packed, per_sequence_reference(q, k, v, lengths, True, "bottom_right", None)[0])

    ct = np.random.default_rng(40).standard_normal(packed.shape).astype(np.float32)
    f = lambda q, k, v: jnp.sum(attention(q, k, v, cu_seqlens=(cu_q, cu_k), **kw).attention_outputs * ct)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    visible = varlen_visibility(cu_q, cu_k, q.shape[1], k.shape[1], causal=True, alignment="bottom_right")
    for g, r in zip(grads, oracle_grads(q, k, v, ct, mask=visible)):
        close(g, r, atol=5e-5, rtol=5e-5)


def test_varlen_padding_rows_have_no_sink():
    lengths = [(3, 0), (4, 5)]  # a sequence without keys, then a normal one, then 2 padding rows
    cu_q, cu_k = cu_of(lengths)
    q, k, v = qkv(9, 1, 9, 5)
    sinks = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    res = attention(q, k, v, cu_seqlens=(cu_q, cu_k), softmax_aux=sinks, return_lse=True)
    lse, out = np.asarray(res.lse)[0], np.asarray(res.attention_outputs)[0]
    np.testing.assert_allclose(lse[:, :3], np.broadcast_to(sinks[:, None], (4, 3)))  # only the sink is visible
    assert np.all(lse[:, 7:] == -np.inf) and np.all(out[7:] == 0) and np.all(out[:3] == 0)
    assert np.all(np.isfinite(lse[:, 3:7]))


def test_varlen_traced_cu_seqlens_change_without_shape_change():
    q, k, v = qkv(5, 1, 12, 12)
    f = jax.jit(lambda cq, ck: attention(q, k, v, cu_seqlens=(cq, ck), causal=True).attention_outputs)
    for lengths in ([(4, 4), (8, 8)], [(10, 3), (2, 9)]):
        cu_q, cu_k = cu_of(lengths)
        close(f(cu_q, cu_k), per_sequence_reference(q, k, v, lengths, True, "top_left", None)[0])


# ----------------------------------------------------------------------------------------------
# features, selection, reasons
# ----------------------------------------------------------------------------------------------


def test_attention_inputs_packing_features():
    q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float32)
    seg = AttentionInputs.from_arrays(q, q, q, platform="cpu", backend="cpu", segment_ids=True)
    assert seg.features == {"segment_ids"}
    var = AttentionInputs.from_arrays(q, q, q, platform="cpu", backend="cpu", varlen=True, causal=True,
                                      causal_alignment="bottom_right")
    # packed sequences may have L_n != S_n even when T == S: bottom-right is then a real feature
    assert var.features == {"varlen", "causal_bottom_right"}
    top = AttentionInputs.from_arrays(q, q, q, platform="cpu", backend="cpu", varlen=True, causal=True)
    assert top.features == {"varlen", "causal"}


def test_sdpa_declines_segment_ids_and_varlen():
    q, k, v = qkv(6, 1, 8, 8, hq=2, hk=2, d=16, dv=16)
    ids = np.zeros((1, 8), np.int32)
    cu = np.array([0, 3, 8], np.int32)
    with pytest.raises(ValueError, match="feature 'segment_ids' not supported"):
        attention(q, k, v, segment_ids=(ids, ids), implementation="sdpa")
    with pytest.raises(ValueError, match="feature 'varlen' not supported"):
        attention(q, k, v, cu_seqlens=(cu, cu), implementation="sdpa")
    sdpa = AttentionRegistry.create("sdpa", AttentionMetadata())
    with pytest.raises(NotImplementedError, match="sdpa supports neither segment_ids nor cu_seqlens"):
        sdpa.forward_native(q, k, v, bias=None, mask=None, causal=False, causal_alignment="top_left",
                            sliding_window=None, logits_soft_cap=None, softmax_aux=None, dropout_rng=None,
                            return_weights=False, segment_ids=(ids, ids))
    # automatic selection on CPU falls through to vanilla
    close(attention(q, k, v, cu_seqlens=(cu, cu)).attention_outputs,
          per_sequence_reference(q, k, v, [(3, 3), (5, 5)], False, "top_left", None)[0])


def test_flash_tpu_reasons_for_packing():
    flash = AttentionRegistry.get("flash")
    base = dict(batch=1, q_len=256, kv_len=256, num_q_heads=2, num_kv_heads=2, head_dim=64, value_head_dim=64,
                dtype="float32")
    tpu = AttentionInputs(platform="tpu", backend="tpu", features={"segment_ids", "causal", "backward"}, **base)
    assert flash.not_supported_reasons(tpu) == []
    for feature in ("varlen", "dropout"):
        tpu = AttentionInputs(platform="tpu", backend="tpu", features={feature}, **base)
        assert any(f"'{feature}' not supported by the TPU kernel" in r for r in flash.not_supported_reasons(tpu))


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------

_Q, _K, _V = qkv(7, 2, 6, 9)
_IDS_Q, _IDS_K = np.zeros((2, 6), np.int32), np.zeros((2, 9), np.int32)
_CU = np.array([0, 2, 6], np.int32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_ids=_IDS_Q), r"segment_ids: expected a pair"),
    (dict(segment_ids=(_IDS_Q, _IDS_Q)), r"kv_segment_ids has shape \(2, 6\).*expected an integer array of shape \(2, 9\)"),
    (dict(segment_ids=(_IDS_Q[:1], _IDS_K)), r"q_segment_ids has shape \(1, 6\).*\(2, 6\)"),
    (dict(segment_ids=(_IDS_Q.astype(np.float32), _IDS_K)), r"q_segment_ids .* dtype float32; expected an integer"),
    (dict(cu_seqlens=(_CU, _CU)), r"cu_seqlens: needs a batch of 1.*batch=2"),
    (dict(segment_ids=(_IDS_Q, _IDS_K), cu_seqlens=(_CU, _CU)), r"segment_ids and cu_seqlens were both given"),
    (dict(max_seqlen=(4, 4)), r"max_seqlen=\(4, 4\): only meaningful with cu_seqlens"),
])
def test_packing_errors_batch2(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention(_Q, _K, _V, implementation="vanilla", **kwargs)


@pytest.mark.parametrize("cu_q,cu_k,max_seqlen,match", [
    (_CU[None], _CU, None, r"cu_seqlens_q has shape \(1, 3\).*expected a 1-D integer array"),
    (_CU, _CU.astype(np.float32), None, r"cu_seqlens_k .* dtype float32"),
    (_CU[:1], _CU[:1], None, r"cu_seqlens_q has shape \(1,\).*N \+ 1 >= 2"),
    (_CU, np.array([0, 9], np.int32), None, r"cu_seqlens_q \(3,\) and cu_seqlens_k \(2,\) must have the same length"),
    (_CU, _CU, (0, 4), r"max_seqlen=\(0, 4\): expected .* ints >= 1"),
    (_CU, _CU, (4.0, 4), r"max_seqlen=\(4.0, 4\)"),
    (_CU, _CU, 4, r"max_seqlen: expected a pair"),
])
def test_varlen_errors(cu_q, cu_k, max_seqlen, match):
    with pytest.raises(ValueError, match=match):
        attention(_Q[:1], _K[:1], _V[:1], cu_seqlens=(cu_q, cu_k), max_seqlen=max_seqlen, implementation="vanilla")


# ----------------------------------------------------------------------------------------------
# meshes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh22():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (conftest sets --xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def test_mesh_segment_ids_and_varlen(mesh22):
    q, k, v = qkv(8, 2, 19, 23)
    rng = np.random.default_rng(80)
    q_ids, kv_ids = rng.integers(0, 3, (2, 19)), rng.integers(0, 3, (2, 23))
    out = jax.jit(lambda q, k, v: attention(
        q, k, v, segment_ids=(q_ids, kv_ids), causal=True, metadata=AttentionMetadata(mesh=mesh22),
        implementation="vanilla").attention_outputs)(q, k, v)
    assert len(out.sharding.device_set) == 4
    close(out, oracle(q, k, v, segment_ids=(q_ids, kv_ids), causal=True)[0])

    lengths = [(7, 5), (12, 18)]
    cu_q, cu_k = cu_of(lengths)
    md = AttentionMetadata(mesh=mesh22, partition_axis=PartitionAxis(batch_axis=None, head_axis="tp"))
    out = jax.jit(lambda q, k, v: attention(q, k, v, cu_seqlens=(cu_q, cu_k), causal=True,
                                            causal_alignment="bottom_right", metadata=md).attention_outputs)(
        q[:1], k[:1], v[:1])
    close(out, per_sequence_reference(q[:1], k[:1], v[:1], lengths, True, "bottom_right", None)[0])
