"""The decode GPU path (jax-triton launch + Triton stream-K and merge kernels) on the CPU.

`jax_triton.triton_call` is replaced by an interpreter stand-in (tests/jax_triton_interpret.py), so
the kernels run exactly as launched on a GPU, on small shapes with small key blocks and few programs
(`SmallLaunch`) so that several blocks, cut segments and empty sequences occur; the tests through
`decode_attention` run the product's own launch choices. Unwritten cache slots and unused pages hold NaN.
The oracle is the float64 reference of tests/attention_reference.py (`decode_reference`). On a
CUDA machine the same tests run the compiled kernels (float32 inputs, tf32x3 dots): through jax-triton
where JAX runs on the GPU with it installed, through the stand-in otherwise.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import decode_reference, reference  # noqa: E402
from decode_cases import SmallLaunch, layout_cache, ragged_cache  # noqa: E402

from jaxattn.jax_core import AttentionMetadata, attention, decode_attention  # noqa: E402
from jaxattn.jax_core.kernels.decode_jax_triton import DecodeConfig, decode_attention_triton  # noqa: E402

ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels
# backend "rocm": the portable tanh (the interpreter cannot run PTX's tanh.approx)
GPU = AttentionMetadata(platform="gpu", backend="cuda" if ON_GPU else "rocm")

B, HKV, S, D = 4, 2, 40, 16
LENGTHS = torch.tensor([1, S, 23, 0], dtype=torch.int32)  # length 1, a full cache, an empty sequence
STARTS = torch.tensor([0, 3, 9, 0], dtype=torch.int32)




@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _j(t):
    return jnp.asarray(t.numpy())


def _t(x):
    return torch.from_numpy(np.array(x)).double()


def _case(seed, groups, t, layout):
    gen = torch.Generator().manual_seed(seed)
    hq = HKV * groups
    q = torch.randn(B, t, hq, D, generator=gen)
    k, v = ragged_cache(gen, B, S, HKV, D, LENGTHS, STARTS)
    kc, vc, table = layout_cache(k, v, layout, gen=gen)
    return gen, q, k, v, kc, vc, table, torch.randn(hq, generator=gen)


def _check(out, lse, q, k, v, **kw):
    want, want_lse = decode_reference(q.transpose(1, 2), k, v, LENGTHS, STARTS, **kw)
    out = _t(out).transpose(1, 2)
    assert (out - want).abs().max().item() < 2e-5
    lse, finite = _t(lse), torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - want_lse[finite]).abs().max().item() < 2e-5


# (layout, GQA ratio, q_len, window, softcap, sinks)
KERNEL_CASES = [  # the default run keeps one case per layout, every feature among them
    pytest.param("BSHD", 1, 1, None, None, False, marks=pytest.mark.thorough),
    ("BSHD", 4, 4, 9, None, True),
    ("BHSD", 8, 1, None, 2.0, False),
    pytest.param("BHSD", 4, 4, 5, 3.0, True, marks=pytest.mark.thorough),
    ("paged", 1, 4, None, None, True),
    pytest.param("paged", 8, 4, 12, 3.0, False, marks=pytest.mark.thorough),
    pytest.param("paged", 4, 1, None, None, False, marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("layout,groups,t,window,softcap,sinks", KERNEL_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("programs,min_share", [(8, 1), (3, None)])
def test_stream_schedule(layout, groups, t, window, softcap, sinks, programs, min_share):
    """The stream schedule: slices of one key block cut segments into several partial results and
    span several segments (8 programs, 1 block at least); the product's slice rule with 3 programs."""
    _, q, k, v, kc, vc, table, sink_logits = _case(groups * 10 + t + len(layout) + 50, groups, t, layout)
    cfg = SmallLaunch(scale=D ** -0.5, window=(window if window is not None else -1, -1), softcap=softcap,
                      cache_layout=layout, programs=programs, min_share=min_share)
    out, lse = decode_attention_triton(
        _j(q), _j(kc), _j(vc), _j(LENGTHS), _j(STARTS), None if table is None else _j(table),
        _j(sink_logits) if sinks else None, cfg)
    _check(out, lse, q, k, v, window=window, softcap=softcap, sinks=sink_logits if sinks else None)


