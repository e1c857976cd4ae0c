"""The call object of jax_core: `AttentionCall` (static spec) and `CallArrays`, built once per call.

Checks that equal specs give equal, hashable calls; that the selection signature derived from a
call is the one the keyword description gave before the call object existed (a frozen copy of that
description is the oracle here); that the arrays are checked exactly once per call, with the same
message through `attention()` and through an implementation called directly; that an EasyDeL-style
subclass overriding a platform's `forward_*` still runs; and that an implementation's `compute`
and its `forward_*` adapter agree with the float64 reference.
"""

from __future__ import annotations

import itertools
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attention_reference import assert_close_finite, from_bthd, reference, to_bthd

from jaxattn.jax_core import (
    AttentionCall,
    AttentionImpl,
    AttentionInputs,
    AttentionMetadata,
    AttentionOutput,
    AttentionRegistry,
    CallArrays,
    Capabilities,
    attention,
    build_call,
)
from jaxattn.jax_core import base as jc_base
from jaxattn.jax_core import dispatch as jc_dispatch
from jaxattn.jax_core.visibility import Visibility

# Awkward sizes: T != S, head dim 80, GQA.
B, T, S, HQ, HK, D = 2, 13, 21, 4, 2, 80


def _struct(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _arrays(seed: int, b=B, t=T, s=S, hq=HQ, hk=HK, d=D, dv=D, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, t, hq, d), (b, s, hk, d), (b, s, hk, dv)))
    return q, k, v


# ----------------------------------------------------------------------------------------------
# the spec: hashable, equal for equal specs
# ----------------------------------------------------------------------------------------------


def test_calls_with_equal_specs_are_equal_and_hash_alike():
    q, k, v = (_struct(B, T, HQ, D), _struct(B, S, HK, D), _struct(B, S, HK, D))
    keywords = dict(causal=True, causal_alignment="bottom_right", sliding_window=[7, 0], logits_soft_cap=30.0,
                    return_lse=True, layout="BTHD")
    md = AttentionMetadata(softmax_scale=0.25, dropout_prob=0.1)
    first, _ = build_call(q, k, v, metadata=md, **keywords)
    second, _ = build_call(q, k, v, metadata=AttentionMetadata(softmax_scale=0.25, dropout_prob=0.1), **keywords)
    assert first == second and hash(first) == hash(second)
    assert {first: "cached"}[second] == "cached"
    assert first.visibility == Visibility(True, "bottom_right", (7, 0))
    assert (first.scale, first.dropout_prob, first.sliding_window) == (0.25, 0.1, (7, 0))
    # Any one difference in the spec makes another call.
    for change in (dict(causal=False), dict(sliding_window=(7, 1)), dict(logits_soft_cap=None),
                   dict(return_lse=False), dict(return_weights=True)):
        other, _ = build_call(q, k, v, metadata=md, **{**keywords, **change})
        assert other != first, change
    assert build_call(q, k, v, metadata=md.replace(softmax_scale=0.5), **keywords)[0] != first
    # scale None resolves to 1/sqrt(D) from the query's head dim.
    assert build_call(q, k, v, metadata=AttentionMetadata())[0].scale == pytest.approx(D**-0.5)
    assert AttentionCall().scale_for(64) == 0.125 and AttentionCall(scale=2.0).scale_for(64) == 2.0


def test_call_rejects_bad_static_arguments_by_name():
    with pytest.raises(ValueError, match=r"layout='BTDH': expected 'BTHD' or 'BHTD'"):
        AttentionCall(layout="BTDH")
    with pytest.raises(ValueError, match=r"backend='gpu'"):
        AttentionCall(backend="gpu")
    with pytest.raises(ValueError, match=r"dropout_prob=1.0"):
        AttentionCall(dropout_prob=1.0)
    with pytest.raises(TypeError, match="expected a Visibility"):
        AttentionCall(visibility=(True, "top_left"))
    q = _struct(B, T, HQ, D)
    with pytest.raises(ValueError, match="causal_alignment='bottom'"):
        build_call(q, q, q, metadata=AttentionMetadata(), causal_alignment="bottom")


def test_call_arrays_is_a_pytree_with_none_for_absent_arrays():
    q, k, v = _arrays(0)
    arrays = CallArrays(q, k, v, bias=jnp.zeros((1, 1, T, S)))
    leaves, tree = jax.tree_util.tree_flatten(arrays)
    assert len(leaves) == 4  # query, key, value, bias
    assert jax.tree_util.tree_unflatten(tree, leaves).bias.shape == (1, 1, T, S)
    swapped = arrays.swapped()
    assert swapped.query.shape == (B, HQ, T, D) and swapped.bias.shape == (1, 1, T, S)


