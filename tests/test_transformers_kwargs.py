"""The jaxattn transformers plug-in with the keyword arguments beyond the common ones: position_bias (T5),
sparse `indices` (DeepSeek-V3.2), deterministic (ModernBERT), the refused sinks / block_indices, and names.

Oracles: transformers' own "sdpa" on tiny T5-family models built from configs (nothing downloaded), and
torch's math SDPA in float64 with a mask built here, element by element, from the arguments' meaning.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jaxattn.torch_api import AttentionInputError, register_transformers  # noqa: E402
from jaxattn.torch_api.transformers_kwargs import DETERMINISTIC_ON_GPU, deterministic_choice  # noqa: E402
from jaxattn.torch_api.transformers_plugin import make_attention_function  # noqa: E402

VOCAB = 128
T5_SMALL = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                decoder_start_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register_transformers()


def _t5_family(kind: str):
    torch.manual_seed(0)
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_SMALL))
    else:  # umt5: every layer has its own relative attention bias
        model = transformers.UMT5ForConditionalGeneration(transformers.UMT5Config(**T5_SMALL))
    with torch.no_grad():  # the default init makes the bias tiny; a visible one makes its effect testable
        for name, p in model.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                p.normal_()
    return model.train()  # dropout_rate=0: train mode only enables gradients of every path


@pytest.mark.parametrize("kind", ["t5", pytest.param("umt5", marks=pytest.mark.thorough)])
def test_t5_family_logits_and_relative_bias_gradients_match_sdpa(kind):
    model = _t5_family(kind)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding in the encoder
    labels = torch.randint(1, VOCAB, (2, 6), generator=g)
    result = {}
    for impl in ("sdpa", "jaxattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        result[impl] = out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}
    torch.testing.assert_close(result["jaxattn"][0], result["sdpa"][0], atol=2e-5, rtol=2e-5)
    bias_grads = [n for n in result["sdpa"][1] if "relative_attention_bias" in n]
    assert bias_grads and all(result["sdpa"][1][n].abs().max() > 1e-4 for n in bias_grads)
    for name, want in result["sdpa"][1].items():
        torch.testing.assert_close(result["jaxattn"][1][name], want, atol=1e-5, rtol=1e-4, msg=name)


def _qkv(l=6, s=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, n, 8, generator=g, dtype=dtype) for h, n in ((4, l), (2, s), (2, s)))
    return q, k, v


def _oracle(q, k, v, keep, bias=None, scale=None):
    """torch's math SDPA in float64 on a float mask: the bias where `keep`, -inf elsewhere."""
    q, k, v = (t.double() for t in (q, k, v))
    add = torch.zeros(keep.shape, dtype=torch.float64) if bias is None else bias.double().expand(keep.shape)
    add = add.masked_fill(~keep, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "float"])
def test_position_bias_is_added_to_the_logits_and_gets_its_gradient(mask_kind):
    fn = make_attention_function()
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, :, :, :2] = False  # the second sequence is left-padded
    keep[1, :, :2, 0] = True  # ... but its padded rows see one key (as transformers' masks keep rows finite)
    mask = {"causal": None, "bool": keep, "float": torch.zeros(keep.shape).masked_fill(~keep, -1e9)}[mask_kind]
    if mask_kind == "causal":
        keep = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    out, _ = fn(torch.nn.Module(), q, k, v, mask, scaling=1.0, position_bias=bias, is_causal=True)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), bias)
    ref_bias = bias.detach().double().requires_grad_()
    ref = _oracle(q, k, v, keep.expand(2, 4, 6, 6), ref_bias, scale=1.0)
    (ref_grad,) = torch.autograd.grad(ref.pow(2).sum(), ref_bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=1e-5)


def test_position_bias_of_a_wrong_shape_or_dtype_raises():
    fn = make_attention_function()
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError, match=r"position_bias=.*\(B, Hq, L, S\)"):
        fn(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1, 3, 6, 6))
    with pytest.raises(AttentionInputError, match="position_bias: dtype torch.int64"):
        fn(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1, 4, 6, 6, dtype=torch.long))


