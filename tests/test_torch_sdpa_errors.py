"""Bad inputs to `jaxattn.torch_api.scaled_dot_product_attention`: exception types and messages."""

from __future__ import annotations

import re

import pytest
import torch

from jaxattn.torch_api import (
    AttentionInputError,
    current_implementation,
    scaled_dot_product_attention,
    sdpa_implementation,
    set_finite_check,
)

B, H, L, S, E = 2, 4, 8, 10, 16


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)


def qkv(hq=H, hk=H, e=E, ev=E, dtype=torch.float32):
    return randn(B, hq, L, e, dtype=dtype, seed=1), randn(B, hk, S, e, dtype=dtype, seed=2), randn(
        B, hk, S, ev, dtype=dtype, seed=3
    )


def call(q, k, v, **kwargs):
    return scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.fixture(autouse=True)
def _clean_state():
    assert current_implementation() is None
    yield
    assert current_implementation() is None


# --- shapes ---------------------------------------------------------------------------------------


def test_rank_1_query():
    q, k, v = randn(E), randn(S, E), randn(S, E)
    with pytest.raises(AttentionInputError, match=re.escape("query: expected at least 2 dims (..., L, E), got shape (16,)")):
        call(q, k, v)


def test_rank_1_value():
    q, k, v = randn(L, E), randn(S, E), randn(S)
    with pytest.raises(AttentionInputError, match=r"value: expected at least 2 dims"):
        call(q, k, v)


def test_key_rank_differs_from_query():
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=r"must have the same number of dims; got shapes \(2, 4, 8, 16\), \(4, 10, 16\)"):
        call(q, k[0], v[0])


def test_head_mismatch_without_enable_gqa():
    q, k, v = qkv(hq=8, hk=2)
    with pytest.raises(AttentionInputError, match=r"key: 2 heads but query has 8 .*enable_gqa=True"):
        call(q, k, v)


def test_heads_not_divisible_with_enable_gqa():
    q, k, v = qkv(hq=6, hk=4)
    with pytest.raises(AttentionInputError, match=r"enable_gqa=True: query heads 6 must be a multiple of key/value heads 4"):
        call(q, k, v, enable_gqa=True)


def test_key_head_dim_differs():
    q, _, v = qkv()
    k = randn(B, H, S, E + 8)
    with pytest.raises(AttentionInputError, match=r"key: head dim 24 != query head dim 16"):
        call(q, k, v)


def test_key_value_sequence_lengths_differ():
    q, k, _ = qkv()
    v = randn(B, H, S + 1, E)
    with pytest.raises(AttentionInputError, match=r"key and value: sequence lengths differ, 10 and 11"):
        call(q, k, v)


def test_key_value_heads_differ():
    q, k, _ = qkv()
    v = randn(B, 1, S, E)
    with pytest.raises(AttentionInputError, match=r"leading dims differ"):
        call(q, k, v)


def test_batch_mismatch():
    q, _, _ = qkv()
    k, v = randn(3, H, S, E), randn(3, H, S, E)
    with pytest.raises(AttentionInputError, match=r"key: dim 0 is 3 but query's is 2 .*leading dims must match or be 1"):
        call(q, k, v)


@pytest.mark.parametrize(
    "shape", [(L, S + 1), (B, H, L + 1, S), (3, 1, 1, S), (1, B, H, L, S)], ids=["S", "L", "B", "too_many_dims"]
)
def test_mask_wrong_shape(shape):
    q, k, v = qkv()
    mask = torch.ones(shape, dtype=torch.bool)
    with pytest.raises(AttentionInputError, match=re.escape(f"attn_mask: shape {shape} does not broadcast to (N, ..., Hq, L, S) = (2, 4, 8, 10)")):
        call(q, k, v, attn_mask=mask)


def test_mask_wrong_shape_2d_input():
    q, k, v = randn(L, E), randn(S, E), randn(S, E)
    with pytest.raises(AttentionInputError, match=r"attn_mask: shape \(8, 9\) does not broadcast"):
        call(q, k, v, attn_mask=torch.ones(L, S - 1, dtype=torch.bool))


def test_empty_head_dim():
    """Size-0 batch, length and value dims are answered as torch does (test_torch_semantics_edges);
    a size-0 query/key head dim is refused."""
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=r"query: is empty \(shape \(2, 4, 8, 0\)\)"):
        call(q[..., :0], k[..., :0], v)