# ----------------------------------------------------------------------------------------------
# the selection signature derived from the call
# ----------------------------------------------------------------------------------------------


def _described_by_keywords(query, key, value, *, platform, backend, bias=None, mask=None, causal=False,
                           causal_alignment="top_left", sliding_window=None, logits_soft_cap=None, softmax_aux=None,
                           dropout=False, return_weights=False, return_lse=False, segment_ids=False, varlen=False,
                           alibi=False):
    """The oracle: the keyword description of a (B, T, H, D) call as jax_core wrote it before the call
    object (feature by feature), a (-1, -1) window counting as no window."""
    b, t, hq, d = query.shape
    _, s, hk, _ = key.shape
    features = set(Visibility.of(causal, causal_alignment, sliding_window).features(t, s, varlen=varlen))
    for name, present in (("bias", bias is not None), ("bool_mask", mask is not None), ("gqa", hk != hq),
                          ("softcap", logits_soft_cap is not None), ("sinks", softmax_aux is not None),
                          ("dropout", dropout), ("weights", return_weights), ("lse", return_lse),
                          ("segment_ids", segment_ids), ("varlen", varlen), ("alibi", alibi)):
        if present:
            features.add(name)
    window = None if sliding_window in (None, (-1, -1)) else tuple(sliding_window)
    return AttentionInputs(batch=b, q_len=t, kv_len=s, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                           value_head_dim=value.shape[-1], dtype=jnp.dtype(query.dtype).name, platform=platform,
                           backend=backend, features=frozenset(features), window=window)


_GRID = list(itertools.product(
    (False, True),  # causal
    ("top_left", "bottom_right"),
    (None, (5, 0), (-1, -1), (3, 2)),  # sliding window
    ("none", "bias", "mask", "both"),
    (None, "segments", "varlen"),
    (False, True),  # soft cap, sinks, dropout, lse, weights, alibi all together
    ("BTHD", "BHTD"),
    ((T, S, HK), (S, S, HQ), (1, S, HQ)),  # (q_len, kv_len, kv heads): GQA, equal lengths, one query
))


