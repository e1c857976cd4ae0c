"""`torch.compile(dynamic=True)` over the drop-in SDPA, `flash_attention` and a `jax_op`: one graph for
many lengths (L and S varying apart), `fullgraph=True`, outputs and gradients against torch's SDPA
(math backend, float64)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.bridge import jax_op
from jaxattn.torch_api import flash_attention, scaled_dot_product_attention

LENGTHS = [(17, 33), (33, 17), (97, 130)]
SWEEP = [(17, 33), (33, 17), (97, 130), (130, 97), (40, 41), (64, 200), (81, 19), (23, 23), (150, 77), (55, 256),
         (201, 33), (19, 1025)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


CASES = {
    "causal_gqa": (lambda sdpa, q, k, v, m: sdpa(q, k, v, is_causal=True, enable_gqa=True)),
    "float_mask": (lambda sdpa, q, k, v, m: sdpa(q, k, v, m, enable_gqa=True)),
    "bool_key_padding": (lambda sdpa, q, k, v, m: sdpa(q, k, v, (m[0] > -1.0)[None, None, None], enable_gqa=True)),
}


def _inputs(l, s, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, l, 80, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, s, 80, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, s, 24, generator=g, dtype=torch.float64, requires_grad=True)
    m = torch.randn(l, s, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v, m


def _sweep(call, reference, lengths):
    """Runs `call` compiled with dynamic=True and fullgraph=True over `lengths`; checks every output
    and gradient against `reference` and that the first compilation served every length (no
    recompilation: a guard on a length or on a memo's contents would show here); returns the
    compiled graphs that hold a jax_call."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=counter, dynamic=True, fullgraph=True)
    for i, (l, s) in enumerate(lengths):
        inputs = _inputs(l, s, seed=i)
        out = compiled(*inputs)
        if i == 0:  # the first call's compilation (the backend may be called twice: Dynamo restarts
            first = counter.frame_count  # its analysis once for symbolic float arguments)
        ref = reference(*inputs)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-8)
        cotangent = torch.randn_like(ref)
        grads = torch.autograd.grad(out, inputs, cotangent, allow_unused=True)
        expected = torch.autograd.grad(ref, inputs, cotangent, allow_unused=True)
        for got, want in zip(grads, expected):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    assert counter.frame_count == first, f"{counter.frame_count - first} recompilations for {len(lengths)} lengths"
    return [g for g in counter.graphs if "jax_call" in str(g.graph)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_graph_for_every_length_of_the_drop_in(case):
    fn = CASES[case]
    graphs = _sweep(lambda *a: fn(scaled_dot_product_attention, *a), lambda *a: fn(_math, *a), LENGTHS)
    assert len(graphs) == 1


def test_one_graph_for_every_length_of_flash_attention():
    graphs = _sweep(lambda q, k, v, m: flash_attention(q, k, v, causal=True),
                    lambda q, k, v, m: _math(q, k, v, is_causal=True, enable_gqa=True), LENGTHS)
    assert len(graphs) == 1


@pytest.mark.thorough
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_long_length_sweep_compiles_once(case):
    fn = CASES[case]
    graphs = _sweep(lambda *a: fn(scaled_dot_product_attention, *a), lambda *a: fn(_math, *a), SWEEP)
    assert len(graphs) == 1


def test_the_default_dynamic_mode_settles_on_one_graph():
    """dynamic=None compiles static first and, on the first new length, one dynamic graph."""
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True), backend=counter)
    with torch.no_grad():
        for i, (l, s) in enumerate(LENGTHS):
            q, k, v, _ = _inputs(l, s, seed=i)
            torch.testing.assert_close(compiled(q, k, v), _math(q, k, v, enable_gqa=True), atol=1e-10, rtol=1e-8)
    assert counter.frame_count == 2


def test_repeated_calls_of_one_shape_compile_once():
    """Static shapes (dynamic=False), a decoding call and a prefill: the calls after the first find
    the first compilation (the settings' memos are not read under compile, so no guard on them)."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, enable_gqa=True),
                             backend=counter, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for l, s in ((1, 40), (33, 17)):
            for seed in range(3):
                q, k, v, _ = _inputs(l, s, seed=seed)
                torch.testing.assert_close(compiled(q, k, v), _math(q, k, v, enable_gqa=True), atol=1e-10,
                                           rtol=1e-8)
                if seed == 0:
                    first = counter.frame_count
            assert counter.frame_count == first, (l, s, counter.frame_count - first)


@jax_op(name="tests.test_compile_dynamic.concat")
def _concat(x, y):
    return jnp.concatenate([x, y], axis=0)


def test_an_output_size_that_is_no_input_size_is_refused_by_name():
    compiled = torch.compile(lambda a, b: _concat(a, b), backend="aot_eager", dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match="output 0 dim 0.*cannot be expressed symbolically.*dynamic=False"):
        compiled(torch.randn(5, 3), torch.randn(7, 3))
    torch._dynamo.reset()  # the same op at static sizes compiles
    static = torch.compile(lambda a, b: _concat(a, b), backend="aot_eager", dynamic=False, fullgraph=True)
    x, y = torch.randn(5, 3), torch.randn(7, 3)
    torch.testing.assert_close(static(x, y), torch.cat([x, y]))


@dataclasses.dataclass(frozen=True)
class _Factor:
    factor: float
    num_inputs: int = 1


def test_triton_op_settings_from_symbolic_sizes_are_guarded():
    """A Triton op's settings (its spec) may be computed from sizes, which torch.compile(dynamic=True)
    makes symbolic (a default softmax scale from the head dim, a diagonal offset S - L): the graph is
    guarded on their values, so each value gets its own correct graph instead of a tracing error.
    Plain torch bodies: the spec route is tested, not kernels (those run on the GPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from jaxattn.bridge.triton_autograd import TritonOp

    op = TritonOp("jaxattn_test::scaled_by_size", lambda spec, x: (x * spec.factor,),
                  lambda spec, inputs, outputs, grads, needs: [grads[0] * spec.factor],
                  num_outputs=1, spec_types=[_Factor])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: op(_Factor(x.shape[0] ** -0.5), x)[0], fullgraph=True, dynamic=True,
                             backend=counter)
    for n in (4, 9, 4, 16):
        x = torch.randn(n, requires_grad=True)
        y = compiled(x)
        y.sum().backward()
        torch.testing.assert_close(y, x.detach() * n ** -0.5)
        torch.testing.assert_close(x.grad, torch.full((n,), n ** -0.5))
    assert counter.frame_count == 3, counter.frame_count  # one graph per distinct setting value
