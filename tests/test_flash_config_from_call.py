"""The flash kernels' settings (`FlashConfig`) come from one place: `AttentionCall.flash_config`.

The torch side's `native_config` (its keywords made into a call) and the JAX launch (`flash` on the
GPU path) must give the kernels the same settings for the same call. The oracle is the rule written
out here: scale D^-0.5 unless given; diagonal offset S - L for a bottom-right alignment, 0 for a
top-left one and for packed sequences (which align per sequence, `varlen_bottom_right`); the window
as given, (-1, -1) without one; soft cap and dropout as floats, varlen bounds as ints; the hardware
tanh only on CUDA.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402

from jaxattn.bridge.triton_launch import can_launch  # noqa: E402
from jaxattn.jax_core import AttentionCall, AttentionMetadata, attention  # noqa: E402
from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402
from jaxattn.jax_core.kernels.flash_plan import FlashConfig  # noqa: E402
from jaxattn.jax_core.visibility import Visibility  # noqa: E402
from jaxattn.torch_api import launch, sdpa_launcher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 80  # head dim (not a power of two)

WINDOWS = (None, (-1, -1), (5, -1), (-1, 3), (7, 2))
OPTIONS = list(itertools.product(
    (False, True),                      # causal
    ("top_left", "bottom_right"),       # alignment (also places a window without causality)
    WINDOWS,
    (None, 30),                         # soft cap (an int: the kernels get a float)
    (0, 0.2),                           # dropout probability (an int 0: the kernels get 0.0)
    (None, 0.3),                        # scale
))

SHAPES = {
    # name: (B, Hq, Hk, L, S, varlen bounds); packed calls are (1, H, total, D) with total L and S
    "L<S": (2, 4, 2, 97, 1025, None),
    "L>S": (1, 2, 2, 1025, 97, None),
    "L=S": (3, 2, 1, 33, 33, None),
    # decoding shapes: settings memoized without S (except bottom-right): two lengths in a row
    "decode-S1025": (2, 4, 2, 3, 1025, None),
    "decode-S2000": (2, 4, 2, 3, 2000, None),
    "packed": (1, 4, 2, 97, 1025, (np.int64(40), np.int64(300))),
    "packed-L=S": (1, 2, 2, 64, 64, (np.int64(16), np.int64(16))),
}


def _expected(l, s, causal, alignment, window, softcap, dropout, scale, varlen) -> FlashConfig:
    """The settings by the rule (module docstring), written out."""
    bottom_right = alignment == "bottom_right"
    return FlashConfig(
        scale=scale if scale is not None else D ** -0.5,
        causal=causal,
        diag_offset=s - l if bottom_right and varlen is None else 0,
        window=window if window is not None else (-1, -1),
        softcap=None if softcap is None else float(softcap),
        layout="BHTD",
        dropout_p=float(dropout),
        varlen=None if varlen is None else (int(varlen[0]), int(varlen[1])),
        varlen_bottom_right=bottom_right and varlen is not None,
        fast_tanh=DEVICE == "cuda",
    )


def _assert_kernel_types(cfg: FlashConfig) -> None:
    assert type(cfg.scale) is float and type(cfg.dropout_p) is float, cfg
    assert cfg.softcap is None or type(cfg.softcap) is float, cfg
    assert cfg.varlen is None or all(type(n) is int for n in cfg.varlen), cfg


@pytest.mark.skipif(not can_launch(torch.device(DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_torch_and_jax_sides_build_the_same_flash_config(shape):
    b, hq, hk, l, s, varlen = SHAPES[shape]
    q_shape, k_shape = (b, hq, l, D), (b, hk, s, D)
    device = torch.device(DEVICE)
    for causal, alignment, window, softcap, dropout, scale in OPTIONS:
        label = dict(causal=causal, alignment=alignment, window=window, softcap=softcap, dropout=dropout, scale=scale)
        want = _expected(l, s, causal, alignment, window, softcap, dropout, scale, varlen)
        with sdpa_launcher("native"):
            torch_side = launch.native_config(
                q_shape, k_shape, D, torch.float16, device, None, causal=causal,
                bottom_right=alignment == "bottom_right", window=window, softcap=softcap, dropout_p=dropout,
                scale=scale, varlen=varlen)
        call = AttentionCall(visibility=Visibility.of(causal, alignment, window), logits_soft_cap=softcap,
                             scale=scale, dropout_prob=dropout, layout="BHTD", max_seqlen=varlen,
                             backend="cuda" if DEVICE == "cuda" else "cpu")
        jax_side = call.flash_config(l, s, D, packed=varlen is not None)
        assert torch_side == want, label
        assert jax_side == want, label
        _assert_kernel_types(torch_side)
        _assert_kernel_types(jax_side)


# --------------------------------------------------------------------------------------------- JAX launch


@pytest.fixture
def recorded_configs(monkeypatch):
    """The FlashConfigs `flash`'s GPU path hands the kernels (their launch replaced by zeros)."""
    jax_triton_interpret.install(monkeypatch)
    seen = []

    def launch_kernels(q, k, v, bias, mask, sinks, extras, cfg):
        seen.append(cfg)
        b, t, h = q.shape[:3]  # (B, T, H, D): the calls below are BTHD
        return jnp.zeros((b, t, h, v.shape[-1]), q.dtype), jnp.zeros((b, h, t), jnp.float32)

    monkeypatch.setattr(fj, "flash_attention_triton", launch_kernels)
    return seen


def _qkv(seed, b, t, s, hq, hk):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, hq, D)), jax.random.normal(ks[1], (b, s, hk, D)),
            jax.random.normal(ks[2], (b, s, hk, D)))


def test_jax_launch_hands_the_kernels_the_calls_flash_config(recorded_configs):
    md = AttentionMetadata(platform="gpu", backend="cuda")
    q, k, v = _qkv(1, 2, 19, 45, 4, 2)
    attention(q, k, v, implementation="flash", metadata=md, causal=True, causal_alignment="bottom_right",
              sliding_window=(6, -1), logits_soft_cap=20)
    drop = md.replace(dropout_prob=0.25, softmax_scale=0.5)
    attention(q, k, v, implementation="flash", metadata=drop, dropout_rng=jax.random.key(4),
              sliding_window=(2, 3))
    attention(q, k, v, implementation="flash", metadata=drop)  # no dropout key: no dropout
    pq, pk, pv = _qkv(2, 1, 23, 41, 2, 2)
    cu = (jnp.array([0, 9, 23], jnp.int32), jnp.array([0, 30, 41], jnp.int32))
    attention(pq, pk, pv, implementation="flash", metadata=md, cu_seqlens=cu, causal=True,
              causal_alignment="bottom_right")  # grids over the packed lengths
    attention(pq, pk, pv, implementation="flash", metadata=md, cu_seqlens=cu, max_seqlen=(14, 30))

    common = dict(layout="BTHD", fast_tanh=True)
    assert recorded_configs == [
        FlashConfig(scale=D ** -0.5, causal=True, diag_offset=45 - 19, window=(6, -1), softcap=20.0, **common),
        FlashConfig(scale=0.5, window=(2, 3), dropout_p=0.25, **common),
        FlashConfig(scale=0.5, **common),
        FlashConfig(scale=D ** -0.5, causal=True, varlen=(23, 41), varlen_bottom_right=True, **common),
        FlashConfig(scale=D ** -0.5, varlen=(14, 30), **common),
    ]