@pytest.mark.parametrize("causal, alignment, window, masking, packing, extras, layout, sizes", _GRID[::13])
def test_inputs_from_call_match_the_keyword_description(causal, alignment, window, masking, packing, extras, layout,
                                                       sizes):
    t, s, hk = sizes
    b = 1 if packing == "varlen" else B
    q, k, v = _struct(b, t, HQ, D), _struct(b, s, hk, D), _struct(b, s, hk, 48)
    bias = _struct(1, HQ, t, s) if masking in ("bias", "both") else None
    mask = _struct(b, 1, t, s, dtype=jnp.bool_) if masking in ("mask", "both") else None
    cu = (_struct(3, dtype=jnp.int32), _struct(3, dtype=jnp.int32))
    arrays = CallArrays(q, k, v, bias=bias, mask=mask, softmax_aux=_struct(HQ) if extras else None,
                        dropout_rng=jax.random.key(0) if extras else None,
                        segment_ids=(_struct(b, t, dtype=jnp.int32), _struct(b, s, dtype=jnp.int32))
                        if packing == "segments" else None,
                        cu_seqlens=cu if packing == "varlen" else None,
                        alibi_slopes=_struct(HQ) if extras else None)
    if layout == "BHTD":
        arrays = arrays.replace(**{n: _struct(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
                                   for n, x in zip(("query", "key", "value"), arrays.qkv)})
    call, _ = build_call(*arrays.qkv, metadata=AttentionMetadata(dropout_prob=0.1), causal=causal,
                         causal_alignment=alignment, sliding_window=window, logits_soft_cap=30.0 if extras else None,
                         return_lse=extras, return_weights=extras, layout=layout)
    want = _described_by_keywords(
        q, k, v, platform="cpu", backend="cpu", bias=bias, mask=mask, causal=causal, causal_alignment=alignment,
        sliding_window=window, logits_soft_cap=30.0 if extras else None, softmax_aux=arrays.softmax_aux,
        dropout=extras, return_weights=extras, return_lse=extras, segment_ids=packing == "segments",
        varlen=packing == "varlen", alibi=extras)
    assert call.inputs(arrays, "cpu", "cpu") == want
    # The keyword wrapper kept for existing callers describes the same call.
    assert AttentionInputs.from_arrays(
        q, k, v, platform="cpu", backend="cpu", bias=bias, mask=mask, causal=causal, causal_alignment=alignment,
        sliding_window=window, logits_soft_cap=30.0 if extras else None, softmax_aux=arrays.softmax_aux,
        dropout=extras, return_weights=extras, return_lse=extras, segment_ids=packing == "segments",
        varlen=packing == "varlen", alibi=extras) == want
    # Without a dropout probability a dropout key asks for nothing.
    no_dropout = call.replace(dropout_prob=0.0).inputs(arrays, "cpu", "cpu")
    assert no_dropout.features == want.features - {"dropout"}


# ----------------------------------------------------------------------------------------------
# one validation per call
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def counted_checks(monkeypatch):
    """How many times the arrays of a call were checked (`validation.check_call` where jax_core calls it)."""
    calls = []
    real = jc_dispatch.check_call

    def counting(call, arrays):
        calls.append(call)
        return real(call, arrays)

    monkeypatch.setattr(jc_dispatch, "check_call", counting)
    monkeypatch.setattr(jc_base, "check_call", counting)
    return calls


_MALFORMED = [
    (lambda q, k, v: dict(query=q[:1], key=k, value=v), r"^batch sizes differ: query 1, key 2, value 2\.$"),
    (lambda q, k, v: dict(query=q, key=k, value=v[:, :-1]), r"disagree on \(S, Hk\)"),
    (lambda q, k, v: dict(query=q, key=k, value=v, mask=jnp.ones((T, S), jnp.float32)), r"^mask: expected dtype bool"),
    (lambda q, k, v: dict(query=q, key=k, value=v, bias=jnp.zeros((3, T, S))), r"^bias: shape \(3, 13, 21\)"),
    (lambda q, k, v: dict(query=q, key=k, value=v, softmax_aux=jnp.zeros((HQ + 1,))), r"^softmax_aux: expected"),
    (lambda q, k, v: dict(query=q, key=k, value=v, alibi_slopes=jnp.zeros((3,))), r"^alibi_slopes: shape \(3,\)"),
    (lambda q, k, v: dict(query=q, key=k, value=v, max_seqlen=(4, 4)), r"only meaningful with cu_seqlens"),
    (lambda q, k, v: dict(query=q[0], key=k, value=v), r"^query: expected a 4-D \(BTHD\) array"),
]


@pytest.mark.parametrize("make, message", _MALFORMED)
def test_a_malformed_call_raises_once_with_one_message(make, message, counted_checks):
    q, k, v = _arrays(1)
    arguments = make(q, k, v)
    with pytest.raises(ValueError, match=message) as through_attention:
        attention(**arguments, implementation="vanilla")
    assert len(counted_checks) == 1
    impl = AttentionRegistry.create("vanilla", AttentionMetadata())
    with pytest.raises(ValueError, match=message) as directly:
        impl(arguments.pop("query"), arguments.pop("key"), arguments.pop("value"), **arguments)
    assert len(counted_checks) == 2
    assert str(through_attention.value) == str(directly.value)


def test_a_valid_call_is_checked_once(counted_checks):
    q, k, v = _arrays(2)
    attention(q, k, v, causal=True, implementation="vanilla")
    attention(q, k, v, causal=True)  # automatic selection
    attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), layout="BHTD", implementation="vanilla")  # transposed
    assert len(counted_checks) == 3
    AttentionRegistry.create("vanilla", AttentionMetadata())(q, k, v, layout="BTHD")
    assert len(counted_checks) == 4


# ----------------------------------------------------------------------------------------------
# EasyDeL-style subclasses
# ----------------------------------------------------------------------------------------------


def _easydel_style(name, seen):
    """An implementation written the EasyDeL way: `forward_native` and `forward_cpu`, no `compute`."""

    class EasyDeLStyle(AttentionImpl):
        capabilities = Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                                    features=frozenset({"causal", "gqa", "sliding_window", "softcap", "lse"}))

        @classmethod
        def get_impl_name(cls):
            return name

        def forward_native(self, query, key, value, **keywords):
            raise AssertionError("forward_cpu overrides forward_native on cpu")

        def forward_cpu(self, query, key, value, *, bias, mask, causal, causal_alignment, sliding_window,
                        logits_soft_cap, softmax_aux, dropout_rng, return_weights, segment_ids=None,
                        cu_seqlens=None, max_seqlen=None):
            seen.append(dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                             bias=bias, dropout_rng=dropout_rng))
            b, t, h, _ = query.shape
            return AttentionOutput(attention_outputs=jnp.full((b, t, h, value.shape[-1]), 7.0, query.dtype),
                                   lse=jnp.zeros((b, h, t), jnp.float32))

    return EasyDeLStyle


