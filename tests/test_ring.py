"""Ring attention (jax_core/ring.py, ring_layout.py) on 4 and 8 simulated CPU devices.

Oracle: the float64 torch reference (tests/attention_reference.py) for outputs, LSE and gradients;
single-device `vanilla` is checked too. The GPU block kernels (Triton) run here under Triton's
interpreter through the jax-triton stand-in (tests/jax_triton_interpret.py).
"""

import importlib.util
import pathlib
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attention_reference import assert_dtype_rule, reference, reference_grads

from jaxattn.jax_core import AttentionMetadata, AttentionRegistry, PartitionAxis, attention, ring_attention
from jaxattn.jax_core import ring_layout as rl
from jaxattn.jax_core.capabilities import AttentionInputs

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 simulated CPU devices (conftest.py)")


def _mesh(n, names=("sp",), shape=None):
    devices = np.array(jax.devices("cpu")[:n]).reshape(shape or (n,))
    return Mesh(devices, names)


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _j(t):
    return jnp.asarray(t.transpose(1, 2).numpy().astype(np.float32))


def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).transpose(1, 2)


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), atol=tol, rtol=tol)


def _case(seed, b, hq, hk, t, s, d, segments=False, sinks=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _rand(gen, b, hq, t, d), _rand(gen, b, hk, s, d), _rand(gen, b, hk, s, d)
    cot = _rand(gen, b, hq, t, d)
    seg = None
    if segments:
        seg = (torch.randint(0, 3, (b, t), generator=gen), torch.randint(0, 3, (b, s), generator=gen))
    aux = _rand(gen, hq) if sinks else None
    return q, k, v, cot, seg, aux


def _oracle(q, k, v, cot, seg, aux, **kw):
    out, lse, grads = reference_grads(q, k, v, cot, segment_ids=seg, sinks=aux, **kw)
    return out, lse, grads[:3]


def alibi_matrix(slopes: torch.Tensor, t: int, s: int) -> torch.Tensor:
    """float64 (B|1, Hq, T, S) ALiBi bias written from flash-attn's formula: -slope * |i + S - T - j|."""
    i = torch.arange(t, dtype=torch.float64).view(t, 1)
    j = torch.arange(s, dtype=torch.float64).view(1, s)
    return -slopes.double().reshape(-1, slopes.shape[-1])[:, :, None, None] * (i + (s - t) - j).abs()


def _slopes(seed, shape):
    """Random positive float32 slopes, large enough that ALiBi dominates some logits."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5 + 0.05


def _check_ring(n, *, layout=None, causal=False, window=None, softcap=None, kernel="xla", seed=0, b=2, hq=4, hk=2,
                t=64, s=None, d=16, segments=False, sinks=False, tol=3e-5, alibi=None):
    """`alibi`: None, or the shape of random ALiBi slopes ((Hq,) or (B, Hq))."""
    s = s or t
    q, k, v, cot, seg, aux = _case(seed, b, hq, hk, t, s, d, segments, sinks)
    slopes = None if alibi is None else _slopes(seed, alibi)
    bias = None if slopes is None else alibi_matrix(slopes, t, s)
    out_ref, lse_ref, grads_ref = _oracle(q, k, v, cot, seg, aux, causal=causal, window=window, softcap=softcap,
                                          bias=bias)
    mesh = _mesh(n)
    seg_j = None if seg is None else tuple(jnp.asarray(x.numpy(), jnp.int32) for x in seg)
    aux_j = None if aux is None else jnp.asarray(aux.numpy(), jnp.float32)
    slopes_j = None if slopes is None else jnp.asarray(slopes.numpy())

    def f(q_, k_, v_):
        return ring_attention(q_, k_, v_, mesh=mesh, causal=causal, sliding_window=window, logits_soft_cap=softcap,
                              segment_ids=seg_j, softmax_aux=aux_j, layout=layout, kernel=kernel, chunk_q=16,
                              chunk_k=16, return_lse=True, alibi_slopes=slopes_j)

    qj, kj, vj = _j(q), _j(k), _j(v)
    out, lse = f(qj, kj, vj)
    _close(_t(out), out_ref, tol)
    finite = torch.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite.numpy())
    _close(np.where(finite.numpy(), np.asarray(lse), 0), torch.where(finite, lse_ref, 0), tol)
    grads = jax.grad(lambda *a: jnp.sum(f(*a)[0] * _j(cot)), argnums=(0, 1, 2))(qj, kj, vj)
    for g, gr in zip(grads, grads_ref):
        _close(_t(g), gr, 2 * tol)
    return out, grads


# --- outputs and gradients equal single-device attention --------------------------------------------


THOROUGH = pytest.mark.thorough  # each ring case compiles a sharded forward and backward (seconds each)


@pytest.mark.parametrize("n,layout,causal", [
    (4, "zigzag", True),
    pytest.param(4, "striped", True, marks=THOROUGH),
    pytest.param(4, "contiguous", True, marks=THOROUGH),  # uneven work: device r computes r + 1 of the 4 blocks
    (4, "contiguous", False),
    pytest.param(8, "zigzag", True, marks=THOROUGH),
    pytest.param(8, "contiguous", False, marks=THOROUGH),
])
def test_ring_matches_reference(n, layout, causal):
    out, grads = _check_ring(n, layout=layout, causal=causal, seed=n + len(layout), t=16 * n)
    if n == 4 and layout == "zigzag":  # and single-device vanilla on the same inputs
        q, k, v, cot, _, _ = _case(n + len(layout), 2, 4, 2, 64, 64, 16)
        ref = attention(_j(q), _j(k), _j(v), causal=True, implementation="vanilla").attention_outputs
        _close(out, ref, 2e-5)


@THOROUGH  # each feature alone is in test_conformance.py (ring, 2 devices)
def test_ring_gqa_awkward_lengths_and_features():
    """T=97 (padded to a multiple of 2n), MQA, head dim 80, window, soft cap, segment ids, sinks."""
    _check_ring(4, layout="zigzag", causal=True, window=(9, -1), softcap=3.0, segments=True, sinks=True, seed=5,
                b=1, hq=4, hk=1, t=97, d=80)


@THOROUGH  # T != S is in test_conformance.py's ring cases
def test_ring_cross_attention_uneven_lengths_and_bidirectional_window():
    _check_ring(4, causal=False, t=40, s=52, seed=6, hq=6, hk=3)  # padded keys hidden by segment ids
    _check_ring(8, layout="striped", causal=False, window=(5, 3), segments=True, t=64, seed=7)


@pytest.mark.parametrize("n,layout,causal,slopes", [
    (2, "zigzag", True, (4,)),
    (4, "striped", True, (2, 4)),
    pytest.param(4, "zigzag", True, (2, 4), marks=THOROUGH),
    pytest.param(2, "contiguous", True, (4,), marks=THOROUGH),
    pytest.param(4, "contiguous", False, (2, 4), marks=THOROUGH),
    pytest.param(2, "striped", False, (4,), marks=THOROUGH),
    pytest.param(4, "zigzag", False, (4,), marks=THOROUGH),
])
def test_ring_alibi_matches_reference(n, layout, causal, slopes):
    """ALiBi over global positions in every layout: a block's bias depends on where its tokens sit
    in the whole sequence, not in the shard (GQA 4/2 heads, head dim 16, forward, LSE and gradients)."""
    _check_ring(n, layout=layout, causal=causal, alibi=slopes, seed=30 + n + len(layout), t=16 * n)


@THOROUGH  # two more sharded compilations, with padding
def test_ring_alibi_awkward_lengths():
    """T=97, S=97 padded to a multiple of 2n (zigzag, causal, MQA, head dim 32, window, soft cap), and
    cross attention T=40, S=52 (the bottom-right shift S - T, padded keys hidden)."""
    _check_ring(4, layout="zigzag", causal=True, window=(9, -1), softcap=3.0, alibi=(1, 4), seed=40, b=1, hq=4, hk=1,
                t=97, d=32)
    _check_ring(4, causal=False, t=40, s=52, alibi=(2, 6), seed=41, hq=6, hk=3)


def test_ring_alibi_positions_and_refusals():
    """Traced shard positions equal the layout's permutation; malformed slopes and the Triton block
    kernel (local ALiBi distances only) are refused with the reason; the registered ring declares ALiBi."""
    for layout in rl.LAYOUTS:
        for n, local in ((2, 8), (4, 6)):
            for d in range(n):
                np.testing.assert_array_equal(rl.positions_of_device(layout, n, local, jnp.int32(d)),
                                              rl.shard_positions(layout, n, local, d))
    q = jnp.ones((2, 16, 4, 8))
    mesh = _mesh(2)
    with pytest.raises(ValueError, match=r"alibi_slopes: shape \(3,\).*\(Hq,\)=\(4,\) or \(B, Hq\)=\(2, 4\)"):
        ring_attention(q, q, q, mesh=mesh, alibi_slopes=jnp.ones(3))
    with pytest.raises(ValueError, match="alibi_slopes: shape \\(4,\\) and dtype int32"):
        ring_attention(q, q, q, mesh=mesh, alibi_slopes=jnp.ones(4, jnp.int32))
    with pytest.raises(ValueError, match="kernel='triton' with alibi_slopes"):
        ring_attention(q, q, q, mesh=mesh, kernel="triton", alibi_slopes=jnp.ones(4))
    inputs = AttentionInputs.from_arrays(q, q, q, platform="cpu", backend="cpu", causal=True, alibi=True)
    assert AttentionRegistry.get("ring").not_supported_reasons(inputs, AttentionMetadata(mesh=mesh)) == []


def test_ring_alibi_through_attention_with_batch_sharding():
    """`attention(..., alibi_slopes=)` selects the ring and hands it the slopes; (B, Hq) slopes are
    split like the batch over a "dp" axis while the sequence rings over "sp"."""
    mesh = _mesh(8, ("dp", "sp"), (2, 4))
    md = AttentionMetadata(mesh=mesh, partition_axis=PartitionAxis(batch_axis="dp", head_axis="tp"))
    q, k, v, _, _, _ = _case(42, 2, 4, 2, 64, 64, 16)
    slopes = _slopes(42, (2, 4))
    out = attention(_j(q), _j(k), _j(v), causal=True, metadata=md, return_lse=True,
                    alibi_slopes=jnp.asarray(slopes.numpy()))
    ref, lse_ref = reference(q, k, v, causal=True, bias=alibi_matrix(slopes, 64, 64))
    _close(_t(out.attention_outputs), ref, 2e-5)
    _close(out.lse, lse_ref, 2e-5)


@pytest.mark.parametrize("n", [pytest.param(2, marks=THOROUGH), pytest.param(8, marks=THOROUGH)])
def test_ring_accumulation_in_input_dtype_bf16(n):  # by default: test_torch_ring_accumulation_input_bf16
    """accumulation="input": bf16 partials and dK / dV travelling in bf16 stay within flash-attn's
    rule (error against float64 at most 2x that of torch's own bf16 attention), on 2 and 8 devices;
    float32 accumulation is checked alongside, and the option is refused when misspelt."""
    q, k, v, cot, _, _ = _case(20 + n, 1, 4, 2, 32 * n, 32 * n, 64)
    q, k, v, cot = (x.bfloat16().double() for x in (q, k, v, cot))  # inputs exactly representable in bf16
    _, _, exact = _oracle(q, k, v, cot, None, None, causal=True)
    out_exact = reference(q, k, v, causal=True)[0]
    qb, kb, vb = (x.bfloat16().requires_grad_(True) for x in (q, k, v))
    out_torch = reference(qb, kb, vb, causal=True, dtype=torch.bfloat16)[0]
    (out_torch.double() * cot).sum().backward()
    torch_bf16 = [out_torch.detach(), qb.grad, kb.grad, vb.grad]
    mesh = _mesh(n)
    bf = lambda t: jnp.asarray(_j(t), jnp.bfloat16)  # noqa: E731
    for accumulation in ("input", "float32"):
        def loss(a, b_, c):
            out = ring_attention(a, b_, c, mesh=mesh, causal=True, chunk_q=16, chunk_k=16, accumulation=accumulation)
            return jnp.sum(out.astype(jnp.float32) * _j(cot)), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(bf(q), bf(k), bf(v))
        assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
        for name, mine, e, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_exact, *exact), torch_bf16):
            assert_dtype_rule(f"{accumulation} {name}", _t(mine.astype(jnp.float32)), e, theirs, floor=1e-3)
    with pytest.raises(ValueError, match="accumulation='bf16'"):
        ring_attention(bf(q), bf(k), bf(v), mesh=mesh, causal=True, accumulation="bf16")


@THOROUGH  # interpreted flash kernels on 2 and 4 simulated devices
def test_ring_triton_block_kernels_under_interpreter(monkeypatch):
    """The GPU path (Triton flash kernels as block kernels, float32 partials) on 2 and 4 devices."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import jax_triton_interpret

    lock = threading.Lock()  # one interpreted kernel at a time across the simulated devices

    class Locked:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                with lock:
                    return launch(*args, **kwargs)
            return run

    module = jax_triton_interpret.module()
    module.triton_call = lambda *a, kernel, **kw: jax_triton_interpret.triton_call(*a, kernel=Locked(kernel), **kw)
    monkeypatch.setitem(sys.modules, "jax_triton", module)
    _check_ring(2, layout="zigzag", causal=True, kernel="triton", b=1, t=64, seed=8, tol=5e-5)
    _check_ring(4, layout="striped", causal=True, window=(5, -1), softcap=2.0, segments=True, kernel="triton", b=1,
                t=64, seed=9, tol=5e-5)


# --- layouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", rl.LAYOUTS)
@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=THOROUGH)])
def test_layout_round_trips(layout, n):
    length = 2 * n * n
    perm = rl.layout_permutation(length, n, layout)
    assert sorted(perm.tolist()) == list(range(length))
    np.testing.assert_array_equal(perm[rl.inverse_permutation(perm)], np.arange(length))
    x = jnp.arange(2 * length * 3).reshape(2, length, 3)
    np.testing.assert_array_equal(rl.from_layout(rl.to_layout(x, n, layout), n, layout), x)
    for d in range(n):
        np.testing.assert_array_equal(rl.shard_positions(layout, n, length // n, d),
                                      perm[d * length // n:(d + 1) * length // n])
    mesh = _mesh(n)
    spec = P(None, "sp")
    to = jax.jit(jax.shard_map(lambda a: rl.to_layout_sharded(a, "sp", n, layout), mesh=mesh, in_specs=spec,
                               out_specs=spec))
    back = jax.jit(jax.shard_map(lambda a: rl.from_layout_sharded(a, "sp", n, layout), mesh=mesh, in_specs=spec,
                                 out_specs=spec))
    moved = to(x)
    np.testing.assert_array_equal(moved, rl.to_layout(x, n, layout))
    np.testing.assert_array_equal(back(moved), x)


def test_zigzag_example_and_errors():
    np.testing.assert_array_equal(rl.layout_permutation(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(rl.layout_permutation(8, 2, "striped"), [0, 2, 4, 6, 1, 3, 5, 7])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        rl.layout_permutation(12, 4, "zigzag")
    with pytest.raises(ValueError, match="layout='spiral'"):
        rl.layout_permutation(8, 2, "spiral")


def test_causal_work_is_balanced_and_masked_steps_are_skipped():
    causal = rl.rule_for(True, None)
    assert len(set(rl.work_per_device(4, "zigzag", 64, 64, causal))) == 1
    striped = rl.work_per_device(4, "striped", 64, 64, causal)
    assert max(striped) - min(striped) <= 64 * 4  # differs by at most one diagonal per step
    contiguous = rl.work_per_device(4, "contiguous", 64, 64, causal)
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    # contiguous: a device never computes a block that lies wholly in its future
    for t in range(1, 4):
        plan = rl.plan_step(t, 4, "contiguous", 64, 64, causal)
        for r in range(4):
            assert (plan.branches[plan.index[r]] == ()) == (r < t)
    # zigzag: after step 0 each device computes exactly half a block, as one kernel call
    for t in range(1, 4):
        plan = rl.plan_step(t, 4, "zigzag", 64, 64, causal)
        for pieces in plan.branches:
            assert len(pieces) == 1 and pieces[0].q_len * pieces[0].k_len == 64 * 32 and pieces[0].band == (None, None)


@THOROUGH  # compiles the sharded backward to read its HLO
def test_inputs_in_layout_and_no_full_sequence_on_a_device():
    n, t = 4, 64
    q, k, v, cot, _, _ = _case(11, 1, 2, 2, t, t, 8)
    mesh = _mesh(n)
    sharding = NamedSharding(mesh, P(None, "sp", None, None))
    qj, kj, vj = (jax.device_put(_j(x), sharding) for x in (q, k, v))
    natural = ring_attention(qj, kj, vj, mesh=mesh, causal=True)
    assert natural.sharding.spec == P(None, "sp", None, None)
    permuted = [rl.to_layout(x, n, "zigzag") for x in (qj, kj, vj)]
    out = ring_attention(*permuted, mesh=mesh, causal=True, layout="zigzag", inputs_in_layout=True)
    _close(rl.from_layout(out, n, "zigzag"), natural, 1e-6)
    with pytest.raises(ValueError, match="inputs_in_layout=True: T=60 and S=60 must be multiples of 8"):
        ring_attention(qj[:, :60], kj[:, :60], vj[:, :60], mesh=mesh, causal=True, inputs_in_layout=True)

    def loss(q_, k_, v_):
        return jnp.sum(ring_attention(q_, k_, v_, mesh=mesh, causal=True) * _j(cot))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qj, kj, vj).compile().as_text()
    # blocks move by collective-permute; nothing gathers the sequence onto one device
    assert "collective-permute" in hlo and "all-gather" not in hlo


# --- the registered implementation -----------------------------------------------------------------


def test_ring_selected_by_sequence_axis_and_batch_sharding():
    mesh = _mesh(8, ("dp", "sp"), (2, 4))
    md = AttentionMetadata(mesh=mesh, partition_axis=PartitionAxis(batch_axis="dp", head_axis="tp"))
    q, k, v, _, _, _ = _case(12, 2, 4, 2, 64, 64, 16)
    inputs = AttentionInputs.from_arrays(_j(q), _j(k), _j(v), platform="cpu", backend="cpu", causal=True)
    assert AttentionRegistry.select(inputs, md).canonical_name() == "ring"
    assert AttentionRegistry.select(inputs, AttentionMetadata()).canonical_name() != "ring"
    out = attention(_j(q), _j(k), _j(v), causal=True, metadata=md, return_lse=True)
    ref, lse_ref = reference(q, k, v, causal=True)
    _close(_t(out.attention_outputs), ref, 2e-5)
    _close(out.lse, lse_ref, 2e-5)


def test_ring_refuses_what_it_cannot_do():
    q = jnp.ones((1, 16, 2, 8))
    md = AttentionMetadata(mesh=_mesh(4))
    with pytest.raises(ValueError, match="ring needs metadata.mesh"):
        attention(q, q, q, implementation="ring")
    with pytest.raises(ValueError, match="sequence_axis_name='seq' is not an axis"):
        attention(q, q, q, implementation="ring", metadata=md.replace(sequence_axis_name="seq"))
    with pytest.raises(ValueError, match="feature 'bias' not supported"):
        attention(q, q, q, bias=jnp.zeros((1, 2, 16, 16)), implementation="ring", metadata=md)
    with pytest.raises(ValueError, match="causal needs q_len == kv_len"):
        attention(q, q[:, :8], q[:, :8], causal=True, implementation="ring", metadata=md)
    with pytest.raises(ValueError, match="layout='diagonal'"):
        ring_attention(q, q, q, mesh=md.mesh, layout="diagonal")
    with pytest.raises(ValueError, match="axis_name='ring' is not an axis"):
        ring_attention(q, q, q, mesh=md.mesh, axis_name="ring")
    with pytest.raises(ValueError, match="kernel='pallas'"):
        ring_attention(q, q, q, mesh=md.mesh, kernel="pallas")


@THOROUGH  # the same ring as test_ring_matches_reference, at 256 tokens
def test_example_runs_small():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "ring_simulated.py"
    spec = importlib.util.spec_from_file_location("ring_simulated", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    errors = example.main(devices=4, seq=256, heads=4, kv_heads=2, head_dim=32, verbose=False)
    assert max(errors.values()) < 1e-4


@THOROUGH  # the torch ring's backward runs it by default (test_torch_full_tensors_shards_and_compile)
def test_backward_from_saved_output_matches_oracle():
    """ring_attention_backward (used by the torch API) from the saved (out, lse), with padding
    (T=50 on 4 devices), segment ids, a window and an LSE cotangent."""
    from jaxattn.jax_core.ring import ring_attention_backward

    gen = torch.Generator().manual_seed(13)
    b, hq, hk, t, d = 1, 4, 2, 50, 16
    q, k, v, cot, seg, _ = _case(13, b, hq, hk, t, t, d, segments=True)
    lse_cot = _rand(gen, b, hq, t)
    qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
    out_ref, lse_ref = reference(qt, kt, vt, causal=True, window=(7, -1), segment_ids=seg)
    ((out_ref * cot).sum() + (torch.where(torch.isfinite(lse_ref), lse_ref, 0) * lse_cot).sum()).backward()
    kw = dict(mesh=_mesh(4), causal=True, sliding_window=(7, -1), layout="zigzag", chunk_q=16, chunk_k=16,
              segment_ids=tuple(jnp.asarray(x.numpy(), jnp.int32) for x in seg))
    qj, kj, vj = _j(q), _j(k), _j(v)
    out, lse = ring_attention(qj, kj, vj, return_lse=True, **kw)
    dlse = jnp.asarray(lse_cot.numpy(), jnp.float32)
    grads = ring_attention_backward(qj, kj, vj, out, lse, _j(cot), dlse, **kw)
    for g, gr in zip(grads, (qt.grad, kt.grad, vt.grad)):
        _close(_t(g), gr, 6e-5)


# --- torch access ----------------------------------------------------------------------------------


def _torch_case(seed, hq=4, hk=2, length=64, e=16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, length, e, generator=gen) for h in (hq, hk, hk))
    return q, k, v, torch.randn(1, hq, length, e, generator=gen)


def _torch_oracle(q, k, v, cot, **kw):
    out, lse, grads = reference_grads(q, k, v, cot, **kw)
    return out, lse, grads[:3]


def test_torch_full_tensors_shards_and_compile():
    from jaxattn.torch_api import ring_attention as torch_ring

    q, k, v, cot = _torch_case(14)
    out_ref, lse_ref, grads_ref = _torch_oracle(q, k, v, cot, causal=True)
    mesh = _mesh(4)
    # (a1) full tensors, sharded for the call over the mesh
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = torch_ring(*leaves, is_causal=True, mesh=mesh, return_lse=True)
    assert out.shape == (1, 4, 64, 16) and lse.shape == (1, 4, 64) and lse.dtype == torch.float32
    (out * cot).sum().backward()
    torch.testing.assert_close(out.double(), out_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5)
    for leaf, gr in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.double(), gr, atol=5e-5, rtol=5e-5)
    # (a2) lists of per-device shards in natural order (CPU shards go to the simulated CPU devices)
    shards = [[c.clone().requires_grad_(True) for c in x.chunk(4, dim=2)] for x in (q, k, v)]
    outs = torch_ring(*shards, is_causal=True)
    assert isinstance(outs, list) and len(outs) == 4
    sum((o * c).sum() for o, c in zip(outs, cot.chunk(4, dim=2))).backward()
    torch.testing.assert_close(torch.cat(outs, dim=2).double(), out_ref, atol=2e-5, rtol=2e-5)
    for group, gr in zip(shards, grads_ref):
        torch.testing.assert_close(torch.cat([s.grad for s in group], dim=2).double(), gr, atol=5e-5, rtol=5e-5)
    # torch.compile(fullgraph=True) traces through the custom ops
    compiled = torch.compile(lambda a, b, c: torch_ring(a, b, c, is_causal=True, mesh=mesh), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double(), out_ref, atol=2e-5, rtol=2e-5)


def test_torch_window_softcap_segments_and_errors():
    from jaxattn.torch_api import AttentionInputError
    from jaxattn.torch_api import ring_attention as torch_ring

    q, k, v, cot = _torch_case(15, length=48)
    gen = torch.Generator().manual_seed(16)
    ids = torch.randint(0, 2, (1, 48), generator=gen)
    out_ref, _, _ = _torch_oracle(q, k, v, cot, window=(6, 2), softcap=4.0, segment_ids=(ids, ids))
    out = torch_ring(q, k, v, window=(6, 2), softcap=4.0, segment_ids=(ids, ids), mesh=_mesh(4))
    torch.testing.assert_close(out.double(), out_ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(AttentionInputError, match="shard 1: shapes"):
        torch_ring([q[:, :, :8], q[:, :, 8:20]], [k[:, :, :8], k[:, :, 8:20]], [v[:, :, :8], v[:, :, 8:20]])
    with pytest.raises(AttentionInputError, match="window=\\(3,\\)"):
        torch_ring(q, k, v, window=(3,), mesh=_mesh(2))
    with pytest.raises(AttentionInputError, match="layout='ring'"):
        torch_ring(q, k, v, layout="ring", mesh=_mesh(2))
    with pytest.raises(TypeError, match="k: q is a list of shards"):
        torch_ring([q], k, [v])
    with pytest.raises(AttentionInputError, match="segment_ids: q_ids has shape"):
        torch_ring(q, k, v, segment_ids=(ids[:, :10], ids), mesh=_mesh(2))


def test_torch_ring_accumulation_input_bf16():
    """The torch API passes accumulation="input" through: bf16 output and gradients within 2x torch's
    own bf16 error against float64; a misspelt value raises."""
    from jaxattn.torch_api import AttentionInputError
    from jaxattn.torch_api import ring_attention as torch_ring

    q, k, v, cot = (x.bfloat16() for x in _torch_case(17, length=64, e=32))
    exact_out, _, exact_grads = _torch_oracle(q, k, v, cot.double(), causal=True)
    tb = [x.clone().requires_grad_(True) for x in (q, k, v)]
    ref_bf16 = reference(*tb, causal=True, dtype=torch.bfloat16)[0]
    (ref_bf16.double() * cot.double()).sum().backward()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = torch_ring(*leaves, is_causal=True, mesh=_mesh(4), accumulation="input")
    assert out.dtype == torch.bfloat16
    (out.double() * cot.double()).sum().backward()
    pairs = [(out, ref_bf16, exact_out)] + [(a.grad, b.grad, e) for a, b, e in zip(leaves, tb, exact_grads)]
    for name, (mine, torch_bf16, exact) in zip(("out", "dq", "dk", "dv"), pairs):
        assert_dtype_rule(name, mine, exact, torch_bf16, floor=1e-3)
    with pytest.raises(AttentionInputError, match="accumulation='half'"):
        torch_ring(q, k, v, is_causal=True, mesh=_mesh(2), accumulation="half")


def test_torch_ring_alibi_full_tensors_and_shards():
    """torch ring_attention(alibi_slopes=): (Hq,) slopes on full tensors and (B, Hq) slopes with
    per-device shards, outputs and gradients against the float64 oracle; slopes get no gradient;
    malformed slopes are refused naming the argument."""
    from jaxattn.torch_api import AttentionInputError
    from jaxattn.torch_api import ring_attention as torch_ring

    q, k, v, cot = _torch_case(18, length=48)
    for slopes, form in ((_slopes(18, (4,)), "full"), (_slopes(19, (1, 4)), "shards")):
        slopes.requires_grad_(True)
        out_ref, _, grads_ref = _torch_oracle(q, k, v, cot, causal=True, bias=alibi_matrix(slopes.detach(), 48, 48))
        if form == "full":
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = torch_ring(*leaves, is_causal=True, mesh=_mesh(4), alibi_slopes=slopes)
            (out * cot).sum().backward()
            grads = [x.grad for x in leaves]
        else:
            shards = [[c.clone().requires_grad_(True) for c in x.chunk(4, dim=2)] for x in (q, k, v)]
            outs = torch_ring(*shards, is_causal=True, alibi_slopes=slopes)
            sum((o * c).sum() for o, c in zip(outs, cot.chunk(4, dim=2))).backward()
            out = torch.cat(outs, dim=2)
            grads = [torch.cat([s.grad for s in group], dim=2) for group in shards]
        torch.testing.assert_close(out.double(), out_ref, atol=2e-5, rtol=2e-5)
        for g, gr in zip(grads, grads_ref):
            torch.testing.assert_close(g.double(), gr, atol=5e-5, rtol=5e-5)
        assert slopes.grad is None
    with pytest.raises(AttentionInputError, match=r"alibi_slopes: got .*\(B, Hq\)=\(1, 4\)"):
        torch_ring(q, k, v, mesh=_mesh(2), alibi_slopes=torch.ones(1, 2))
    with pytest.raises(AttentionInputError, match="alibi_slopes: got .*float64"):
        torch_ring(q, k, v, mesh=_mesh(2), alibi_slopes=torch.ones(4, dtype=torch.float64))


def test_torchrun_settings():
    from jaxattn.bridge import torchrun_settings

    env = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.5", MASTER_PORT="29500")
    assert torchrun_settings(env) == dict(coordinator_address="10.0.0.5:29501", num_processes=2, process_id=1,
                                          local_rank=1)
    assert torchrun_settings(dict(env, JAXATTN_COORDINATOR_PORT="4000"))["coordinator_address"] == "10.0.0.5:4000"
    with pytest.raises(RuntimeError, match=r"\['RANK'\] are not set; start the script with `torchrun"):
        torchrun_settings({k: v for k, v in env.items() if k != "RANK"})
    with pytest.raises(RuntimeError, match="RANK=2 is outside"):
        torchrun_settings(dict(env, RANK="2"))


def test_gspmd_switch_only_for_gpu():
    from jaxattn.jax_core.ring import use_gspmd_on_gpu

    before = jax.config.jax_use_shardy_partitioner
    try:
        jax.config.update("jax_use_shardy_partitioner", True)
        assert not use_gspmd_on_gpu("cpu")
        assert jax.config.jax_use_shardy_partitioner
        with pytest.warns(RuntimeWarning, match="GSPMD"):
            assert use_gspmd_on_gpu("gpu")
        assert not jax.config.jax_use_shardy_partitioner
        assert not use_gspmd_on_gpu("gpu")  # already switched: no second warning
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)
