"""Tests of jaxattn.jax_core: metadata, registry/selection, numerics of `attention`, meshes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import uuid
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec as P

from attention_reference import reference

import jaxattn.jax_core as jc
from jaxattn.jax_core import (
    AttentionImpl,
    AttentionInputs,
    AttentionMetadata,
    AttentionOutput,
    AttentionRegistry,
    Capabilities,
    PartitionAxis,
    attention,
)

# Awkward sizes: nothing is a power of two, T != S.
B, T, S, D = 2, 97, 130, 80


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _rand(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _qkv(seed=0, b=B, t=T, s=S, hq=4, hk=4, d=D, dv=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    return (
        _rand(rng, (b, t, hq, d), dtype),
        _rand(rng, (b, s, hk, d), dtype),
        _rand(rng, (b, s, hk, dv), dtype),
    )


def np_reference(
    q, k, v, *, scale=None, bias=None, mask=None, causal=False, alignment="top_left", window=None,
    softcap=None, sinks=None,
):
    """The float64 oracle (tests/attention_reference.py) on (B, T, H, D) arrays; returns NumPy
    (output (B, T, Hq, Dv), probs (B, Hq, T, S))."""
    t = lambda x: None if x is None else torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    out, _, probs = reference(
        *(t(x).transpose(1, 2) for x in (q, k, v)), scale=scale, bias=t(bias),
        mask=None if mask is None else torch.from_numpy(np.asarray(mask, bool)), causal=causal, alignment=alignment,
        window=window, softcap=softcap, sinks=t(sinks), return_probs=True)
    return out.transpose(1, 2).numpy(), probs.numpy()


def _close(actual, expected, atol=3e-5, rtol=3e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol)


def _inputs(**changes):
    base = dict(
        batch=2, q_len=16, kv_len=16, num_q_heads=4, num_kv_heads=4, head_dim=64, value_head_dim=64,
        dtype="float32", platform="cpu", backend="cpu",
    )
    base.update(changes)
    return AttentionInputs(**base)


@pytest.fixture(scope="module")
def mesh22():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (conftest sets --xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


# ----------------------------------------------------------------------------------------------
# torch independence
# ----------------------------------------------------------------------------------------------


def test_jax_core_never_imports_torch_subprocess():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import jaxattn.jax_core as jc
        q = np.random.default_rng(0).standard_normal((1, 5, 2, 8)).astype(np.float32)
        for impl in ("vanilla", "sdpa", None):
            out = jc.attention(q, q, q, causal=True, implementation=impl).attention_outputs
            assert out.shape == (1, 5, 2, 8)
        out.block_until_ready()
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout


# ----------------------------------------------------------------------------------------------
# AttentionMetadata
# ----------------------------------------------------------------------------------------------


def test_metadata_replace_and_hashable():
    md = AttentionMetadata(softmax_scale=0.5, runtime_dtype=jnp.bfloat16)
    assert md.runtime_dtype == "bfloat16"  # dtypes normalised to names
    md2 = md.replace(dropout_prob=0.25, blocksize_q=64)
    assert (md2.dropout_prob, md2.blocksize_q, md2.softmax_scale) == (0.25, 64, 0.5)
    assert md.dropout_prob == 0.0  # original untouched
    assert hash(md) != hash(md2) and md != md2
    assert md.replace() == md and hash(md.replace()) == hash(md)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.softmax_scale = 1.0  # type: ignore[misc]


def test_metadata_derived_values():
    md = AttentionMetadata()
    assert md.scale_for(80) == pytest.approx(80**-0.5)
    assert AttentionMetadata(softmax_scale=2).scale_for(80) == 2.0
    assert md.softmax_dtype_for(jnp.bfloat16) == jnp.float32
    assert md.softmax_dtype_for(jnp.float64) == jnp.float64
    assert AttentionMetadata(runtime_softmax_dtype="float16").softmax_dtype_for(jnp.float64) == jnp.float16


def test_metadata_dict_json_roundtrip(mesh22):
    pa = PartitionAxis(batch_axis=("dp", "fsdp"), head_axis="tp", query_sequence_axis="sp", key_sequence_axis=None)
    md = AttentionMetadata(
        runtime_dtype="bfloat16", runtime_softmax_dtype=jnp.float32, softmax_scale=0.125, dropout_prob=0.1,
        blocksize_q=64, blocksize_k=32, blocksize_b=2, mesh=mesh22, sequence_axis_name="seq", platform="cpu",
        backend="cpu", partition_axis=pa,
    )
    d = md.to_dict()
    assert "mesh" not in d
    assert d["partition_axis"] == {
        "batch_axis": ("dp", "fsdp"), "head_axis": "tp", "query_sequence_axis": "sp", "key_sequence_axis": None
    }
    assert d["runtime_dtype"] == "bfloat16" and d["runtime_softmax_dtype"] == "float32"
    expected = md.replace(mesh=None)
    assert AttentionMetadata.from_dict(d) == expected
    text = md.to_json(sort_keys=True)
    assert json.loads(text)["partition_axis"]["batch_axis"] == ["dp", "fsdp"]
    back = AttentionMetadata.from_json(text)
    assert back == expected
    assert back.partition_axis.batch_axis == ("dp", "fsdp")  # list -> tuple again
    assert hash(back) == hash(expected)
    assert AttentionMetadata.from_json(AttentionMetadata().to_json()) == AttentionMetadata()
    with pytest.raises(ValueError, match="unknown AttentionMetadata fields"):
        AttentionMetadata.from_dict({**d, "bogus": 1})


def test_metadata_from_config_duck_typed(mesh22):
    pa = PartitionAxis(batch_axis="dp", head_axis=None)
    cfg = SimpleNamespace(
        attn_dtype="float16", dtype="bfloat16", attn_softmax_dtype=jnp.float32, blocksize_q=64, blocksize_k=None,
        mesh=mesh22, sequence_axis_name="ring", platform="cpu", partition_axis=pa, unrelated=123,
    )
    md = AttentionMetadata.from_config(cfg, softmax_scale=0.3, dropout_prob=0.2)
    assert md.runtime_dtype == "float16"  # attn_dtype wins over dtype
    assert md.runtime_softmax_dtype == "float32"
    assert md.blocksize_q == 64 and md.blocksize_k == 128  # None attribute keeps the default
    assert md.blocksize_b == 1 and md.backend is None  # missing attributes keep defaults
    assert md.mesh is mesh22 and md.sequence_axis_name == "ring" and md.platform == "cpu"
    assert md.partition_axis == pa
    assert (md.softmax_scale, md.dropout_prob) == (0.3, 0.2)
    md2 = AttentionMetadata.from_config(SimpleNamespace(dtype=jnp.bfloat16), softmax_scale=None)
    assert md2.runtime_dtype == "bfloat16" and md2.softmax_scale is None
    assert AttentionMetadata.from_config(object(), None) == AttentionMetadata()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dropout_prob=1.5), ValueError, "dropout_prob"),
        (dict(dropout_prob=1.0), ValueError, "dropout_prob"),
        (dict(dropout_prob=-0.1), ValueError, "dropout_prob"),
        (dict(platform="mps"), ValueError, "platform"),
        (dict(backend="metal"), ValueError, "backend"),
        (dict(blocksize_q=0), ValueError, "blocksize_q"),
        (dict(blocksize_k=16.0), ValueError, "blocksize_k"),
        (dict(mesh="not a mesh"), TypeError, "mesh"),
    ],
)
def test_metadata_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        AttentionMetadata(**kwargs)


def test_get_shardings_without_mesh():
    pa = PartitionAxis(batch_axis="dp", head_axis="tp", query_sequence_axis="sq", key_sequence_axis="sk")
    md = AttentionMetadata(partition_axis=pa)
    q, k, v, bias, mask, out = md.get_shardings("__train__", BTHD=True)
    assert q == out == P("dp", "sq", "tp", None)
    assert k == v == P("dp", "sk", "tp", None)
    assert bias == P("dp", "tp", "sq", "sk")
    assert mask == P("dp", None, "sq", "sk")
    q, k, v, bias, mask, out = md.get_shardings("__train__", BTHD=False)
    assert q == out == P("dp", "tp", "sq", None)
    assert k == v == P("dp", "tp", "sk", None)
    assert bias == P("dp", "tp", "sq", "sk") and mask == P("dp", None, "sq", "sk")
    for bthd, expect_q in ((True, P("dp", None, "tp", None)), (False, P("dp", "tp", None, None))):
        q, k, v, bias, mask, out = md.get_shardings("__autoregressive__", BTHD=bthd)
        assert q == out == expect_q  # the query sequence is never split when decoding
        assert k == (P("dp", "sk", "tp", None) if bthd else P("dp", "tp", "sk", None))
        assert bias == P("dp", "tp", None, "sk") and mask == P("dp", None, None, "sk")
    # prefill behaves like train
    assert md.get_shardings("__prefill__")[0] == P("dp", "sq", "tp", None)


def test_get_shardings_defaults_and_mesh_missing_axes():
    q, k, v, bias, mask, out = AttentionMetadata().get_shardings("__train__")
    assert q == k == v == out == P("dp", None, "tp", None)
    assert bias == P("dp", "tp", None, None) and mask == P("dp", None, None, None)

    mesh_dp = Mesh(np.array(jax.devices()[:1]), ("dp",))
    pa = PartitionAxis(batch_axis=("dp", "fsdp"), head_axis="tp", query_sequence_axis="sp", key_sequence_axis="dp")
    md = AttentionMetadata(mesh=mesh_dp, partition_axis=pa)
    q, k, v, bias, mask, out = md.get_shardings("__train__", BTHD=True)
    assert q == out == P(("dp",), None, None, None)  # "tp", "sp", "fsdp" are not mesh axes
    assert k == v == P(("dp",), "dp", None, None)
    assert bias == P(("dp",), None, None, "dp")
    q, *_ = md.get_shardings("__train__", BTHD=False)
    assert q == P(("dp",), None, None, None)

    mesh_tp = Mesh(np.array(jax.devices()[:1]), ("tp",))
    md = AttentionMetadata(mesh=mesh_tp, partition_axis=pa)
    q, k, v, bias, mask, out = md.get_shardings("__autoregressive__", BTHD=False)
    assert q == P(None, "tp", None, None)  # a tuple with no axis left becomes None
    assert mask == P(None, None, None, None)


# ----------------------------------------------------------------------------------------------
# AttentionInputs / Capabilities
# ----------------------------------------------------------------------------------------------


def test_attention_inputs_from_arrays_features():
    q = jax.ShapeDtypeStruct((2, 3, 4, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 5, 2, 8), jnp.float32)
    v = jax.ShapeDtypeStruct((2, 5, 2, 16), jnp.float32)
    inp = AttentionInputs.from_arrays(
        q, k, v, platform="cpu", backend="cpu", bias=q, mask=q, causal=True, causal_alignment="bottom_right",
        sliding_window=[2, 0], logits_soft_cap=5.0, softmax_aux=q, dropout=True, return_weights=True, backward=True,
    )
    assert inp.features == frozenset(
        {"causal_bottom_right", "bias", "bool_mask", "gqa", "sliding_window", "softcap", "sinks", "dropout",
         "weights", "backward"}
    )
    assert (inp.batch, inp.q_len, inp.kv_len, inp.num_q_heads, inp.num_kv_heads) == (2, 3, 5, 4, 2)
    assert (inp.head_dim, inp.value_head_dim, inp.dtype, inp.window) == (8, 16, "float32", (2, 0))
    sq = jax.ShapeDtypeStruct((2, 5, 2, 8), jnp.bfloat16)
    plain = AttentionInputs.from_arrays(sq, sq, sq, platform="cpu", backend="cpu", causal=True,
                                        causal_alignment="bottom_right")
    assert plain.features == {"causal"}  # bottom-right == top-left when T == S
    assert plain.dtype == "bfloat16"
    # a bottom-right window needs bottom-right support even without causal (only when T != S)
    window_br = AttentionInputs.from_arrays(q, k, v, platform="cpu", backend="cpu", sliding_window=(2, 2),
                                            causal_alignment="bottom_right")
    assert window_br.features == {"causal_bottom_right", "gqa", "sliding_window"}
    assert "causal_bottom_right" not in AttentionInputs.from_arrays(
        sq, sq, sq, platform="cpu", backend="cpu", sliding_window=(2, 2), causal_alignment="bottom_right").features
    assert "causal_bottom_right" not in AttentionInputs.from_arrays(
        q, k, v, platform="cpu", backend="cpu", causal_alignment="bottom_right").features
    with pytest.raises(ValueError, match="unknown names"):
        _inputs(features={"telepathy"})


# ----------------------------------------------------------------------------------------------
# AttentionRegistry
# ----------------------------------------------------------------------------------------------


def test_list_and_get_implementations():
    names = AttentionRegistry.list_implementations()
    assert {"vanilla", "sdpa", "cudnn"} <= set(names) and "cuda_flash_attn2" not in names
    assert names == sorted(names)
    sdpa_cls = AttentionRegistry.get("sdpa")
    assert AttentionRegistry.get("cudnn") is sdpa_cls
    assert sdpa_cls.canonical_name() == "sdpa"
    assert AttentionRegistry.get("vanilla").canonical_name() == "vanilla"
    assert {"sdpa", "vanilla"} <= set(AttentionRegistry.canonical_names())
    with pytest.raises(ValueError) as info:
        AttentionRegistry.get("no_such_impl")
    assert "no_such_impl" in str(info.value)
    for name in ("vanilla", "sdpa", "cudnn"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="not registered"):
        AttentionRegistry.get(["unhashable"])  # type: ignore[arg-type]


def test_deprecated_name_runs_its_replacement_with_a_warning():
    """`cuda_flash_attn2` named cuDNN's fused attention (through sdpa): it still resolves, everywhere a
    name is taken, with a DeprecationWarning naming `cudnn`."""
    sdpa_cls = AttentionRegistry.get("sdpa")
    with pytest.warns(DeprecationWarning, match="implementation='cuda_flash_attn2' is deprecated.*'cudnn'"):
        assert AttentionRegistry.get("cuda_flash_attn2") is sdpa_cls
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 8)), jnp.float32)
    with pytest.warns(DeprecationWarning, match="'cudnn'"):
        old = attention(q, q, q, implementation="cuda_flash_attn2").attention_outputs
    with pytest.warns(DeprecationWarning, match="'cudnn'"):
        chosen = AttentionRegistry.select(_inputs(), implementation=("cuda_flash_attn2", "vanilla"))
    assert chosen is sdpa_cls
    np.testing.assert_array_equal(old, attention(q, q, q, implementation="cudnn").attention_outputs)


def test_create_returns_instance():
    md = AttentionMetadata(softmax_scale=0.5)
    impl = AttentionRegistry.create("cudnn", md)
    assert isinstance(impl, AttentionRegistry.get("sdpa")) and isinstance(impl, AttentionImpl)
    assert impl.get_impl_metadata() is md
    with pytest.raises(TypeError, match="AttentionMetadata"):
        AttentionRegistry.create("vanilla", {"softmax_scale": 0.5})
    with pytest.raises(ValueError, match="not registered"):
        AttentionRegistry.create("nope", md)


def _dummy_class(names, marker=7.0):
    class _Dummy(AttentionImpl):
        capabilities = Capabilities(
            platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"}), features=frozenset({"causal"})
        )

        @classmethod
        def get_impl_name(cls):
            return names

        def forward_native(self, query, key, value, **kwargs):
            b, t, h, _ = query.shape
            return AttentionOutput(attention_outputs=jnp.full((b, t, h, value.shape[-1]), marker, query.dtype))

    return _Dummy


def test_register_with_aliases(registry_cleanup):
    tag = uuid.uuid4().hex[:8]
    names = (f"dummy_{tag}", f"dummy_{tag}_alias1", f"dummy_{tag}_alias2")
    cls = _dummy_class(names)
    assert AttentionRegistry.register(cls) is cls
    assert AttentionRegistry.register(cls) is cls  # same class again: idempotent
    listed = AttentionRegistry.list_implementations()
    for n in names:
        assert n in listed and AttentionRegistry.get(n) is cls
    assert cls.canonical_name() == names[0]
    assert names[0] in AttentionRegistry.canonical_names()
    assert names[1] not in AttentionRegistry.canonical_names()
    q = jnp.ones((1, 3, 2, 4), jnp.float32)
    out = attention(q, q, q, causal=True, implementation=names[2]).attention_outputs
    np.testing.assert_array_equal(out, np.full((1, 3, 2, 4), 7.0, np.float32))
    # Its declared limits apply when forced.
    with pytest.raises(ValueError, match="dtype float16"):
        attention(q.astype(jnp.float16), q.astype(jnp.float16), q.astype(jnp.float16), implementation=names[1])
    # A duplicate name taken by another class raises.
    with pytest.raises(ValueError, match="already taken"):
        AttentionRegistry.register(_dummy_class((f"other_{tag}", names[1])))
    with pytest.raises(ValueError, match="already taken by VanillaAttn"):
        AttentionRegistry.register(_dummy_class(f"vanilla"))
    assert AttentionRegistry.get(names[1]) is cls
    assert AttentionRegistry.get("vanilla").__name__ == "VanillaAttn"


def test_register_failure_leaves_no_partial_registration(registry_cleanup):
    tag = uuid.uuid4().hex[:8]
    with pytest.raises(ValueError, match="already taken"):
        AttentionRegistry.register(_dummy_class((f"fresh_{tag}", "vanilla")))
    assert f"fresh_{tag}" not in AttentionRegistry.list_implementations()  # registration is atomic
    fixed = _dummy_class((f"fresh_{tag}",))
    assert AttentionRegistry.register(fixed) is fixed and AttentionRegistry.get(f"fresh_{tag}") is fixed


def test_select_automatic_cpu():
    sdpa_cls, vanilla_cls = AttentionRegistry.get("sdpa"), AttentionRegistry.get("vanilla")
    assert jc.PRIORITIES["cpu"][0] == "sdpa"
    assert AttentionRegistry.select(_inputs()) is sdpa_cls
    assert AttentionRegistry.select(_inputs(features={"causal", "bias", "bool_mask", "gqa", "sliding_window"},
                                            num_kv_heads=2)) is sdpa_cls
    for changes in (
        dict(features={"softcap"}),
        dict(features={"sinks"}),
        dict(features={"causal_bottom_right"}, q_len=3),
        dict(features={"dropout"}),
        dict(features={"weights"}),
        dict(value_head_dim=32),  # Ev != E
    ):
        assert AttentionRegistry.select(_inputs(**changes)) is vanilla_cls, changes
    # A tuple is tried in its order.
    assert AttentionRegistry.select(_inputs(), implementation=("vanilla", "sdpa")) is vanilla_cls
    assert AttentionRegistry.select(_inputs(features={"softcap"}), implementation=("sdpa", "vanilla")) is vanilla_cls
    # Forced names (aliases too) are returned when they can run.
    assert AttentionRegistry.select(_inputs(), implementation="cudnn") is sdpa_cls


def test_select_forced_impl_that_cannot_run():
    with pytest.raises(ValueError) as info:
        AttentionRegistry.select(_inputs(features={"softcap", "sinks"}), implementation="sdpa")
    msg = str(info.value)
    assert "implementation='sdpa' cannot run" in msg
    assert "feature 'softcap' not supported" in msg and "feature 'sinks' not supported" in msg
    with pytest.raises(ValueError, match="not registered"):
        AttentionRegistry.select(_inputs(), implementation="nope")
    with pytest.raises(ValueError, match="not registered"):
        AttentionRegistry.select(_inputs(), implementation=("sdpa", "nope"))


def test_select_no_candidate_raises_not_implemented():
    with pytest.raises(NotImplementedError) as info:
        AttentionRegistry.select(_inputs(features={"softcap"}, value_head_dim=32), implementation=("sdpa",))
    msg = str(info.value)
    assert "sdpa:" in msg and "feature 'softcap' not supported" in msg and "value_head_dim=32 != head_dim=64" in msg
    with pytest.raises(NotImplementedError) as info:
        AttentionRegistry.select(_inputs(features={"segment_ids", "softcap"}, dtype="int32"))
    msg = str(info.value)
    assert "sdpa:" in msg and "vanilla:" in msg and "feature 'segment_ids' not supported" in msg
    assert "vanilla: dtype int32 not in" in msg
    # through attention(): a tuple with only sdpa and a soft cap
    q = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="softcap"):
        attention(q, q, q, logits_soft_cap=5.0, implementation=("sdpa",))


def test_not_supported_reasons_collects_everything(mesh22):
    inp = _inputs(
        platform="mps", backend="metal", dtype="int8", num_q_heads=6, num_kv_heads=4, value_head_dim=48,
        features={"softcap", "sinks", "lse"},
    )
    reasons = AttentionRegistry.get("sdpa").not_supported_reasons(inp)
    text = "\n".join(reasons)
    assert "platform 'mps' not in" in text
    assert "dtype int8 not in" in text
    for feature in ("lse", "sinks", "softcap"):
        assert f"feature {feature!r} not supported" in text
    assert "num_q_heads=6 is not a multiple of num_kv_heads=4" in text
    assert "value_head_dim=48 != head_dim=64" in text
    assert len(reasons) == 7
    # A mesh adds its divisibility rules to the same list.
    md = AttentionMetadata(mesh=mesh22)
    more = AttentionRegistry.get("sdpa").not_supported_reasons(inp.__class__(**{**inp.__dict__, "batch": 3,
                                                                                 "num_kv_heads": 3}), md)
    assert any("batch=3 is not divisible by mesh batch axis size 2" in r for r in more)
    assert any("num_kv_heads=3 is not divisible by mesh head axis size 2" in r for r in more)
    # Capability limits on head dims
    caps = Capabilities(platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"}), features=frozenset(),
                        max_head_dim=32, head_dim_multiple=16)
    r = caps.reasons(_inputs(head_dim=40, value_head_dim=8))
    assert r == ["head_dim=40 > max 32", "head_dim=40 is not a multiple of 16", "value_head_dim=8 is not a multiple of 16"]
    assert AttentionRegistry.get("vanilla").not_supported_reasons(_inputs()) == []


# ----------------------------------------------------------------------------------------------
# Numerical correctness of attention()
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_plain_and_scale(impl):
    q, k, v = _qkv(1)
    out = attention(q, k, v, implementation=impl)
    assert isinstance(out, AttentionOutput) and out.attention_weights is None
    assert out.attention_outputs.shape == (B, T, 4, D) and out.attention_outputs.dtype == jnp.float32
    _close(out.attention_outputs, np_reference(q, k, v)[0])
    md = AttentionMetadata(softmax_scale=0.05)
    _close(attention(q, k, v, implementation=impl, metadata=md).attention_outputs, np_reference(q, k, v, scale=0.05)[0])


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@pytest.mark.parametrize("s", [S, 64])  # T < S and T > S
def test_causal_top_left(impl, s):
    q, k, v = _qkv(2, s=s)
    out = attention(q, k, v, causal=True, implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, causal=True)[0])


@pytest.mark.parametrize("s", [S, 64])
def test_causal_bottom_right_vanilla(s):
    q, k, v = _qkv(3, s=s)
    out = attention(q, k, v, causal=True, causal_alignment="bottom_right", implementation="vanilla").attention_outputs
    expected = np_reference(q, k, v, causal=True, alignment="bottom_right")[0]
    _close(out, expected)
    if s < T:  # the first T - S queries see no key at all: 0
        assert np.all(np.asarray(out)[:, : T - s] == 0)
    # automatic selection falls back to vanilla and agrees
    _close(attention(q, k, v, causal=True, causal_alignment="bottom_right").attention_outputs, expected)
    with pytest.raises(ValueError, match="causal_bottom_right"):
        attention(q, k, v, causal=True, causal_alignment="bottom_right", implementation="sdpa")


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_gqa(impl):
    q, k, v = _qkv(4, hq=6, hk=2)
    out = attention(q, k, v, implementation=impl).attention_outputs
    assert out.shape == (B, T, 6, D)
    _close(out, np_reference(q, k, v)[0])
    out = attention(q, k, v, causal=True, implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, causal=True)[0])


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@pytest.mark.parametrize("mask_shape", [(B, 6, T, S), pytest.param((B, 1, T, S), marks=pytest.mark.thorough), (T, S),
                                        pytest.param((1, 6, 1, S), marks=pytest.mark.thorough)])
def test_bool_mask(impl, mask_shape):
    q, k, v = _qkv(5, hq=6, hk=2)
    mask = np.random.default_rng(50).random(mask_shape) > 0.3
    out = attention(q, k, v, mask=jnp.asarray(mask), implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, mask=mask)[0])


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@pytest.mark.parametrize("bias_shape", [(B, 4, T, S), pytest.param((1, 4, T, S), marks=pytest.mark.thorough), (S,)])
def test_additive_bias(impl, bias_shape):
    q, k, v = _qkv(6)
    bias = _rand(np.random.default_rng(60), bias_shape)
    out = attention(q, k, v, bias=jnp.asarray(bias), implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, bias=bias)[0])
    # bias, bool mask and causal together
    mask = np.random.default_rng(61).random((B, 1, T, S)) > 0.2
    out = attention(q, k, v, bias=bias, mask=mask, causal=True, implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, bias=bias, mask=mask, causal=True)[0])


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@pytest.mark.parametrize("window", [(8, 3), (-1, 5), (10, -1), (0, 0), (-1, -1)])
def test_sliding_window_top_left(impl, window):
    q, k, v = _qkv(7, hq=6, hk=2)
    out = attention(q, k, v, sliding_window=window, implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, window=window)[0])


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_sliding_window_with_causal(impl):
    q, k, v = _qkv(8)
    out = attention(q, k, v, causal=True, sliding_window=(16, 4), implementation=impl).attention_outputs
    _close(out, np_reference(q, k, v, causal=True, window=(16, 4))[0])


@pytest.mark.parametrize("s", [S, 64])
@pytest.mark.parametrize("window", [(8, 3), (-1, 5), (10, -1), (0, 0)])
def test_sliding_window_bottom_right_vanilla(window, s):
    q, k, v = _qkv(9, s=s)
    expected = np_reference(q, k, v, window=window, alignment="bottom_right")[0]
    out = attention(q, k, v, sliding_window=window, causal_alignment="bottom_right", implementation="vanilla")
    _close(out.attention_outputs, expected)
    out = attention(q, k, v, sliding_window=window, causal=True, causal_alignment="bottom_right",
                    implementation="vanilla")
    _close(out.attention_outputs, np_reference(q, k, v, window=window, causal=True, alignment="bottom_right")[0])


def test_sliding_window_bottom_right_sdpa_falls_back():
    # sdpa only aligns windows top-left: a bottom-right window (T != S) is not for it, even without causal
    q, k, v = _qkv(10)
    expected = np_reference(q, k, v, window=(8, 3), alignment="bottom_right")[0]
    out = attention(q, k, v, sliding_window=(8, 3), causal_alignment="bottom_right")  # automatic -> vanilla
    _close(out.attention_outputs, expected)
    with pytest.raises(ValueError, match="causal_bottom_right"):
        attention(q, k, v, sliding_window=(8, 3), causal_alignment="bottom_right", implementation="sdpa")
    # with T == S the alignments coincide and sdpa may take it
    q, k, v = _qkv(10, s=T)
    out = attention(q, k, v, sliding_window=(8, 3), causal_alignment="bottom_right", implementation="sdpa")
    _close(out.attention_outputs, np_reference(q, k, v, window=(8, 3))[0])


def test_logits_soft_cap_vanilla():
    q, k, v = _qkv(11)
    q = q * 4  # large logits so the cap matters
    bias = _rand(np.random.default_rng(110), (1, 4, T, S))
    expected = np_reference(q, k, v, softcap=2.5, bias=bias, causal=True)[0]
    out = attention(q, k, v, logits_soft_cap=2.5, bias=bias, causal=True, implementation="vanilla").attention_outputs
    _close(out, expected)
    _close(attention(q, k, v, logits_soft_cap=2.5, bias=bias, causal=True).attention_outputs, expected)  # automatic
    assert not np.allclose(np.asarray(out), np_reference(q, k, v, bias=bias, causal=True)[0], atol=1e-3)


@pytest.mark.parametrize("sink_shape", [(6,), (6, 3)])
def test_attention_sinks_vanilla(sink_shape):
    q, k, v = _qkv(12, hq=6, hk=2)
    sinks = _rand(np.random.default_rng(120), sink_shape, scale=3.0)
    mask = np.random.default_rng(121).random((B, 1, T, S)) > 0.3
    mask[:, :, 5] = False  # a fully masked row: sinks take all the mass, output 0
    out, probs = np_reference(q, k, v, sinks=sinks, mask=mask)
    res = attention(q, k, v, softmax_aux=jnp.asarray(sinks), mask=mask, return_weights=True, implementation="vanilla")
    _close(res.attention_outputs, out)
    _close(res.attention_weights, probs)
    assert np.all(np.asarray(res.attention_outputs)[:, 5] == 0)
    # the sink absorbs mass: rows sum to less than one
    assert np.all(np.asarray(res.attention_weights).sum(-1) < 1)
    _close(attention(q, k, v, softmax_aux=sinks, mask=mask).attention_outputs, out)  # automatic -> vanilla
    with pytest.raises(ValueError, match="softmax_aux"):
        attention(q, k, v, softmax_aux=jnp.zeros((4,)), implementation="vanilla")


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_fully_masked_rows_give_zero(impl):
    q, k, v = _qkv(13)
    mask = np.random.default_rng(130).random((B, 4, T, S)) > 0.5
    mask[0, 1, 7] = False
    mask[1, :, 40] = False
    out = np.asarray(attention(q, k, v, mask=mask, implementation=impl).attention_outputs)
    assert np.all(np.isfinite(out))
    assert np.all(out[0, 7, 1] == 0) and np.all(out[1, 40] == 0)
    _close(out, np_reference(q, k, v, mask=mask)[0])
    # the same through a -inf additive bias
    bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
    out_b = np.asarray(attention(q, k, v, bias=bias, implementation=impl).attention_outputs)
    assert np.all(np.isfinite(out_b))
    _close(out_b, np_reference(q, k, v, mask=mask)[0])
    # a window that leaves the last queries without keys (T > S, right = 0, left = 0)
    q2, k2, v2 = _qkv(14, s=64)
    out_w = np.asarray(attention(q2, k2, v2, sliding_window=(0, 0), implementation=impl).attention_outputs)
    assert np.all(out_w[:, 64:] == 0)
    _close(out_w, np_reference(q2, k2, v2, window=(0, 0))[0])


def test_return_weights_vanilla():
    q, k, v = _qkv(15, hq=6, hk=2)
    bias = _rand(np.random.default_rng(150), (B, 1, T, S))
    out, probs = np_reference(q, k, v, bias=bias, causal=True)
    res = attention(q, k, v, bias=bias, causal=True, return_weights=True, implementation="vanilla")
    assert res.attention_weights.shape == (B, 6, T, S)
    _close(res.attention_weights, probs)
    np.testing.assert_allclose(np.asarray(res.attention_weights).sum(-1), 1.0, rtol=1e-5)
    _close(res.attention_outputs, out)
    # automatic selection: weights force vanilla
    assert attention(q, k, v, return_weights=True).attention_weights is not None
    with pytest.raises(ValueError, match="feature 'weights' not supported"):
        attention(q, k, v, return_weights=True, implementation="sdpa")


def test_dropout_vanilla():
    p = 0.3
    b, t, h, s = 2, 32, 2, 16
    rng = np.random.default_rng(16)
    q = _rand(rng, (b, t, h, 8))
    k = _rand(rng, (b, s, h, 8))
    # value = one-hot of the key index: the output row *is* the (dropped-out) weight row
    v = np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, h, s)).copy()
    md = AttentionMetadata(dropout_prob=p)
    key1, key2 = jax.random.key(0), jax.random.key(1)
    res1 = attention(q, k, v, dropout_rng=key1, metadata=md, return_weights=True)
    res1b = attention(q, k, v, dropout_rng=key1, metadata=md, return_weights=True)
    res2 = attention(q, k, v, dropout_rng=key2, metadata=md)
    o1, o1b, o2 = (np.asarray(r.attention_outputs) for r in (res1, res1b, res2))
    np.testing.assert_array_equal(o1, o1b)  # deterministic for a fixed key
    assert not np.array_equal(o1, o2)  # another key, another mask
    probs = np.asarray(res1.attention_weights)  # (B, H, T, S), before dropout
    _close(probs, np_reference(q, k, v)[1])
    dropped = np.swapaxes(o1, 1, 2)  # (B, H, T, S)
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], probs[kept] / (1 - p), rtol=1e-5)  # survivors scaled by 1/(1-p)
    assert abs((~kept).mean() - p) < 0.05
    # no key or no probability: no dropout
    plain = np_reference(q, k, v)[0]
    _close(attention(q, k, v, metadata=md).attention_outputs, plain)
    _close(attention(q, k, v, dropout_rng=key1).attention_outputs, plain)
    with pytest.raises(ValueError, match="feature 'dropout' not supported"):
        attention(q, k, v, dropout_rng=key1, metadata=md, implementation="sdpa")


def test_runtime_dtype_and_float64_vanilla():
    q, k, v = _qkv(17, t=20, s=33, d=16)
    md = AttentionMetadata(runtime_dtype="bfloat16")
    out = attention(q, k, v, implementation="vanilla", metadata=md).attention_outputs
    assert out.dtype == jnp.bfloat16
    _close(out, np_reference(q, k, v)[0], atol=3e-2, rtol=3e-2)
    _check_float64("vanilla")


def _check_float64(impl):
    q, k, v = _qkv(17, t=20, s=33, d=16)
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        out = attention(q64, k64, v64, causal=True, implementation=impl).attention_outputs
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), np_reference(q, k, v, causal=True)[0], atol=1e-12, rtol=1e-12)


def test_float64_goes_to_vanilla_not_sdpa():
    # jax.nn computes the softmax in float32, so sdpa does not take float64: automatic selection keeps x64 precision
    _check_float64(None)
    q, k, v = _qkv(17, t=20, s=33, d=16)
    with jax.enable_x64(True):
        q64 = jnp.asarray(q, jnp.float64)
        with pytest.raises(ValueError, match="dtype float64 not in"):
            attention(q64, q64, q64, implementation="sdpa")


def test_float16_and_bfloat16_on_cpu():
    q, k, v = _qkv(29, t=20, s=33, hq=4, hk=2, d=16)
    expected = np_reference(q, k, v, causal=True)[0]
    for dtype, impls in ((jnp.bfloat16, ("vanilla", "sdpa", None)), (jnp.float16, ("vanilla", None))):
        args = [jnp.asarray(x, dtype) for x in (q, k, v)]
        for impl in impls:
            out = attention(*args, causal=True, implementation=impl).attention_outputs
            assert out.dtype == dtype, (dtype, impl)
            _close(out.astype(jnp.float32), expected, atol=3e-2, rtol=3e-2)
    # sdpa declines float16 on cpu (XLA:CPU lacks jax.nn's f16 dot precision)
    with pytest.raises(ValueError, match="float16 on cpu"):
        attention(*[jnp.asarray(x, jnp.float16) for x in (q, k, v)], implementation="sdpa")
    assert AttentionRegistry.select(_inputs(dtype="float16")) is AttentionRegistry.get("vanilla")
    assert AttentionRegistry.select(_inputs(dtype="bfloat16")) is AttentionRegistry.get("sdpa")
    assert AttentionRegistry.select(_inputs(dtype="float64")) is AttentionRegistry.get("vanilla")


def _oracle_grads(q, k, v, loss, *, bias=None, mask=None, **kw):
    """float64 gradients of loss(out) w.r.t. q, k, v (and the bias, when given) by the oracle on
    (B, T, H, D) arrays; NumPy, in the inputs' layouts."""
    t = lambda x: torch.from_numpy(np.asarray(x, np.float64))  # noqa: E731
    leaves = [t(x).transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
    b = None if bias is None else t(bias).requires_grad_(True)
    out, _ = reference(*leaves, bias=b, mask=None if mask is None else torch.from_numpy(np.asarray(mask, bool)), **kw)
    grads = torch.autograd.grad(loss(out.transpose(1, 2)), leaves + ([] if b is None else [b]))
    return [g.transpose(1, 2).numpy() for g in grads[:3]] + [g.numpy() for g in grads[3:]]


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_gradients_match_float64_reference(impl):
    q, k, v = _qkv(18, b=1, hq=6, hk=2)
    rng = np.random.default_rng(180)
    bias = _rand(rng, (1, 6, T, S))
    ct = _rand(rng, (1, T, 6, D))

    def loss(q, k, v, bias):
        out = attention(q, k, v, bias=bias, causal=True, implementation=impl).attention_outputs
        return jnp.sum(out * ct)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    ref_grads = _oracle_grads(q, k, v, lambda out: (out * torch.from_numpy(np.asarray(ct, np.float64))).sum(),
                              bias=bias, causal=True)
    for g, r, name in zip(grads, ref_grads, "qkvb"):
        assert g.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(g), r, atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
def test_gradients_finite_with_fully_masked_rows(impl):
    q, k, v = _qkv(19, b=1, t=24, s=31, d=16)
    mask = np.random.default_rng(190).random((1, 4, 24, 31)) > 0.5
    mask[0, :, 3] = False

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, mask=mask, implementation=impl).attention_outputs ** 2)

    gq, gk, gv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g in (gq, gk, gv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(gq)[0, 3] == 0)  # a fully masked query gets no gradient
    ref = _oracle_grads(q, k, v, lambda out: (out ** 2).sum(), mask=mask)
    for g, r in zip((gq, gk, gv), ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["vanilla", pytest.param("sdpa", marks=pytest.mark.thorough)])
