"""ALiBi slopes in decode attention: every kernel and launcher against the float64 oracle.

flash-attn's convention: the logit of the query at position p = length - T + t and cache position j
gets -slope * |p - j| after scale and soft cap, slopes (Hq,) or (B, Hq). The oracle is
tests/attention_reference.py (`decode_reference` with the additive `decode_alibi` bias, both written
from that definition) on ragged caches whose unwritten slots and unused pages hold NaN
(tests/decode_cases.py). Runs: the XLA formulation (CPU), the Triton kernels under the interpreter
through jax-triton's stand-in (tests/jax_triton_interpret.py) and through the torch launcher
(`sdpa_launcher("native")`), the Pallas TPU kernel in interpret mode, the generic `attention()`
interface, gradients, and the argument checks.
"""

import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_triton_interpret
from attention_reference import decode_alibi, decode_reference, from_bthd, reference
from decode_cases import SmallLaunch, layout_cache, ragged_cache

from jaxattn.bridge import cache_info
from jaxattn.bridge.triton_launch import can_launch
from jaxattn.jax_core import AttentionMetadata, attention, decode_attention
from jaxattn.torch_api import AttentionInputError, sdpa_launcher
from jaxattn.torch_api import decode_attention as torch_decode

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = (torch.cuda.is_available() and jax.default_backend() == "gpu"
          and importlib.util.find_spec("jax_triton") is not None)
# backend "rocm": the portable tanh (the interpreter cannot run PTX's tanh.approx)
GPU = AttentionMetadata(platform="gpu", backend="cuda" if ON_GPU else "rocm")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
needs_native = pytest.mark.skipif(not HAS_TRITON or not can_launch(torch.device("cpu")) or torch.cuda.is_available(),
                                  reason="runs the torch launcher under TRITON_INTERPRET=1 on CPU tensors")

B, HKV, S, D = 4, 2, 40, 16
LENGTHS = torch.tensor([1, S, 23, 0], dtype=torch.int32)  # length 1, a full cache, an empty sequence
STARTS = torch.tensor([0, 3, 9, 0], dtype=torch.int32)


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    if not ON_GPU:
        monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())




def _case(seed, groups, t, layout, *, per_batch, s=S, d=D, lengths=LENGTHS, starts=STARTS):
    """q (B, Hq, T, D); dense ragged caches (NaN outside [start, length)) and the same in `layout`;
    slopes (B, Hq) or (Hq,) in [0.05, 1) (spread enough that the distances change the result);
    (Hq,) sink logits."""
    gen = torch.Generator().manual_seed(seed)
    hq = HKV * groups
    q = torch.randn(B, hq, t, d, generator=gen)
    k, v = ragged_cache(gen, B, s, HKV, d, lengths, starts)
    kc, vc, table = layout_cache(k, v, layout, gen=gen)
    slopes = 0.05 + 0.95 * torch.rand((B, hq) if per_batch else (hq,), generator=gen)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, table=table, slopes=slopes, sinks=torch.randn(hq, generator=gen))


def _want(c, t, *, window=None, causal=True, softcap=None, sinks=False, scale=None, lengths=LENGTHS, starts=STARTS):
    return decode_reference(c["q"].double(), c["k"], c["v"], lengths, starts, window=window, causal=causal,
                            softcap=softcap, scale=scale, sinks=c["sinks"].double() if sinks else None,
                            bias=decode_alibi(c["slopes"], lengths, t, c["k"].shape[1]))


def _assert_close(out, lse, want, want_lse, tol):
    out, lse = out.detach().double().cpu(), lse.detach().double().cpu()
    assert out.shape == want.shape
    err = (out - want).abs().max().item()
    assert err < tol, f"out: max error {err}"
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    err = (lse[finite] - want_lse[finite]).abs().max().item()
    assert err < tol, f"lse: max error {err}"


def _j(t):
    return None if t is None else jnp.asarray(t.numpy())


def _t(x):
    return torch.from_numpy(np.array(x)).double()


# --- the XLA formulation through torch's decode_attention --------------------------------------------

