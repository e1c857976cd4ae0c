"""The compiled-program extension's autograd wiring, on CPU (its launches are tested on CUDA in
test_gpu_native.py). A program without launches that returns its input and takes its gradient as
the input's gradient is the identity: its output and gradients must be exactly torch's identity's,
and a second-order backward must raise."""

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

from jaxattn.bridge import triton_program

pytestmark = [
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="needs a C++ compiler to build the extension"),
    pytest.mark.thorough,  # building the extension takes most of a minute on 2 cores
]


@pytest.fixture(scope="module")
def identity():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(triton_program.ENV_SWITCH, "1")
        assert triton_program.wait(900), triton_program.build_error()
        return _register_identity()


def _register_identity():
    layout = ((3, 5), (5, 1), torch.float32)
    pid = triton_program.register(
        num_inputs=2, forward_allocs=[], forward_launches=[], outputs=[0], saved=[], grad_layouts=[layout],
        backward_allocs=[], backward_launches=[], grads=[0, -1], second_order_error="identity: no second order")
    assert pid is not None
    return pid


def test_gradient_flows_to_the_inputs_that_have_one(identity):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen, requires_grad=True)
    y = torch.randn(3, 5, generator=gen, requires_grad=True)
    (out,) = triton_program.apply(identity, [x, y])
    assert torch.equal(out, x) and out.grad_fn is not None
    cot = torch.randn(3, 5, generator=gen)
    (out * cot).sum().backward()
    assert torch.equal(x.grad, cot)
    assert y.grad is None


def test_other_gradient_layouts_are_read_in_the_planned_one(identity):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=gen, requires_grad=True)
    (out,) = triton_program.apply(identity, [x, x.detach()])
    cot = torch.randn(5, 3, generator=gen).t()  # strides (1, 3): copied into (5, 1)
    out.backward(cot)
    assert torch.equal(x.grad, cot)


def test_second_order_raises(identity):
    x = torch.randn(3, 5, requires_grad=True)
    (out,) = triton_program.apply(identity, [x, x.detach()])
    with pytest.raises(NotImplementedError, match="identity: no second order"):
        torch.autograd.grad(out.square().sum(), [x], create_graph=True)


def test_no_graph_without_grad(identity):
    x = torch.randn(3, 5, requires_grad=True)
    with torch.no_grad():
        (out,) = triton_program.apply(identity, [x, x.detach()])
    assert out.grad_fn is None and not out.requires_grad


def test_forward_only_records_no_graph_even_in_grad_mode(identity, monkeypatch):
    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    # A program whose output is a forward allocation (no launches: its values are not read).
    alloc = ((2, 3), (1, 2), torch.float64)
    pid = triton_program.register(
        num_inputs=2, forward_allocs=[alloc], forward_launches=[], outputs=[2], saved=[], grad_layouts=[alloc],
        backward_allocs=[], backward_launches=[], grads=[-1, -1], second_order_error="no second order")
    x = torch.randn(3, 5, requires_grad=True)
    (out,) = triton_program.forward_only(pid, [x, x.detach()])
    assert out.shape == (2, 3) and out.stride() == (1, 2) and out.dtype == torch.float64
    assert out.grad_fn is None and not out.requires_grad
    (recorded,) = triton_program.apply(pid, [x, x.detach()])
    assert recorded.grad_fn is not None


def test_unknown_program_raises(identity):
    x = torch.randn(3, 5)
    for bad in (-1, 10**6, None):
        with pytest.raises(ValueError, match="unknown program"):
            triton_program.forward_only(bad, [x, x])
        with pytest.raises(ValueError, match="unknown program"):
            triton_program.apply(bad, [x, x])
    with pytest.raises(ValueError, match="takes 2 tensors, got 3"):
        triton_program.apply(identity, [x, x, x])