def test_sparse_indices_select_the_keys_each_query_attends_to():
    fn = make_attention_function()
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(4)
    indices = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(12)]).view(2, 6, 3)
    indices[0, 5, 2] = -1  # a slot that selects nothing
    indices[:, :, 0] = 0  # every row keeps key 0, so that no row is empty
    keep = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    for b in range(2):
        for i in range(6):
            for j in indices[b, i].tolist():
                if j >= 0 and j <= i:  # selected and causal
                    keep[b, 0, i, j] = True
    out, _ = fn(torch.nn.Module(), q, k, v, None, indices=indices, is_causal=True)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, keep.expand(2, 4, 6, 6)), atol=1e-5, rtol=1e-5)
    with pytest.raises(AttentionInputError, match="indices: entry 6 is not below the number of keys, 6"):
        fn(torch.nn.Module(), q, k, v, None, indices=torch.full((2, 6, 1), 6))
    with pytest.raises(AttentionInputError, match=r"indices=.*\(B, L, k\)"):
        fn(torch.nn.Module(), q, k, v, None, indices=torch.zeros(2, 6))


def test_deterministic_is_accepted_and_changes_nothing_on_cpu():
    fn = make_attention_function()
    q, k, v = _qkv()
    out, _ = fn(torch.nn.Module(), q, k, v, None, deterministic=True)
    again, _ = fn(torch.nn.Module(), q, k, v, None, deterministic=True)
    plain, _ = fn(torch.nn.Module(), q, k, v, None)
    assert torch.equal(out, plain) and torch.equal(out, again)
    with pytest.raises(AttentionInputError, match="deterministic='yes'"):
        fn(torch.nn.Module(), q, k, v, None, deterministic="yes")


def test_deterministic_choice_keeps_cpu_and_selects_flash_on_gpus():
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert deterministic_choice("vanilla", torch.device("cpu")) == "vanilla"
    assert deterministic_choice(None, cuda) == "flash"
    assert deterministic_choice(("sdpa", "flash", "vanilla"), cuda) == "flash"
    assert "flash" in DETERMINISTIC_ON_GPU and "sdpa" not in DETERMINISTIC_ON_GPU
    with pytest.raises(AttentionInputError, match=r"deterministic=True with implementation=\('sdpa', 'vanilla'\)"):
        deterministic_choice(("sdpa", "vanilla"), cuda)


@pytest.mark.parametrize("name, value, meaning", [
    ("sinks", torch.zeros(2, 4, 6, 1), "per-query attention sink logits"),
    ("block_indices", torch.zeros(2, 1, 6, 2, dtype=torch.long), "key blocks each query attends to"),
])
def test_arguments_jaxattn_cannot_compute_raise_with_their_meaning(name, value, meaning):
    fn = make_attention_function()
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=f"{name}=<tensor.*{meaning}"):
        fn(torch.nn.Module(), q, k, v, None, **{name: value})
    fn(torch.nn.Module(), q, k, v, None, **{name: None})  # None: nothing to compute


def test_unknown_sparse_argument_raises_type_error():
    fn = make_attention_function()
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="sparse_indices=<tensor"):
        fn(torch.nn.Module(), q, k, v, None, sparse_indices=torch.zeros(2, 6, 3, dtype=torch.long))


@pytest.mark.parametrize("name", ["jaxattn_flash", "flash", "my_flash_attention"])
def test_names_containing_flash_are_refused(name):
    from transformers.utils.generic import is_flash_attention_requested

    assert is_flash_attention_requested(requested_attention_implementation=name)  # transformers' own rule
    with pytest.raises(ValueError, match=f"name='{name}': transformers treats .* 'flash'.*jaxattn_tiled"):
        register_transformers(name, "flash")


def test_the_readme_name_loads_a_model():
    name = register_transformers("jaxattn_tiled", "vanilla")  # "vanilla": runs on CPU, unlike "flash"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64))
    model.set_attn_implementation(name)
    with torch.no_grad():
        assert model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.shape == (1, 4, 64)
