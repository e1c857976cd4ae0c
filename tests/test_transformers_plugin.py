"""register_transformers: jaxattn as an attn_implementation of Hugging Face transformers.

Tiny randomly initialised models built from configs (nothing is downloaded), float32 on CPU. The
oracles are transformers' own "sdpa" (torch's SDPA) and "eager" (plain torch ops) implementations.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from jaxattn.jax_core import ImplementationUnavailableError  # noqa: E402
from jaxattn.torch_api import AttentionInputError, register_transformers  # noqa: E402
from jaxattn.torch_api.transformers_plugin import make_attention_function  # noqa: E402

VOCAB = 128
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=256)
ATOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register_transformers()


def _model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **overrides))
    elif kind == "mistral":  # sliding-window attention
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, **overrides))
    elif kind == "gemma2":  # logits soft cap, alternating sliding/full layers
        cfg = dict(SMALL, head_dim=16, final_logit_softcapping=None, sliding_window=6, query_pre_attn_scalar=1,
                   initializer_range=0.1, tie_word_embeddings=False)  # untied: greedy tokens do not just repeat
        cfg.update(overrides)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**cfg))
    elif kind == "gpt_oss":  # attention sinks (s_aux), sliding window
        cfg = dict(SMALL, intermediate_size=64, head_dim=16, sliding_window=6, num_local_experts=4,
                   num_experts_per_tok=2)
        cfg.update(overrides)
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg))
        with torch.no_grad():  # sinks start at 0; random values make them matter
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_()
    else:
        raise ValueError(kind)
    return model.eval()


def _batch(padded: bool, length: int = 13):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding, as for generation
        mask[1, :1] = 0
    return ids, mask


def _logits(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_registration_adds_attention_and_sdpa_mask_functions(registered):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert registered == "jaxattn"
    assert registered in ALL_ATTENTION_FUNCTIONS
    assert ALL_MASK_ATTENTION_FUNCTIONS[registered] is sdpa_mask


@pytest.mark.parametrize("padded", [False, True])
def test_llama_gqa_logits_match_sdpa_and_eager(padded):
    model = _model("llama")
    ids, mask = _batch(padded)
    ours = _logits(model, "jaxattn", ids, mask)
    torch.testing.assert_close(ours, _logits(model, "sdpa", ids, mask), atol=ATOL, rtol=ATOL)
    real = mask.bool()  # eager differs from both on fully padded query rows, which nothing reads
    torch.testing.assert_close(ours[real], _logits(model, "eager", ids, mask)[real], atol=ATOL, rtol=ATOL)


def test_bert_bidirectional_with_right_padding_matches_sdpa():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=VOCAB)
    model = transformers.BertModel(config).eval()
    ids, _ = _batch(False)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    out = {}
    for impl in ("sdpa", "jaxattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out["jaxattn"], out["sdpa"], atol=ATOL, rtol=ATOL)


def test_padding_changes_the_result():
    """The mask reaches the attention: the unpadded tokens' logits depend on what is padded."""
    model = _model("llama")
    ids, mask = _batch(True)
    with_pad = _logits(model, "jaxattn", ids, mask)
    without = _logits(model, "jaxattn", ids, torch.ones_like(mask))
    assert (with_pad[0, 5:] - without[0, 5:]).abs().max() > 1e-2