# (layout, GQA ratio, T, (B, Hq) slopes, options)
XLA_CASES = [
    ("BSHD", 4, 4, True, dict(window=9, softcap=3.0, sinks=True)),
    ("BHSD", 1, 1, False, {}),
    ("paged", 2, 3, True, dict(sinks=True, scale=0.3)),
    pytest.param("paged", 8, 1, False, dict(window=5, softcap=2.0), marks=pytest.mark.thorough),
    pytest.param("BHSD", 4, 16, True, dict(window=12), marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("layout,groups,t,per_batch,opts", XLA_CASES, ids=str)
def test_xla_matches_the_oracle(layout, groups, t, per_batch, opts):
    c = _case(groups * 31 + t + len(layout), groups, t, layout, per_batch=per_batch)
    opts = dict(opts)
    sinks = opts.pop("sinks", False)
    out, lse = torch_decode(c["q"], c["kc"], c["vc"], LENGTHS, cache_starts=STARTS, block_table=c["table"],
                            cache_layout="BHSD" if layout == "BHSD" else "BSHD", sinks=c["sinks"] if sinks else None,
                            alibi_slopes=c["slopes"], return_lse=True, **opts)
    _assert_close(out, lse, *_want(c, t, sinks=sinks, **opts), 2e-6)


def test_xla_awkward_sizes():
    """Head dim 80, 97 cache slots, 3 query heads per KV head, 5 queries, one slope per head."""
    lengths, starts = torch.tensor([97, 60, 5, 41], dtype=torch.int32), torch.tensor([0, 13, 0, 40], dtype=torch.int32)
    c = _case(7, 3, 5, "BSHD", per_batch=False, s=97, d=80, lengths=lengths, starts=starts)
    out, lse = torch_decode(c["q"], c["kc"], c["vc"], lengths, cache_starts=starts, window=30, alibi_slopes=c["slopes"],
                            return_lse=True)
    _assert_close(out, lse, *_want(c, 5, window=30, lengths=lengths, starts=starts), 2e-6)


@pytest.mark.parametrize("window", [None, (5, 2)])
def test_xla_not_causal(window):
    """causal=False: every query sees the whole valid region (a window on both sides of its
    position); ALiBi still measures from each query's own position."""
    c = _case(40 + (window is None), 4, 3, "paged", per_batch=True)
    out = decode_attention(_j(c["q"]), _j(c["kc"]), _j(c["vc"]), _j(LENGTHS), starts=_j(STARTS),
                           block_table=_j(c["table"]), sliding_window=window, causal=False, query_layout="BHTD",
                           alibi_slopes=_j(c["slopes"]), return_lse=True)
    _assert_close(_t(out.attention_outputs), _t(out.lse), *_want(c, 3, window=window, causal=False), 2e-6)


def test_gradients_follow_the_reference_and_skip_the_slopes():
    """q, k, v gradients through the XLA path with ALiBi against float64 autograd; the slopes,
    though they require grad, get none (as flash-attn)."""
    c = _case(13, 4, 4, "BSHD", per_batch=True)
    k, v = torch.nan_to_num(c["k"]), torch.nan_to_num(c["v"])
    leaves = [x.clone().requires_grad_() for x in (c["q"], k, v)]
    slopes = c["slopes"].clone().requires_grad_()
    out = torch_decode(*leaves, LENGTHS, cache_starts=STARTS, window=9, softcap=5.0, alibi_slopes=slopes)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * cot).sum().backward()
    assert slopes.grad is None
    ref = [x.detach().double().requires_grad_() for x in (c["q"], k, v)]
    want, _ = decode_reference(*ref, LENGTHS, STARTS, window=9, softcap=5.0,
                               bias=decode_alibi(c["slopes"], LENGTHS, 4, S))
    (want * cot.double()).sum().backward()
    for got, r in zip(leaves, ref):
        assert (got.grad.double() - r.grad).abs().max().item() < 1e-5


def test_kv_cache_attend_passes_the_slopes():
    """KVCache.attend after a prefill with left padding and one appended token."""
    from jaxattn.torch_api import KVCache

    gen = torch.Generator().manual_seed(23)
    cache = KVCache.paged(2, 32, HKV, D, page_size=8)
    cache.set_starts([0, 4])
    keys, values = (torch.randn(2, HKV, 12, D, generator=gen) for _ in "kv")
    cache.append(keys[:, :, :11], values[:, :, :11])
    cache.append(keys[:, :, 11:], values[:, :, 11:])
    q = torch.randn(2, 4, 2, D, generator=gen)
    slopes = 0.1 + torch.rand(2, 4, generator=gen)
    out = cache.attend(q, window=7, alibi_slopes=slopes)
    lengths = torch.full((2,), 12, dtype=torch.int32)
    want, _ = decode_reference(q.double(), keys.transpose(1, 2), values.transpose(1, 2), lengths, cache.starts,
                               window=7, bias=decode_alibi(slopes, lengths, 2, 12))
    assert (out.double() - want).abs().max().item() < 2e-6


# --- the generic interface: the whole key array is the cache ----------------------------------------


@pytest.mark.parametrize("kernel_md", ["xla", pytest.param("triton", marks=[needs_triton, pytest.mark.thorough])])
def test_attention_interface_aligns_alibi_bottom_right(kernel_md):
    """Through `attention()`, ALiBi follows the library's convention: -slope * |i + S - T - j|,
    aligned bottom-right even when the causal mask is top-left (the decode kernels shift the
    query positions of the mask only)."""
    keys = jax.random.split(jax.random.key(5), 4)
    b, t, hq, hk, s, d = 2, 3, 4, 2, 37, 16
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k, v = (jax.random.normal(x, (b, s, hk, d)) for x in keys[1:3])
    slopes = 0.1 + jax.random.uniform(keys[3], (b, hq))
    md = GPU if kernel_md == "triton" else AttentionMetadata()
    got = attention(q, k, v, implementation="decode", causal=True, causal_alignment="top_left", alibi_slopes=slopes,
                    return_lse=True, metadata=md)
    rows = torch.arange(t)[:, None] + (s - t)
    bias = -torch.from_numpy(np.asarray(slopes, np.float64))[:, :, None, None] * (rows - torch.arange(s)).abs()
    want, want_lse = reference(*(from_bthd(x) for x in (q, k, v)), causal=True, alignment="top_left", bias=bias)
    _assert_close(from_bthd(got.attention_outputs), _t(got.lse), want, want_lse, 2e-5)


def test_decode_declares_alibi_for_automatic_selection():
    """ALiBi is a feature of decode's own kernels on every platform (not a bias, which it lacks)."""
    from jaxattn.jax_core import AttentionInputs, AttentionRegistry

    decode = AttentionRegistry.get("decode")
    for platform in ("cpu", "tpu"):
        inputs = AttentionInputs(batch=2, q_len=1, kv_len=512, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 value_head_dim=64, dtype="float32", platform=platform, backend=platform,
                                 features=frozenset({"gqa", "alibi"}))
        assert decode.takes_alibi_slopes(inputs)
        assert decode.not_supported_reasons(inputs) == []


# --- the Triton kernels: jax-triton launcher (the interpreter stand-in on CPU) ------------------------

# (layout, GQA ratio, T, causal, window, (B, Hq) slopes, softcap, sinks)
TRITON_CASES = [
    ("BSHD", 4, 4, True, (9, -1), True, 3.0, False),
    ("paged", 2, 3, False, (6, 3), False, None, True),
    ("BHSD", 1, 1, True, (-1, -1), True, None, False),
    pytest.param("paged", 8, 16, True, (-1, -1), False, 2.0, True, marks=pytest.mark.thorough),
    pytest.param("BSHD", 2, 2, False, (-1, -1), True, None, False, marks=pytest.mark.thorough),
]


@needs_triton
@pytest.mark.parametrize("layout,groups,t,causal,window,per_batch,softcap,sinks", TRITON_CASES, ids=str)
def test_jax_triton_launcher(layout, groups, t, causal, window, per_batch, softcap, sinks):
    from jaxattn.jax_core.kernels.decode_jax_triton import decode_attention_triton

    c = _case(groups * 7 + t + causal, groups, t, layout, per_batch=per_batch)
    cfg = SmallLaunch(scale=D ** -0.5, programs=5, min_share=1, causal=causal, window=window, softcap=softcap,
                      q_layout="BHTD", cache_layout=layout)
    out, lse = decode_attention_triton(_j(c["q"]), _j(c["kc"]), _j(c["vc"]), _j(LENGTHS), _j(STARTS), _j(c["table"]),
                                       _j(c["sinks"]) if sinks else None, cfg, _j(c["slopes"]))
    _assert_close(_t(out), _t(lse), *_want(c, t, window=window, causal=causal, softcap=softcap, sinks=sinks), 2e-5)


@needs_triton
@pytest.mark.thorough  # the custom JVP's XLA formulation is also covered on CPU by the gradient test above
def test_triton_kernel_gradients_come_from_the_xla_formulation():
    """jax.grad through the Triton kernel (a custom JVP): q, k, v gradients with ALiBi match float64
    autograd; the slopes get a zero gradient."""
    c = _case(61, 2, 3, "BSHD", per_batch=True)
    k, v = torch.nan_to_num(c["k"]), torch.nan_to_num(c["v"])
    cot = torch.randn(B, 3, HKV * 2, D, generator=torch.Generator().manual_seed(8))

    def loss(q, k, v, slopes):
        out = decode_attention(q, k, v, _j(LENGTHS), starts=_j(STARTS), sliding_window=10, logits_soft_cap=4.0,
                               alibi_slopes=slopes, kernel="triton", metadata=GPU)
        return jnp.sum(out.attention_outputs * _j(cot))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(_j(c["q"].transpose(1, 2).contiguous()), _j(k), _j(v), _j(c["slopes"]))
    assert not np.any(np.array(grads[3]))
    ref = [x.double().requires_grad_() for x in (c["q"], k, v)]
    want, _ = decode_reference(*ref, LENGTHS, STARTS, window=10, softcap=4.0,
                               bias=decode_alibi(c["slopes"], LENGTHS, 3, S))
    (want * cot.double().transpose(1, 2)).sum().backward()
    assert (_t(grads[0]).transpose(1, 2) - ref[0].grad).abs().max().item() < 2e-5
    assert (_t(grads[1]) - ref[1].grad).abs().max().item() < 2e-5
    assert (_t(grads[2]) - ref[2].grad).abs().max().item() < 2e-5


# --- the Triton kernels: the torch launcher ---------------------------------------------------------


@needs_native
@pytest.mark.parametrize("layout,groups,t,per_batch,opts", [
    ("BSHD", 4, 3, True, dict(window=9, return_lse=True)),
    ("paged", 2, 1, False, dict(softcap=3.0, sinks=True, return_lse=True)),
    pytest.param("BHSD", 1, 4, True, dict(scale=0.3, return_lse=True), marks=pytest.mark.thorough),
], ids=str)
def test_native_launcher(layout, groups, t, per_batch, opts):
    """Through torch's decode_attention under sdpa_launcher("native"): no XLA executable runs; (B, Hq)
    slopes are passed as a transposed view (the launcher makes them contiguous)."""
    c = _case(groups * 3 + t + 90, groups, t, layout, per_batch=per_batch)
    opts = dict(opts)
    sinks = opts.pop("sinks", False)
    slopes = c["slopes"].t().contiguous().t() if per_batch else c["slopes"]
    before = cache_info()
    with sdpa_launcher("native"):
        out, lse = torch_decode(c["q"], c["kc"], c["vc"], LENGTHS, cache_starts=STARTS, block_table=c["table"],
                                cache_layout="BHSD" if layout == "BHSD" else "BSHD",
                                sinks=c["sinks"] if sinks else None, alibi_slopes=slopes, **opts)
    assert cache_info() == before, "an XLA executable ran for a native call"
    _assert_close(out, lse, *_want(c, t, sinks=sinks, **{n: x for n, x in opts.items() if n != "return_lse"}), 2e-5)


@needs_native
@pytest.mark.parametrize("per_batch", [True, False])
def test_native_and_jax_launchers_bit_identical(per_batch):
    """The two launchers of the Triton kernels give the same bits with ALiBi (segments cut into
    several partial results), and both match the oracle."""
    from jaxattn.jax_core.kernels.decode_jax_triton import decode_attention_triton
    from jaxattn.torch_api import native_decode

    c = _case(33 + per_batch, 4, 3, "paged", per_batch=per_batch)
    cfg = SmallLaunch(scale=D ** -0.5, programs=5, min_share=1, causal=not per_batch, window=(20, 2), softcap=4.0,
                      q_layout="BHTD",
                      cache_layout="paged")
    spec = native_decode.NativeDecodeSpec(cfg)
    out, lse = native_decode.DECODE_OP(spec, c["q"], c["kc"], c["vc"], LENGTHS, STARTS, c["table"], None, c["slopes"])
    assert native_decode._launches(spec, c["q"], c["kc"], c["vc"], STARTS, c["table"], None,
                                   c["slopes"]).part_shape[3] > 1
    jout, jlse = decode_attention_triton(_j(c["q"]), _j(c["kc"]), _j(c["vc"]), _j(LENGTHS), _j(STARTS), _j(c["table"]),
                                         None, cfg, _j(c["slopes"]))
    assert torch.equal(out, torch.from_numpy(np.array(jout)))
    assert torch.equal(lse, torch.from_numpy(np.array(jlse)))
    _assert_close(out, lse, *_want(c, 3, window=(20, 2), causal=not per_batch, softcap=4.0), 2e-5)


# --- the Pallas TPU kernel (interpret mode) ---------------------------------------------------------


@pytest.mark.parametrize("layout,groups,t,causal,per_batch", [
    ("BSHD", 4, 4, True, True),
    ("paged", 2, 1, False, False),
    pytest.param("BHSD", 1, 3, True, False, marks=pytest.mark.thorough),
], ids=str)
def test_pallas_tpu_kernel_in_interpret_mode(layout, groups, t, causal, per_batch):
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    c = _case(17 + groups + t, groups, t, layout, per_batch=per_batch)
    md = AttentionMetadata(platform="tpu", backend="tpu")
    # On the host's CPU device: interpreted on a GPU, the kernel's float32 dots would run as TF32.
    with pltpu.force_tpu_interpret_mode(), jax.default_device(jax.devices("cpu")[0]):
        out = decode_attention(_j(c["q"]).swapaxes(1, 2), _j(c["kc"]), _j(c["vc"]), _j(LENGTHS), starts=_j(STARTS),
                               block_table=_j(c["table"]), sliding_window=11, logits_soft_cap=3.0,
                               softmax_aux=_j(c["sinks"]), cache_layout="paged" if layout == "paged" else layout,
                               causal=causal, alibi_slopes=_j(c["slopes"]), return_lse=True, metadata=md)
    _assert_close(_t(out.attention_outputs).transpose(1, 2), _t(out.lse),
                  *_want(c, t, window=11 if causal else (11, 11), causal=causal, softcap=3.0, sinks=True), 2e-6)


# --- argument checks --------------------------------------------------------------------------------


def test_bad_slopes_raise_naming_alibi_slopes():
    c = _case(1, 2, 1, "BSHD", per_batch=True)
    hq = c["q"].shape[1]
    cases = [
        (torch.ones(3), AttentionInputError, r"alibi_slopes: got shape \(3,\).*\(Hq,\)=\(4,\) or \(B, Hq\)=\(4, 4\)"),
        (torch.ones(B + 1, hq), AttentionInputError, r"alibi_slopes: got shape \(5, 4\)"),
        (torch.ones(hq, dtype=torch.float64), AttentionInputError, r"alibi_slopes: .*float64.*float32"),
        (torch.ones(hq, dtype=torch.int32), AttentionInputError, r"alibi_slopes: .*int32.*e\.g\. slopes\.float\(\)"),
        (torch.ones(hq, device="meta"), AttentionInputError, r"alibi_slopes: on meta but q is on cpu"),
        ([0.5] * hq, TypeError, r"alibi_slopes: expected a float32 tensor"),
        (torch.tensor([0.5, float("nan"), 0.1, 0.2]), AttentionInputError, r"alibi_slopes: contains NaN"),
    ]
    for slopes, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            torch_decode(c["q"], c["kc"], c["vc"], LENGTHS, alibi_slopes=slopes)
    q, k = jnp.zeros((2, 1, 4, 16)), jnp.zeros((2, 32, 2, 16))
    for slopes in (jnp.ones((3,)), jnp.ones((3, 4)), jnp.ones((4,), jnp.int32)):
        with pytest.raises(ValueError, match=r"alibi_slopes: expected a float array of shape \(Hq,\)=\(4,\)"):
            decode_attention(q, k, k, jnp.array([3, 4]), alibi_slopes=slopes)
