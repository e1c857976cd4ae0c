"""Static arguments of `jax_op` travel as values (`bridge.call_spec`): exact through the eager path
and the custom op, decoded from the key where the table is empty (a graph exported or cached in
another process), refused clearly where the key is foreign. Oracles are plain torch ops."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jaxattn.bridge import call_spec, custom_ops, jax_op


@jax_op(name="tests.test_bridge_call_spec.affine")
def affine(x, *, scale, shift=0.0, tag="", dims=()):
    del tag  # only part of the key
    out = x * scale + shift if shift else x * scale  # XLA folds `+ 0.0`, which would hide a -0.0
    return out.sum(axis=dims) if dims else out


def _affine_torch(x, *, scale, shift=0.0, dims=()):
    out = x * scale + shift if shift else x * scale
    return out.sum(dim=dims) if dims else out


class _RecordJaxCalls(TorchDispatchMode):
    """Forces the custom-op route (a dispatch mode is active) and records its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.jaxattn.jax_call.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


STATICS = [
    dict(scale=-0.0),
    dict(scale=2, shift=True),
    dict(scale=2.0, shift=1),
    dict(scale=float("inf")),
    dict(scale=1.5, tag="a;)(s3:b\n\u00e9", dims=(0, -1)),
    dict(scale=0.5, shift=-1e-300, tag="", dims=(1,)),
]


@pytest.mark.parametrize("static", STATICS, ids=lambda s: repr(s))
def test_custom_op_route_matches_torch_with_an_empty_table(static):
    x = torch.randn(3, 4, dtype=torch.float64)
    with _RecordJaxCalls() as rec:
        out = affine(x, **static)
    torch_static = {k: v for k, v in static.items() if k != "tag"}
    ref = _affine_torch(x, **torch_static)
    torch.testing.assert_close(out, ref)
    assert torch.equal(torch.signbit(out), torch.signbit(ref))  # -0.0 stays -0.0
    (tensors, op, key), = rec.calls
    call_spec.forget_all()  # as in a process that loads a graph recorded elsewhere
    spec = call_spec.lookup(key)
    assert spec.kwargs == static or math.isnan(static.get("scale", 0.0))
    assert [type(v) for _, v in spec.static] == [type(static[k]) for k, _ in spec.static]
    again = torch.ops.jaxattn.jax_call(tensors, op, key)[0]
    torch.testing.assert_close(again, ref)
    assert torch.equal(torch.signbit(again), torch.signbit(ref))


def test_one_one_point_zero_and_true_are_distinct_calls():
    keys = {call_spec.intern(1, (0,), (None,), (("v", v),), False).key for v in (1, 1.0, True, -0.0, 0.0)}
    assert len(keys) == 5
    nan = call_spec.lookup(call_spec.intern(1, (0,), (None,), (("v", float("nan")),), False).key)
    assert math.isnan(nan.kwargs["v"])


def test_eager_calls_build_and_read_no_strings(monkeypatch):
    x = torch.randn(4, requires_grad=True)
    affine(x, scale=3.0, dims=(0,)).backward()  # the signature's plan is made here, once
    x.grad = None

    def refuse(*args, **kwargs):
        raise AssertionError("a string was built or read on the eager per-call path")

    monkeypatch.setattr(call_spec, "_encode", refuse)
    monkeypatch.setattr(call_spec, "_decode", refuse)
    monkeypatch.setattr(custom_ops, "lookup", refuse)
    out = affine(x, scale=3.0, dims=(0,))
    out.backward()
    torch.testing.assert_close(out, (x.detach() * 3.0).sum())
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize("key", [
    "(1, (0,), (None,), (('scale', 2.0),), False)",  # the repr spec of earlier versions
    "jaxattn-call-0|(i1;(i0;)(N)()F)",
])
def test_foreign_key_is_refused_naming_the_caches(key):
    x = torch.randn(3)
    with pytest.raises(ValueError, match="TORCHINDUCTOR_CACHE_DIR"):
        torch.ops.jaxattn.jax_call([x], "tests.test_bridge_call_spec.affine", key)


@pytest.mark.parametrize("key", ["jaxattn-call-1|(i1;(i0;)(N)()", "jaxattn-call-1|(i1;(i0;)(N)(s9:ab)F)",
                                 "jaxattn-call-1|(NNNNN)"])
def test_malformed_key_is_refused(key):
    with pytest.raises(ValueError, match="malformed"):
        call_spec.lookup(key)


def test_unregistered_op_name_is_refused_clearly():
    key = call_spec.intern(1, (0,), (None,), (), False).key
    with pytest.raises(KeyError, match="import the module that defines it"):
        torch.ops.jaxattn.jax_call([torch.randn(2)], "tests.nowhere.op", key)


_EXPORTER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_bridge_call_spec import affine

    class M(torch.nn.Module):
        def forward(self, x):
            return affine(x, scale=-0.0, shift=2, tag="t", dims=(1,)) + affine(x, scale=1.5, dims=(0, 1))

    x = torch.arange(12.0).reshape(3, 4)
    if sys.argv[1] == "save":
        torch.export.save(torch.export.export(M(), (x,)), sys.argv[2])
    else:
        from jaxattn.bridge import call_spec
        assert not call_spec._TABLE, "a fresh process holds no specs"
        out = torch.export.load(sys.argv[2]).module()(x)
        ref = (x * -0.0 + 2).sum(1) + (x * 1.5).sum()
        torch.testing.assert_close(out, ref)
        assert len(call_spec._TABLE) == 2  # both calls were decoded from their keys
        print("ok")
""")


@pytest.mark.thorough  # a fresh process importing torch and jax; in-process: the test below
def test_exported_program_runs_in_a_fresh_process(tmp_path):
    """torch.export (like torch.compile's caches) keeps the key in the graph; a process that loads
    it never traced the call, so its table is empty and the key is decoded."""
    script = tmp_path / "export_affine.py"
    script.write_text(_EXPORTER.format(tests=os.path.dirname(__file__)))
    path = str(tmp_path / "affine.pt2")
    for step in ("save", "load"):
        run = subprocess.run([sys.executable, str(script), step, path], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_compiled_graph_runs_after_the_table_is_emptied():
    """A compiled graph holds keys only: forward and backward still find their specs."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda a: affine(a, scale=-0.5, shift=1, dims=(1,)), backend="aot_eager", fullgraph=True)
        x = torch.randn(3, 4, requires_grad=True)
        fn(x).sum().backward()  # compiles, interning the spec while tracing
        x.grad = None
        call_spec.forget_all()
        out = fn(x)
        out.backward(torch.tensor([1.0, -2.0, 3.0]))
    finally:
        torch._dynamo.reset()
    x_ref = x.detach().clone().requires_grad_()
    ref = (x_ref * -0.5 + 1).sum(1)
    ref.backward(torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert call_spec._TABLE  # decoded from the graph's keys
