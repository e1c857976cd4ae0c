"""Generation with a Hugging Face transformers model whose attention runs in jaxattn.

    pip install "jaxattn[hf]"
    python examples/hf_generate.py [--device cuda] [--new-tokens 16] [--model llama|gemma2] [--dynamic-cache]

One call, `register_transformers()`, makes "jaxattn" an `attn_implementation`: the model runs its
prefill (all prompt tokens at once, left-padded batch) and every decoding step through jaxattn.
The model is a tiny random one built from a config (nothing is downloaded); the same weights run
with transformers' own "sdpa" (or "eager" for Gemma 2, whose logits soft cap sdpa cannot do) and
the greedy tokens must be the same.

By default the KV cache is static (`cache_implementation="static"`): every decoding step then has
the same shapes, so jaxattn compiles once for the prefill and once for decoding. With a dynamic
cache the key length grows each step and each new length is a new compilation.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from jaxattn.bridge import cache_info
from jaxattn.torch_api import register_transformers


def tiny_model(kind: str, device: str):
    """A randomly initialised 2-layer model (hidden 64, vocab 128) with grouped-query attention."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "gemma2":  # sliding-window and full layers, logits soft cap
        config = transformers.Gemma2Config(**common, head_dim=16, sliding_window=8, attn_logit_softcapping=1.0,
                                           query_pre_attn_scalar=1, initializer_range=0.1,
                                           tie_word_embeddings=False)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        raise ValueError(f"--model {kind!r}: expected 'llama' or 'gemma2'.")
    return model.to(device).eval()


def generate(model, impl: str, ids, mask, new_tokens: int, cache: str):
    model.set_attn_implementation(impl)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, cache_implementation=cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--model", default="llama", choices=("llama", "gemma2"))
    parser.add_argument("--dynamic-cache", action="store_true", help="grow the KV cache each step")
    args = parser.parse_args(argv)

    name = register_transformers()  # "jaxattn"
    model = tiny_model(args.model, args.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, 11), generator=g).to(args.device)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # prompts of 5, 11 and 9 tokens, left-padded
    mask[2, :2] = 0
    cache = "dynamic" if args.dynamic_cache else "static"
    oracle = "eager" if args.model == "gemma2" else "sdpa"

    expected = generate(model, oracle, ids, mask, args.new_tokens, cache)
    compiles_before, start = cache_info().misses, time.perf_counter()
    got = generate(model, name, ids, mask, args.new_tokens, cache)
    seconds, compiles = time.perf_counter() - start, cache_info().misses - compiles_before

    for row, prompt_mask in zip(got.tolist(), mask.tolist()):
        prompt = [t for t, m in zip(row, prompt_mask) if m]
        print(f"prompt {prompt} -> {row[len(prompt_mask):]}")
    same = torch.equal(got, expected)
    print(f"{args.model}, {cache} cache: {args.new_tokens} new tokens in {seconds:.2f} s, {compiles} jaxattn "
          f"compilations; tokens {'match' if same else 'DIFFER from'} transformers' {oracle}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