def test_bhtd_layout_matches_bthd(impl):
    q, k, v = _qkv(27, t=33, s=47, hq=6, hk=2, d=24, dv=24)
    mask = np.random.default_rng(270).random((B, 1, 33, 47)) > 0.3
    mask[0, 0, 2] = False
    bias = _rand(np.random.default_rng(271), (1, 6, 33, 47))
    kwargs = dict(mask=mask, bias=bias, causal=True, implementation=impl)
    expected = np_reference(q, k, v, mask=mask, bias=bias, causal=True)[0]
    swap = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))
    out = attention(swap(q), swap(k), swap(v), layout="BHTD", **kwargs).attention_outputs
    assert out.shape == (B, 6, 33, 24)
    _close(np.swapaxes(np.asarray(out), 1, 2), expected)
    # gradients agree between layouts too
    loss_bthd = lambda q, k, v: jnp.sum(attention(q, k, v, **kwargs).attention_outputs ** 2)
    loss_bhtd = lambda q, k, v: jnp.sum(attention(q, k, v, layout="BHTD", **kwargs).attention_outputs ** 2)
    g1 = jax.jit(jax.grad(loss_bthd, argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(loss_bhtd, argnums=(0, 1, 2)))(swap(q), swap(k), swap(v))
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.swapaxes(np.asarray(b), 1, 2), np.asarray(a), atol=1e-5, rtol=1e-5)