def test_errors_inside_the_extension_are_raised_as_python_exceptions(identity, monkeypatch):
    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    huge = ((2 ** 50,), (1,), torch.float32)  # no machine has 4 PiB: the allocation fails inside C++
    pid = triton_program.register(
        num_inputs=1, forward_allocs=[huge], forward_launches=[], outputs=[1], saved=[], grad_layouts=[],
        backward_allocs=[], backward_launches=[], grads=[-1], second_order_error="-")
    x = torch.randn(3)
    for run in (triton_program.forward_only, triton_program.apply):
        with pytest.raises(RuntimeError, match="triton_program: .*memory"):
            run(pid, [x])
    (out,) = triton_program.forward_only(identity, [x, x])  # the extension still works afterwards
    assert torch.equal(out, x)


def test_registration_stops_at_the_cap(identity, monkeypatch):
    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    args = dict(num_inputs=2, forward_allocs=[], forward_launches=[], outputs=[0], saved=[], grad_layouts=[],
                backward_allocs=[], backward_launches=[], grads=[-1, -1], second_order_error="-")
    monkeypatch.setattr(triton_program, "MAX_PROGRAMS", len(triton_program._inputs) + 1)
    assert triton_program.register(**args) is not None
    assert triton_program.register(**args) is None  # a caller then keeps its Python launch path


_HOST_PROGRAM = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))


def _host_program(calls: list, body):
    """A host program as the extension calls one: (function, stream, pointers); `body(pointers)` gets
    float32 views of 15 elements at each pointer."""

    def entry(function, stream, pointers):
        views = [torch.frombuffer((ctypes.c_float * 15).from_address(pointers[i]), dtype=torch.float32)
                 for i in range(len(calls[0]))]
        calls.append((function, stream))
        body(views)

    return _HOST_PROGRAM(entry)


def test_host_program_launches_get_their_buffers_in_order(identity, monkeypatch):
    """A program of host-program launches (the Mosaic GPU kernels' kind), on CPU tensors: the forward
    computes out = 2 x + y into an allocation, the backward writes dx = 2 g and dy = g into two, each
    host program gets its handle, no stream off CUDA, and the pointers of the buffers it lists."""
    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    seen: list = [[0, 1, 2]]  # seen[0]: how many pointers the programs read (forward: x, y, out)

    def forward(p):
        p[2].copy_(2 * p[0] + p[1])

    def backward(p):
        p[1].copy_(2 * p[0])
        p[2].copy_(p[0])

    entries = [_host_program(seen, forward), _host_program(seen, backward)]
    addresses = [ctypes.cast(e, ctypes.c_void_p).value for e in entries]
    layout = ((3, 5), (5, 1), torch.float32)
    pid = triton_program.register(
        num_inputs=2, forward_allocs=[layout],
        forward_launches=[(triton_program.HostProgramLaunch(addresses[0], 11), [0, 1, 2])], outputs=[2],
        saved=[], grad_layouts=[layout], backward_allocs=[layout, layout],
        backward_launches=[(triton_program.HostProgramLaunch(addresses[1], 22), [0, 1, 2])], grads=[1, 2],
        second_order_error="-")
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x, y = (torch.randn(3, 5, generator=gen, requires_grad=True) for _ in range(2))
    (out,) = triton_program.apply(pid, [x, y])
    assert torch.equal(out, 2 * x.detach() + y.detach())
    cot = torch.randn(3, 5, generator=gen)
    out.backward(cot)
    assert torch.equal(x.grad, 2 * cot) and torch.equal(y.grad, cot)
    assert seen[1:] == [(11, None), (22, None)]
    entries.clear()


def test_a_lock_file_left_by_a_killed_build_does_not_stall_the_next_one(identity):
    # torch's lock file, as a builder killed mid-build leaves it: a fresh process must still load the
    # extension (without the stale-lock removal it waits on the file for ever and wait() gives up).
    lock = os.path.join(triton_program.build_directory(), "lock")
    open(lock, "w").close()
    code = "import sys; from jaxattn.bridge import triton_program as t; sys.exit(0 if t.wait(180) else 1)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, triton_program.ENV_SWITCH: "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not os.path.exists(lock)