def test_subclass_overriding_forward_cpu_is_used(registry_cleanup):
    name = f"easydel_{uuid.uuid4().hex[:8]}"
    seen = []
    AttentionRegistry.register(_easydel_style(name, seen))
    q, k, v = _arrays(3, d=16, dv=16)
    out = attention(q, k, v, causal=True, sliding_window=(4, 0), logits_soft_cap=20.0, implementation=name,
                    metadata=AttentionMetadata(platform="cpu"))
    np.testing.assert_array_equal(out.attention_outputs, np.full((B, T, HQ, 16), 7.0, np.float32))
    assert out.lse is None  # not asked for
    assert seen == [dict(causal=True, sliding_window=(4, 0), logits_soft_cap=20.0, bias=None, dropout_rng=None)]
    # Called directly (no attention()), and transposed from BHTD around the call.
    impl = AttentionRegistry.create(name, AttentionMetadata(platform="cpu"))
    out = impl(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), layout="BHTD", return_lse=True)
    assert out.attention_outputs.shape == (B, HQ, T, 16) and out.lse.shape == (B, HQ, T)
    assert len(seen) == 2


def test_subclass_with_only_forward_native_runs_there_and_one_with_neither_says_so(registry_cleanup):
    class NativeOnly(AttentionImpl):
        capabilities = Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"}),
                                    features=frozenset())

        @classmethod
        def get_impl_name(cls):
            return f"native_only_{uuid.uuid4().hex[:8]}"

        def forward_native(self, query, key, value, **keywords):
            return AttentionOutput(attention_outputs=query + 1.0)

    class Neither(NativeOnly):
        forward_native = AttentionImpl.forward_native

    q, k, v = _arrays(4, hk=HQ)
    impl = NativeOnly(AttentionMetadata())
    np.testing.assert_array_equal(impl(q, k, v).attention_outputs, q + 1.0)
    np.testing.assert_array_equal(impl.forward_tpu(q, k, v, causal=False).attention_outputs, q + 1.0)
    with pytest.raises(NotImplementedError, match="Neither implements neither compute nor forward_native"):
        Neither(AttentionMetadata())(q, k, v)


# ----------------------------------------------------------------------------------------------
# compute and its forward_* adapters against the float64 oracle
# ----------------------------------------------------------------------------------------------


def _oracle(q, k, v, *, bias, causal, alignment, window, softcap, sinks, scale):
    out, lse = reference(from_bthd(q), from_bthd(k), from_bthd(v), causal=causal, alignment=alignment, window=window,
                         softcap=softcap, scale=scale, bias=None if bias is None else torch.from_numpy(np.asarray(bias, np.float64)),
                         sinks=None if sinks is None else torch.from_numpy(np.asarray(sinks, np.float64)))
    return to_bthd(out), lse.numpy()


@pytest.mark.parametrize("name, forward", [("vanilla", "forward_native"), ("vanilla", "forward_cpu"),
                                           ("sdpa", "forward_native"), ("sdpa", "forward_cpu"),
                                           ("decode", "forward_native")])
def test_compute_and_forward_adapter_match_the_reference(name, forward):
    q, k, v = _arrays(5, t=3 if name == "decode" else T)
    t = q.shape[1]
    rng = np.random.default_rng(6)
    features = dict(causal=True, causal_alignment="bottom_right", sliding_window=(9, 0))
    if name != "sdpa":
        features.update(logits_soft_cap=5.0, softmax_aux=jnp.asarray(rng.standard_normal(HQ), jnp.float32))
    if name == "vanilla":
        features["bias"] = jnp.asarray(rng.standard_normal((1, HQ, t, S)), jnp.float32)
    if name == "sdpa":  # sdpa places windows top-left and has no bottom-right alignment
        features["causal_alignment"] = "top_left"
    md = AttentionMetadata(softmax_scale=0.3)
    impl = AttentionRegistry.create(name, md)
    call, arrays = build_call(q, k, v, metadata=md, backend="cpu", return_lse=True, **features)
    by_compute = impl.compute(call, arrays)
    by_adapter = getattr(impl, forward)(q, k, v, **features)
    want, want_lse = _oracle(q, k, v, bias=features.get("bias"), causal=True, alignment=features["causal_alignment"],
                             window=(9, 0), softcap=features.get("logits_soft_cap"), sinks=features.get("softmax_aux"),
                             scale=0.3)
    for how, out in (("compute", by_compute), (forward, by_adapter)):
        assert_close_finite(f"{name} {how}", torch.from_numpy(np.asarray(out.attention_outputs, np.float64)),
                            torch.from_numpy(want), tol=2e-5)
        if out.lse is not None:
            assert_close_finite(f"{name} {how} lse", torch.from_numpy(np.asarray(out.lse, np.float64)),
                                torch.from_numpy(want_lse), tol=2e-5)
    np.testing.assert_array_equal(by_compute.attention_outputs, by_adapter.attention_outputs)