def test_bhtd_layout_vanilla_features():
    q, k, v = _qkv(28, t=21, s=30, hq=4, hk=2, d=16, dv=8)
    sinks = _rand(np.random.default_rng(280), (4,))
    swap = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))
    res = attention(swap(q), swap(k), swap(v), layout="BHTD", softmax_aux=sinks, logits_soft_cap=3.0,
                    sliding_window=(4, 2), causal_alignment="bottom_right", return_weights=True)
    out, probs = np_reference(q, k, v, sinks=sinks, softcap=3.0, window=(4, 2), alignment="bottom_right")
    assert res.attention_outputs.shape == (B, 4, 21, 8)
    _close(np.swapaxes(np.asarray(res.attention_outputs), 1, 2), out)
    _close(res.attention_weights, probs)


def test_jit_attention():
    q, k, v = _qkv(20, t=17, s=29, d=16)
    f = jax.jit(lambda q, k, v: attention(q, k, v, causal=True).attention_outputs)
    _close(f(q, k, v), np_reference(q, k, v, causal=True)[0])


def test_malformed_inputs_raise():
    q, k, v = _qkv(21, t=5, s=7, d=8)
    with pytest.raises(ValueError, match="query: expected a 4-D \\(BTHD\\) array"):
        attention(q[0], k[0], v[0], implementation="vanilla")
    with pytest.raises(ValueError, match="expected a 4-D"):
        AttentionRegistry.create("sdpa", AttentionMetadata())(q, k[0], v, layout="BHTD")
    with pytest.raises(ValueError, match="layout"):
        attention(q, k, v, layout="THBD", implementation="vanilla")
    with pytest.raises(ValueError, match="batch sizes differ"):
        attention(q, k[:1], v[:1], implementation="vanilla")
    with pytest.raises(ValueError, match="disagree on"):
        attention(q, k, v[:, :3], implementation="vanilla")
    with pytest.raises(ValueError, match="mask: expected dtype bool"):
        attention(q, k, v, mask=np.ones((5, 7), np.float32), implementation="vanilla")
    with pytest.raises(ValueError, match="not broadcastable"):
        attention(q, k, v, bias=np.ones((5, 8), np.float32), implementation="vanilla")
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionRegistry.create("vanilla", AttentionMetadata())(q, k, v, sliding_window=(-2, 3))
    with pytest.raises(ValueError, match="causal_alignment"):
        AttentionRegistry.create("vanilla", AttentionMetadata())(q, k, v, causal=True, causal_alignment="middle")


