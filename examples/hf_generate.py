"""Generation with a Hugging Face transformers model whose attention runs in jaxattn.

    pip install -e ".[hf]"        # from the jaxattn checkout: transformers
    python examples/hf_generate.py [--device cpu|cuda] [--new-tokens 16] [--model llama|gemma2] [--dynamic-cache]

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

from cli_options import add_device_option, positive_int, resolve_device

PROMPT_LEN, MAX_POSITIONS = 11, 256  # the padded prompts' length; the tiny models' position limit


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    parser.add_argument("--new-tokens", type=positive_int, default=16,
                        help=f"tokens generated after each prompt (default 16, at most {MAX_POSITIONS - PROMPT_LEN})")
    parser.add_argument("--model", default="llama", choices=("llama", "gemma2"),
                        help="llama (grouped-query attention) or gemma2 (sliding window, soft cap); default llama")
    parser.add_argument("--dynamic-cache", action="store_true",
                        help="transformers' default dynamic cache, grown each step (default: a static cache)")
    return parser


if __name__ == "__main__":  # --help and bad options answer here, before the imports below (torch takes seconds)
    build_parser().parse_args()

import torch  # noqa: E402

from jaxattn.bridge import cache_info  # noqa: E402
from jaxattn.torch_api import register_transformers  # noqa: E402


def tiny_model(kind: str, device: str):
    """A randomly initialised 2-layer model (hidden 64, vocab 128) with grouped-query attention."""
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=MAX_POSITIONS)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if PROMPT_LEN + args.new_tokens > MAX_POSITIONS:
        parser.error(f"--new-tokens {args.new_tokens}: expected at most {MAX_POSITIONS - PROMPT_LEN} (the tiny "
                     f"models hold {MAX_POSITIONS} positions; prompts take {PROMPT_LEN})")
    args.device = resolve_device(parser, args.device)

    name = register_transformers()  # "jaxattn"
    model = tiny_model(args.model, args.device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, PROMPT_LEN), generator=g).to(args.device)
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