# --- dtypes ---------------------------------------------------------------------------------------


def test_int_mask():
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=r"attn_mask: dtype torch.int64 is neither bool nor the query dtype torch.float32"):
        call(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.int64))


def test_float64_mask_with_float32_query():
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=r"attn_mask: dtype torch.float64 is neither bool nor the query dtype torch.float32"):
        call(q, k, v, attn_mask=randn(L, S, dtype=torch.float64))


@pytest.mark.parametrize("which", ["key", "value"])
def test_dtype_mismatch(which):
    q, k, v = qkv()
    if which == "key":
        k = k.to(torch.bfloat16)
    else:
        v = v.double()
    with pytest.raises(AttentionInputError, match=r"query, key and value must share a dtype; got torch.float32, "):
        call(q, k, v)


def test_integer_query():
    _, k, v = qkv()
    q = torch.ones(B, H, L, E, dtype=torch.int32)
    with pytest.raises(AttentionInputError, match=r"query: dtype torch.int32 is not a floating type"):
        call(q, k, v)


# --- non-finite values ------------------------------------------------------------------------------


def test_nan_in_query():
    q, k, v = qkv()
    q[0, 1, 2, 3] = float("nan")
    with pytest.raises(AttentionInputError, match=r"query: contains NaN or inf values at 1 position\(s\)"):
        call(q, k, v)


def test_inf_in_key():
    q, k, v = qkv()
    k[1, 0, 0, :2] = float("inf")
    with pytest.raises(AttentionInputError, match=r"key: contains NaN or inf values at 2 position\(s\)"):
        call(q, k, v)


def test_nan_in_float_mask():
    q, k, v = qkv()
    mask = randn(L, S)
    mask[3, 4] = float("nan")
    mask[0, 0] = float("-inf")  # -inf is a legal additive mask value, only NaN is reported
    with pytest.raises(AttentionInputError, match=r"attn_mask: contains NaN values at 1 position\(s\)"):
        call(q, k, v, attn_mask=mask)


def test_set_finite_check_off_disables_the_check():
    q, k, v = qkv()
    q[0, 0, 0, 0] = float("nan")
    try:
        set_finite_check("off")
        out = call(q, k, v, implementation="vanilla")
        assert torch.isnan(out[0, 0, 0]).all()
        assert torch.isfinite(out[1]).all()
    finally:
        set_finite_check("cpu")
    with pytest.raises(AttentionInputError, match=r"query: contains NaN"):
        call(q, k, v)


def test_set_finite_check_bad_mode():
    with pytest.raises(ValueError, match=r"mode='sometimes': expected 'cpu', 'always' or 'off'"):
        set_finite_check("sometimes")


# --- options ------------------------------------------------------------------------------------------


def test_mask_with_is_causal():
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=r"attn_mask was given with is_causal=True; pass one or the other"):
        call(q, k, v, attn_mask=torch.ones(L, S, dtype=torch.bool), is_causal=True)


def test_mask_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"attn_mask: expected a torch.Tensor or None, got list"):
        call(q, k, v, attn_mask=[[True] * S] * L)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")], ids=["negative", "above_one", "nan"])