# ----------------------------------------------------------------------------------------------
# Meshes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [pytest.param("sdpa", marks=pytest.mark.thorough), "vanilla"])
def test_mesh_matches_unsharded(mesh22, impl):
    q, k, v = _qkv(22, b=2, t=33, s=40, hq=4, hk=2, d=16)
    rng = np.random.default_rng(220)
    mask = rng.random((2, 1, 33, 40)) > 0.3
    mask[1, 0, 4] = False
    bias = _rand(rng, (1, 4, 33, 40))
    md = AttentionMetadata(mesh=mesh22)
    kwargs = dict(mask=jnp.asarray(mask), bias=jnp.asarray(bias), causal=True, implementation=impl)
    sharded = attention(q, k, v, metadata=md, **kwargs).attention_outputs  # eager, under shard_map
    plain = jax.jit(lambda q, k, v: attention(q, k, v, **kwargs).attention_outputs)(q, k, v)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(plain), atol=1e-6, rtol=1e-6)
    _close(sharded, np_reference(q, k, v, mask=mask, bias=bias, causal=True)[0])
    assert len(sharded.sharding.device_set) == 4
    # sliding window and GQA under the mesh too (positions stay global), and inside jit
    sharded = jax.jit(lambda q, k, v: attention(q, k, v, metadata=md, sliding_window=(5, 2),
                                                implementation=impl).attention_outputs)(q, k, v)
    _close(sharded, np_reference(q, k, v, window=(5, 2))[0])