def test_one_sequence_with_two_row_blocks():
    """B = 1, one KV head shared by 20 query heads, 4 queries: 80 query rows in two row blocks
    (two segments of the stream schedule that read the same keys), with sinks and a window."""
    gen = torch.Generator().manual_seed(11)
    lengths, starts = torch.tensor([61], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    q = torch.randn(1, 4, 20, D, generator=gen)
    k, v = ragged_cache(gen, 1, 70, 1, D, lengths, starts)
    sinks = torch.randn(20, generator=gen)
    cfg = SmallLaunch(scale=D ** -0.5, window=(37, -1), programs=3, min_share=1)
    out, lse = decode_attention_triton(_j(q), _j(k), _j(v), _j(lengths), _j(starts), None, _j(sinks), cfg)
    want, want_lse = decode_reference(q.transpose(1, 2), k, v, lengths, starts, window=37, sinks=sinks)
    assert (_t(out).transpose(1, 2) - want).abs().max().item() < 2e-5
    assert (_t(lse) - want_lse).abs().max().item() < 2e-5


@pytest.mark.skipif(ON_GPU, reason="records the launches of the interpreter stand-in")
def test_launch_choices_reach_the_launch(monkeypatch):
    """The attention kernel launches with its config's choices: the tuned ones of a DecodeConfig
    (`decode_tiles`, `STREAM_PROGRAMS_PER_SM` per multiprocessor, `default_min_share`), a
    subclass's own otherwise."""
    from jaxattn.jax_core.kernels import decode_jax_triton as dj

    stand_in = sys.modules["jax_triton"]
    real, launches = stand_in.triton_call, []

    def recording(*args, kernel, grid, num_warps, num_stages, **meta):
        launches.append(dict(meta, grid=grid, num_warps=num_warps, num_stages=num_stages))
        return real(*args, kernel=kernel, grid=grid, num_warps=num_warps, num_stages=num_stages, **meta)

    monkeypatch.setattr(stand_in, "triton_call", recording)
    _, q, k, v, kc, vc, _, _ = _case(5, 2, 1, "BSHD")
    tuned = DecodeConfig(scale=D ** -0.5)
    small = SmallLaunch(scale=D ** -0.5, programs=5, min_share=2)
    for cfg in (tuned, small):
        out, lse = decode_attention_triton(_j(q), _j(kc), _j(vc), _j(LENGTHS), _j(STARTS), None, None, cfg)
        _check(out, lse, q, k, v)
    attend_tuned, attend_small = launches[1], launches[4]  # each call: segment table, attention, merge
    block_n, warps, stages = dj.decode_tiles(D, D, 4)
    segments = B * HKV  # one row block per KV head here
    assert attend_tuned["grid"] == (dj.STREAM_PROGRAMS_PER_SM * dj._device_sms(),)
    assert (attend_tuned["BLOCK_N"], attend_tuned["num_warps"], attend_tuned["num_stages"]) == (block_n, warps, stages)
    max_blocks = dj.max_visible_blocks(S, 1, (-1, -1), True, block_n)
    assert attend_tuned["MIN_SHARE"] == dj.default_min_share(segments, max_blocks, attend_tuned["grid"][0])
    assert (attend_small["grid"], attend_small["BLOCK_N"], attend_small["MIN_SHARE"]) == ((5,), 16, 2)


def test_stream_segments_and_plan():
    from jaxattn.jax_core.kernels.decode_jax_triton import default_min_share, max_parts, segment_offsets
    # lengths 1, 40, 23, 0 from starts 0, 3, 9, 0 in 16-position blocks: 1, 3, 2 and 0 blocks per
    # sequence, each repeated for 2 KV heads
    cfg = DecodeConfig(scale=1.0)
    cum = segment_offsets(_j(LENGTHS), _j(STARTS), 1, S, cfg, 16, 2)
    assert np.array(cum).tolist() == [0, 1, 2, 5, 8, 10, 12, 12, 12]
    # a window of 5 before the last query: blocks of [length - 6, length) only
    cum = segment_offsets(_j(LENGTHS), _j(STARTS), 1, S, DecodeConfig(scale=1.0, window=(5, -1)), 16, 1)
    assert np.array(cum).tolist() == [0, 1, 2, 3, 3]
    # the slices of a full batch are at least a quarter of an even split; the bound on partials holds
    min_share = default_min_share(64, 513, 264)
    assert min_share == -(-64 * 513 // 264) // 4 and (max_parts(513, min_share) - 1) * min_share >= 513
    assert default_min_share(1, 2, 264) == 4


def test_max_visible_blocks_cover_every_visible_block():
    from jaxattn.jax_core.kernels.decode_jax_triton import max_visible_blocks
    # a full cache: the capacity's blocks plus one block of slack
    assert max_visible_blocks(1024, 1, (-1, -1), True, 64) == 17
    # a causal window: the window's span, not the capacity
    assert max_visible_blocks(32768, 1, (1000, -1), True, 64) <= 18
    for cap, t, win, bn in [(1000, 4, (37, -1), 16), (513, 1, (-1, -1), 64), (4096, 16, (100, 0), 32)]:
        span = cap if win[0] < 0 else min(cap, win[0] + t)
        assert max_visible_blocks(cap, t, win, True, bn) * bn >= span + bn  # any span, at any alignment


@pytest.mark.parametrize("removed", ["schedule", "num_splits", "fixed_shares", "tiles", "num_sms",
                                     "stream_programs_per_sm", "stream_min_share"])
def test_launch_choices_are_not_settings(removed):
    """The launch choices are DecodeConfig's methods, not fields: passing a former field is refused
    by name."""
    with pytest.raises(TypeError, match=removed):
        DecodeConfig(scale=1.0, **{removed: None})


@pytest.mark.thorough  # the XLA decode path's gradients also run in test_native_decode by default
def test_through_decode_attention_with_gradients():
    """jax_core.decode_attention on the GPU path: BHTD queries, paged cache, every feature, and the
    custom JVP (gradients from the XLA formulation) against float64 torch autograd."""
    gen, q, k, v, kc, vc, table, sinks = _case(99, 4, 4, "paged")
    kc, vc = torch.nan_to_num(kc), torch.nan_to_num(vc)
    kw = dict(block_table=_j(table), starts=_j(STARTS), sliding_window=10, logits_soft_cap=4.0, query_layout="BHTD",
              metadata=GPU, kernel="triton")
    qh = q.transpose(1, 2).contiguous()
    cot = torch.randn(qh.shape, generator=gen)

    def loss(q, k, v, s):
        out = decode_attention(q, k, v, _j(LENGTHS), softmax_aux=s, return_lse=True, **kw)
        return jnp.sum(out.attention_outputs * _j(cot)), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(_j(qh), _j(kc), _j(vc), _j(sinks))
    _check(jnp.swapaxes(out.attention_outputs, 1, 2), out.lse, q, k, v, window=10, softcap=4.0, sinks=sinks)

    leaves = [x.double().requires_grad_() for x in (qh, torch.nan_to_num(k), torch.nan_to_num(v), sinks)]
    want, _ = decode_reference(*leaves[:3], LENGTHS, STARTS, window=10, softcap=4.0, sinks=leaves[3])
    ref = torch.autograd.grad((want * cot.double()).sum(), leaves)
    assert (_t(grads[0]) - ref[0]).abs().max() < 2e-5
    assert (_t(grads[3]) - ref[3]).abs().max() < 2e-5
    # key/value gradients land in the pages: compare them gathered back per sequence
    for got, want_g in ((grads[1], ref[1]), (grads[2], ref[2])):
        dense = _t(got)[table.long()].reshape(B, S, HKV, D)
        assert (dense - want_g).abs().max() < 2e-5


@pytest.mark.thorough  # the same kernels as above, reached through jax_core.attention's registry
def test_attention_interface_runs_the_triton_path():
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (2, 8, 3, 16))  # BHTD, 3 queries against 45 keys
    k, v = (jax.random.normal(x, (2, 2, 45, 16)) for x in keys[1:])
    kw = dict(causal=True, causal_alignment="bottom_right", sliding_window=(20, 0), layout="BHTD", return_lse=True)
    got = attention(q, k, v, implementation="decode", metadata=GPU, **kw)
    want, want_lse = reference(_t(q), _t(k), _t(v), causal=True, alignment="bottom_right", window=(20, 0))
    assert (_t(got.attention_outputs) - want).abs().max().item() < 2e-5
    assert (_t(got.lse) - want_lse).abs().max().item() < 2e-5
