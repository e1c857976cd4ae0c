"""A process forked after jaxattn ran JAX's runtime raises a clear error instead of hanging; a
spawned one (the fix the error names) computes torch's result."""

import multiprocessing
import sys

import pytest
import torch
import torch.nn.functional as F

from jaxattn.torch_api import scaled_dot_product_attention

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork start method (Linux)")

TIMEOUT_S = 120


def _qkv(length):
    gen = torch.Generator().manual_seed(length)
    return [torch.randn(1, 2, length, 16, generator=gen) for _ in range(3)]


def _child(queue, lengths):
    results = []
    for length in lengths:
        q, k, v = _qkv(length)
        try:
            out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="vanilla")
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            results.append(("ok", float((out - ref).abs().max())))
        except Exception as exc:  # reported to the parent
            results.append((type(exc).__name__, str(exc)))
    queue.put(results)


def _run(method, lengths):
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, lengths))
    proc.start()
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"the {method}ed child did not finish within {TIMEOUT_S} s (hung)")
    assert proc.exitcode == 0
    return queue.get(timeout=10)


def test_forked_child_raises_a_clear_error_instead_of_hanging():
    q, k, v = _qkv(12)
    scaled_dot_product_attention(q, k, v, is_causal=True, implementation="vanilla")  # runtime started here
    # length 12: the parent's planned signature; 13: a new one the child would have to plan
    for kind, message in _run("fork", [12, 13]):
        assert kind == "RuntimeError", message
        assert "forked after its parent started JAX's runtime" in message and "'spawn'" in message


def test_spawned_child_computes_torchs_result():
    q, k, v = _qkv(12)
    scaled_dot_product_attention(q, k, v, is_causal=True, implementation="vanilla")
    [(kind, err)] = _run("spawn", [12])
    assert kind == "ok" and err < 1e-5, (kind, err)