def test_llama_generate_same_tokens_as_sdpa():
    model = _model("llama")
    ids, mask = _batch(True, length=9)
    out = {}
    for impl in ("sdpa", "jaxattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
    assert out["jaxattn"].shape == (2, 13)
    assert torch.equal(out["jaxattn"], out["sdpa"])


def test_llama_gradients_match_sdpa():
    model = _model("llama").train()
    ids, mask = _batch(True)
    grads = {}
    for impl in ("sdpa", "jaxattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["jaxattn"].keys() == grads["sdpa"].keys()
    for name, want in grads["sdpa"].items():
        torch.testing.assert_close(grads["jaxattn"][name], want, atol=1e-5, rtol=1e-4, msg=name)


def test_mistral_sliding_window_matches_sdpa_and_the_window_matters():
    ids, mask = _batch(True)
    model = _model("mistral", sliding_window=4)
    ours = _logits(model, "jaxattn", ids, mask)
    torch.testing.assert_close(ours, _logits(model, "sdpa", ids, mask), atol=ATOL, rtol=ATOL)
    full = _logits(_model("mistral", sliding_window=None), "jaxattn", ids, mask)
    assert (ours - full).abs().max() > 1e-2


def test_mistral_generate_with_window_same_tokens_as_sdpa():
    model = _model("mistral", sliding_window=4)
    ids, mask = _batch(True, length=9)
    out = {}
    for impl in ("sdpa", "jaxattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
    assert torch.equal(out["jaxattn"], out["sdpa"])


def test_gemma2_softcap_matches_eager_and_the_cap_matters():
    ids, mask = _batch(True)
    model = _model("gemma2", attn_logit_softcapping=0.5)  # small cap: it clips most logits
    # the oracle is eager: transformers' sdpa cannot soft-cap (recent versions refuse it for Gemma 2)
    ours = _logits(model, "jaxattn", ids, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], _logits(model, "eager", ids, mask)[real], atol=ATOL, rtol=ATOL)
    uncapped = _logits(_model("gemma2", attn_logit_softcapping=None), "jaxattn", ids, mask)
    assert (ours[real] - uncapped[real]).abs().max() > 1e-2


def test_gemma2_generate_same_tokens_as_eager():
    model = _model("gemma2", attn_logit_softcapping=0.5)
    ids, mask = _batch(True, length=9)
    out = {}
    for impl in ("eager", "jaxattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
    assert torch.equal(out["jaxattn"], out["eager"])


def test_gpt_oss_sinks_match_eager():
    ids, mask = _batch(True)
    model = _model("gpt_oss")
    real = mask.bool()
    ours = _logits(model, "jaxattn", ids, mask)
    torch.testing.assert_close(ours[real], _logits(model, "eager", ids, mask)[real], atol=ATOL, rtol=ATOL)


def test_gpt_oss_sink_gradients_match_eager():
    model = _model("gpt_oss").train()
    ids, mask = _batch(True)
    grads = {}
    for impl in ("eager", "jaxattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    sinks = [n for n in grads["eager"] if n.endswith("sinks")]
    assert len(sinks) == 2 and all(grads["eager"][n].abs().max() > 0 for n in sinks)
    for name, want in grads["eager"].items():
        torch.testing.assert_close(grads["jaxattn"][name], want, atol=1e-5, rtol=1e-4, msg=name)


def test_implementation_choice_is_used():
    name = register_transformers("jaxattn_decode_only", implementation="decode")
    model = _model("llama")
    ids, mask = _batch(False, length=20)
    model.set_attn_implementation(name)
    with pytest.raises(ImplementationUnavailableError, match="decode"):  # a 20-token prefill is not decoding
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    name = register_transformers("jaxattn_vanilla", implementation="vanilla")
    torch.testing.assert_close(_logits(model, name, ids, mask), _logits(model, "sdpa", ids, mask), atol=ATOL,
                               rtol=ATOL)


def test_register_rejects_transformers_names_and_unknown_implementations():
    with pytest.raises(ValueError, match="transformers' own"):
        register_transformers("sdpa")
    with pytest.raises(ValueError, match="not registered"):
        register_transformers("jaxattn_bad", implementation="no_such_impl")


def _qkv(l=5, s=5):
    g = torch.Generator().manual_seed(2)
    return torch.randn(1, 4, l, 8, generator=g), torch.randn(1, 2, s, 8, generator=g), torch.randn(1, 2, s, 8, generator=g)


def test_attention_function_output_layout_and_unknown_kwargs():
    fn = make_attention_function()
    module = torch.nn.Module()
    q, k, v = _qkv()
    out, weights = fn(module, q, k, v, None, scaling=0.3, position_ids=torch.arange(5)[None], use_cache=True)
    assert weights is None and out.shape == (1, 5, 4, 8) and out.is_contiguous()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="head_mask"):
        fn(module, q, k, v, None, head_mask=torch.ones(4))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        fn(module, q, k, v, None, output_attentions=True)
    fn(module, q, k, v, None, output_attentions=False, head_mask=None)  # explicit "off" values are fine


def test_sliding_window_without_mask_raises_when_it_would_matter():
    fn = make_attention_function()
    module = torch.nn.Module()
    q, k, v = _qkv(1, 9)
    with pytest.raises(AttentionInputError, match="sliding_window=4"):
        fn(module, q, k, v, None, sliding_window=4)
    out, _ = fn(module, q, k, v, None, sliding_window=16)  # a window longer than the keys changes nothing
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_softcap_and_sinks_arguments_are_checked():
    fn = make_attention_function()
    module = torch.nn.Module()
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError, match="softcap"):
        fn(module, q, k, v, None, softcap=-1.0)
    with pytest.raises(AttentionInputError, match="s_aux"):
        fn(module, q, k, v, None, s_aux=torch.zeros(3))