def test_mesh_vanilla_weights_and_sinks(mesh22):
    q, k, v = _qkv(23, b=2, t=9, s=12, hq=4, hk=2, d=8)
    sinks = _rand(np.random.default_rng(230), (4,))
    res = attention(q, k, v, softmax_aux=sinks, return_weights=True, metadata=AttentionMetadata(mesh=mesh22))
    out, probs = np_reference(q, k, v, sinks=sinks)
    _close(res.attention_outputs, out)
    _close(res.attention_weights, probs)


def test_mesh_dropout_vanilla(mesh22):
    p = 0.5
    rng = np.random.default_rng(231)
    q, k = _rand(rng, (2, 8, 4, 8)), _rand(rng, (2, 16, 2, 8))
    v = np.broadcast_to(np.eye(16, dtype=np.float32)[None, :, None, :], (2, 16, 2, 16)).copy()
    md = AttentionMetadata(mesh=mesh22, dropout_prob=p)
    f = jax.jit(lambda q, k, v, key: attention(q, k, v, dropout_rng=key, metadata=md, return_weights=True))
    r1, r2, r3 = f(q, k, v, jax.random.key(0)), f(q, k, v, jax.random.key(0)), f(q, k, v, jax.random.key(1))
    o1 = np.asarray(r1.attention_outputs)
    np.testing.assert_array_equal(o1, np.asarray(r2.attention_outputs))
    assert not np.array_equal(o1, np.asarray(r3.attention_outputs))
    dropped, probs = np.swapaxes(o1, 1, 2), np.asarray(r1.attention_weights)
    _close(probs, np_reference(q, k, v)[1])
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], probs[kept] / (1 - p), rtol=1e-5)
    assert abs((~kept).mean() - p) < 0.1