def test_dropout_p_out_of_range(p):
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=re.escape(f"dropout_p={p!r}: expected a float in [0, 1).")):
        call(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", ["0.1", True, None], ids=["str", "bool", "none"])
def test_dropout_p_wrong_type(p):
    """As torch: a dropout_p of the wrong type is a TypeError (not an AttentionInputError)."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=re.escape(f"dropout_p={p!r}: expected a float in [0, 1), got {type(p).__name__}")) as info:
        call(q, k, v, dropout_p=p)
    assert not isinstance(info.value, AttentionInputError)


@pytest.mark.parametrize("scale", ["0.5", True], ids=["str", "bool"])
def test_scale_wrong_type(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=re.escape(f"scale={scale!r}: expected None or a finite float, got {type(scale).__name__}")):
        call(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_scale_not_finite(scale):
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match=re.escape(f"scale={scale!r}: expected None or a finite float.")):
        call(q, k, v, scale=scale)


def test_is_causal_not_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"is_causal=1: expected a bool"):
        call(q, k, v, is_causal=1)


def test_enable_gqa_not_bool():
    q, k, v = qkv(hq=8, hk=2)
    with pytest.raises(TypeError, match=r"enable_gqa='yes': expected a bool"):
        call(q, k, v, enable_gqa="yes")


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_argument_not_a_tensor(which):
    args = dict(zip(("query", "key", "value"), qkv()))
    args[which] = args[which].numpy()
    with pytest.raises(TypeError, match=rf"{which}: expected a torch.Tensor, got ndarray"):
        scaled_dot_product_attention(**args)


# --- implementations -------------------------------------------------------------------------------------


def test_unknown_implementation_lists_available():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"implementation='flashy' is not registered; available: \[.*'sdpa'.*'vanilla'.*\]"):
        call(q, k, v, implementation="flashy")


def test_unknown_name_in_implementation_list():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"implementation='nope' is not registered; available:"):
        call(q, k, v, implementation=["vanilla", "nope"])


@pytest.mark.parametrize("bad", [3, [], ["vanilla", 3], {"vanilla"}], ids=["int", "empty_list", "mixed_list", "set"])
def test_implementation_wrong_type(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"expected None, a registered name or a non-empty list of names; registered: \["):
        call(q, k, v, implementation=bad)


def test_forced_sdpa_cannot_run_value_head_dim():
    q, k, v = qkv(ev=E + 8)
    with pytest.raises(ValueError, match=r"implementation='sdpa' cannot run this call: value_head_dim=24 != head_dim=16"):
        call(q, k, v, implementation="sdpa")


def test_forced_sdpa_cannot_run_dropout():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"implementation='sdpa' cannot run this call: feature 'dropout' not supported"):
        call(q, k, v, dropout_p=0.2, implementation="sdpa")


def test_forced_sdpa_cannot_run_float16_on_cpu():
    q, k, v = qkv(dtype=torch.float16)
    with pytest.raises(ValueError, match=r"implementation='sdpa' cannot run this call: float16 on cpu"):
        call(q, k, v, implementation="sdpa")


def test_forced_sdpa_cannot_run_float64():
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"implementation='sdpa' cannot run this call: dtype float64 not in \['bfloat16', 'float16', 'float32'\]"):
        call(q, k, v, implementation="sdpa")


def test_implementation_list_none_can_run():
    q, k, v = qkv(ev=E + 8)
    with pytest.raises(NotImplementedError, match=r"no attention implementation can run this call:\n  sdpa: value_head_dim=24"):
        call(q, k, v, implementation=["sdpa"])


def test_sdpa_implementation_unknown_name():
    with pytest.raises(ValueError, match=r"implementation='bogus' is not registered; available: \["):
        with sdpa_implementation("bogus"):
            pass
    assert current_implementation() is None


def test_sdpa_implementation_wrong_type():
    with pytest.raises(TypeError, match=r"implementations=42: expected None, a registered name"):
        with sdpa_implementation(42):
            pass


# --- the error class --------------------------------------------------------------------------------------


def test_attention_input_error_is_runtime_error_and_value_error():
    q, k, v = qkv(hq=8, hk=2)
    assert issubclass(AttentionInputError, RuntimeError) and issubclass(AttentionInputError, ValueError)
    with pytest.raises(RuntimeError, match=r"enable_gqa=True") as info:  # what torch code catches
        call(q, k, v)
    assert isinstance(info.value, AttentionInputError)
    with pytest.raises(ValueError, match=r"enable_gqa=True"):
        call(q, k, v)


# --- deprecated names --------------------------------------------------------------------------------------


def test_deprecated_implementation_name_warns_once_and_runs_cudnn():
    """`cuda_flash_attn2` named cuDNN's fused attention (through sdpa): it still runs, as `cudnn`."""
    q, k, v = qkv()
    with pytest.warns(DeprecationWarning, match=r"implementation='cuda_flash_attn2' is deprecated.*'cudnn'") as seen:
        old = call(q, k, v, implementation="cuda_flash_attn2")
    assert len([w for w in seen if issubclass(w.category, DeprecationWarning)]) == 1
    torch.testing.assert_close(old, call(q, k, v, implementation="cudnn"), rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match="'cudnn'"), sdpa_implementation("cuda_flash_attn2"):
        assert current_implementation() == "cudnn"
