"""patch_sdpa: torch.nn.functional.scaled_dot_product_attention routed to jaxattn, and restored."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jaxattn.bridge import cache_info
from jaxattn.jax_core import ImplementationUnavailableError
from jaxattn.torch_api import install_sdpa_patch, is_sdpa_patched, patch_sdpa, uninstall_sdpa_patch
from jaxattn.torch_api import patch as patch_module
from jaxattn.torch_api.patch import TORCH_SDPA


class TinySelfAttention(nn.Module):
    """A block written against torch's API: it looks F.scaled_dot_product_attention up at call time."""

    def __init__(self, dim=48, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _model_and_input(seed=0):
    torch.manual_seed(seed)
    return TinySelfAttention(), torch.randn(2, 37, 48)


@pytest.fixture(autouse=True)
def _torch_function_restored():
    yield
    while patch_module._stack:  # a failing test must not leave the patch on for the next ones
        uninstall_sdpa_patch()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def _jax_calls() -> int:
    info = cache_info()
    return info.hits + info.misses


def test_model_output_and_grads_match_torch_under_the_patch():
    model, x = _model_and_input()
    want = model(x)
    want.square().sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    before = _jax_calls()
    with patch_sdpa():
        assert is_sdpa_patched()
        got = model(x)
        got.square().sum().backward()
    assert _jax_calls() > before, "the model's attention did not go through jaxattn"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_bool_mask_reaches_jaxattn():
    model, x = _model_and_input(1)
    mask = torch.rand(2, 1, 37, 37, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[..., 0] = True
    want = model(x, mask)
    with patch_sdpa("vanilla"):
        got = model(x, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_restored_on_exit_and_on_exception():
    with patch_sdpa():
        assert F.scaled_dot_product_attention is not TORCH_SDPA
    assert F.scaled_dot_product_attention is TORCH_SDPA and not is_sdpa_patched()
    with pytest.raises(KeyError):
        with patch_sdpa():
            raise KeyError("boom")
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_implementation_option_is_used():
    model, x = _model_and_input()
    with patch_sdpa(implementation="decode"):  # decode takes <= 16 queries: the 37-token call must be refused
        with pytest.raises(ImplementationUnavailableError, match="decode"):
            model(x)
    with patch_sdpa(implementation=["decode", "vanilla"]):  # a list falls back in order
        torch.testing.assert_close(model(x), _model_and_input()[0](x), atol=1e-5, rtol=1e-5)


def test_unknown_implementation_raises_before_patching():
    with pytest.raises(ValueError, match="not registered"):
        with patch_sdpa(implementation="no_such_impl"):
            pass
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_nesting_inner_choice_wins_and_outer_is_kept():
    model, x = _model_and_input()
    with patch_sdpa("vanilla"):
        with patch_sdpa("decode"):
            with pytest.raises(ImplementationUnavailableError):
                model(x)
        assert is_sdpa_patched()
        model(x)  # the outer "vanilla" applies again
    assert not is_sdpa_patched()


def test_global_install_and_uninstall():
    install_sdpa_patch()
    try:
        assert is_sdpa_patched()
        model, x = _model_and_input()
        before = _jax_calls()
        model(x)
        assert _jax_calls() > before
    finally:
        uninstall_sdpa_patch()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(RuntimeError, match="no jaxattn patch"):
        uninstall_sdpa_patch()


def test_foreign_replacement_is_not_overwritten(monkeypatch):
    def other(*args, **kwargs):
        return TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", other)
    with pytest.raises(RuntimeError, match="already replaced"):
        install_sdpa_patch()
    assert F.scaled_dot_product_attention is other
    monkeypatch.undo()

    install_sdpa_patch()
    F.scaled_dot_product_attention = other  # someone replaces ours while it is installed
    try:
        with pytest.raises(RuntimeError, match="replaced"):
            uninstall_sdpa_patch()
    finally:
        F.scaled_dot_product_attention = patch_module._patched_sdpa
        uninstall_sdpa_patch()


def test_calls_made_while_jaxattn_runs_go_to_torch(monkeypatch):
    """A jaxattn path that itself calls F.scaled_dot_product_attention must reach torch's, not recurse."""
    seen = []

    def jaxattn_path_calling_torch(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, implementation):
        seen.append(F.scaled_dot_product_attention is patch_module._patched_sdpa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(patch_module, "scaled_dot_product_attention", jaxattn_path_calling_torch)
    model, x = _model_and_input()
    want = model(x)
    with patch_sdpa():
        got = model(x)
    assert seen == [True]  # the inner call did see the patched attribute, and was served by torch
    torch.testing.assert_close(got, want)


def test_positional_arguments_like_torch():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g) for _ in range(3))
    mask = torch.randn(2, 3, 11, 11, generator=g)
    want = TORCH_SDPA(q, k, v, mask, 0.0, False, scale=0.4)
    with patch_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.4)
        with pytest.raises(TypeError):  # scale is keyword-only, as in torch
            F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, 0.4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compiles_fullgraph_under_the_patch():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with patch_sdpa():
        got = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, TORCH_SDPA(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