def test_mesh_indivisible_heads_or_batch(mesh22):
    md = AttentionMetadata(mesh=mesh22)
    q, k, v = _qkv(24, b=2, t=8, s=8, hq=2, hk=1, d=8)
    for impl in ("sdpa", "vanilla"):
        with pytest.raises(ValueError) as info:
            attention(q, k, v, metadata=md, implementation=impl)
        assert "num_kv_heads=1 is not divisible by mesh head axis size 2" in str(info.value)
    with pytest.raises(NotImplementedError, match="num_kv_heads=1 is not divisible"):
        attention(q, k, v, metadata=md)
    q, k, v = _qkv(25, b=3, t=8, s=8, hq=2, hk=2, d=8)
    with pytest.raises(ValueError, match="batch=3 is not divisible by mesh batch axis size 2"):
        attention(q, k, v, metadata=md, implementation="vanilla")
    # without a head axis in the partition, Hk=1 is fine
    md = AttentionMetadata(mesh=mesh22, partition_axis=PartitionAxis(batch_axis="dp", head_axis=None))
    q, k, v = _qkv(26, b=2, t=8, s=8, hq=2, hk=1, d=8)
    _close(attention(q, k, v, metadata=md, implementation="sdpa").attention_outputs, np_reference(q, k, v)[0])


# ----------------------------------------------------------------------------------------------
# AttentionImpl helpers
# ----------------------------------------------------------------------------------------------


def test_get_mode_and_backend():
    impl = AttentionRegistry.create("vanilla", AttentionMetadata())
    assert impl.get_mode(jnp.zeros((2, 1, 4, 8))) == "__autoregressive__"
    assert impl.get_mode(jnp.zeros((2, 7, 4, 8))) == "__train__"
    assert impl.get_mode(jnp.zeros((2, 4, 1, 8)), BTHD=False) == "__autoregressive__"
    assert impl.get_mode(jnp.zeros((2, 1, 7, 8)), BTHD=False) == "__train__"
    assert impl.current_backend() == "cpu"
    assert jc.platform_of(jnp.zeros(3)) == "cpu" and jc.backend_of("cpu") == "cpu"


def test_repeat_kv_heads():
    k = jnp.arange(2 * 5 * 3 * 4, dtype=jnp.float32).reshape(2, 5, 3, 4)
    v = k + 1000
    rk, rv = AttentionImpl.repeat_kv_heads(k, v, 4)
    assert rk.shape == rv.shape == (2, 5, 12, 4)
    np.testing.assert_array_equal(rk[:, :, 4 * 2 + 1], k[:, :, 2])  # head h -> kv head h // 4
    np.testing.assert_array_equal(rv[:, :, 3], v[:, :, 0])


def test_create_stable_sharding():
    ps = P("dp", "sp", "tp", None)
    f = AttentionImpl.create_stable_sharding
    assert f(ps) is ps
    assert f(None, [0]) is None
    assert f(ps, [0, 2], dep=None) is None
    assert f(ps, [0, 2]) == P("dp", None, "tp", None)
    assert f(ps, [1], clone_ps=P("a", "b", "c", "d")) == P(None, "b", None, None)
    assert f(ps, [0, 2], tensor=jnp.zeros((4, 8, 1, 16))) == P("dp", None, None, None)  # size-1 dims stay whole
