"""The Hopper flash kernels under torch.compile: the `jaxattn::hopper_flash` custom ops (`bridge.mosaic_op`)
with the kernels interpreted on the CPU (Mosaic GPU's interpret mode, `hopper_interpreted.py`).

Values and gradients of a compiled call against the float64 reference (the 2x same-dtype rule), no
graph break, the native launcher choosing the op under compile by `hopper_reasons`, `opcheck` of the
ops, the tag that keeps them out of CUDA graphs, and eager calls keeping their autograd.Function.
On an sm90 GPU `test_gpu_hopper.py` runs the compiled kernels.
"""

import pytest

torch = pytest.importorskip("torch")

from attention_reference import assert_dtype_rule, reference, reference_grads  # noqa: E402
from hopper_interpreted import InterpretedKernel, use_interpreted_kernels  # noqa: E402
from mosaic_gpu_mode import MODE, fresh_interpreter, pytestmark  # noqa: E402,F401

from jaxattn.jax_core.kernels.flash_plan import FlashConfig  # noqa: E402
from jaxattn.torch_api import hopper_flash, scaled_dot_product_attention, sdpa_launcher  # noqa: E402

if MODE != "interpret":
    pytest.skip("runs the kernels in Mosaic GPU's interpret mode (a CPU backend)", allow_module_level=True)


@pytest.fixture
def launches(monkeypatch) -> list:
    """The interpreted kernels in place of the Mosaic ones; the list gets "forward" / "backward" per launch."""
    use_interpreted_kernels(monkeypatch)
    taken = []
    real = InterpretedKernel.launch
    monkeypatch.setattr(InterpretedKernel, "launch", lambda self, t, s: taken.append(self.which) or real(self, t, s))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Compile afresh: the on-disk caches would replay graphs traced from another version of the ops.
    with torch.compiler.config.patch(force_disable_caches=True):
        yield taken
    torch._dynamo.reset()


def _inputs(b, hq, hk, l, s, memory="BHLD", d=128):
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))

    def tensor(h, t):
        x = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
        return x if memory == "BHLD" else x.transpose(1, 2).contiguous().transpose(1, 2)
    return tensor(hq, l), tensor(hk, s), tensor(hk, s), tensor(hq, l)


def _assert_against_oracle(out, grads, q, k, v, do, dtype, **rkw):
    exact = [x.to(dtype).double() for x in (q, k, v, do)]
    want, _, (dq, dk, dv, _, _) = reference_grads(*exact[:3], exact[3], **rkw)
    leaves = [x.to(dtype).requires_grad_(True) for x in exact[:3]]
    low, _ = reference(*leaves, dtype=dtype, **rkw)
    low_grads = torch.autograd.grad((low * do.to(dtype)).sum(), leaves)
    assert_dtype_rule("out", out.double(), want, low.double(), floor=1e-3)
    for name, got, ref, theirs in zip(("dq", "dk", "dv"), grads, (dq, dk, dv), low_grads):
        assert_dtype_rule(name, got.double(), ref, theirs.double(), floor=4e-3)


@pytest.mark.parametrize("b, hq, hk, l, s, kw, memory", [
    # GQA, edge lengths, bottom-right causal with a soft cap, (B, H, T, D) memory
    pytest.param(1, 4, 2, 97, 130, dict(causal=True, softcap=5.0, bottom_right=True), "BHLD", id="gqa-causal-br-softcap"),
    # L > S, a two-sided window, (B, T, H, D) memory seen transposed
    pytest.param(1, 2, 2, 130, 97, dict(window=(20, 10)), "BLHD", id="window-transposed"),
])
def test_compiled_hopper_flash_against_float64_oracle(launches, monkeypatch, b, hq, hk, l, s, kw, memory):
    """torch.compile(fullgraph=True) over `hopper_flash` with gradients: one graph with the custom ops
    (not the eager autograd.Function), out, dq, dk, dv within the 2x rule of the float64 reference."""
    monkeypatch.setattr(hopper_flash, "_HopperFunction", None)  # the compiled route must not need it
    q, k, v, do = _inputs(b, hq, hk, l, s, memory)
    dtype, d = torch.float16, q.shape[-1]
    scale = 0.8 / d ** 0.5
    cfg = FlashConfig(scale=scale, causal=kw.get("causal", False), diag_offset=s - l if kw.get("bottom_right") else 0,
                      window=kw.get("window") or (-1, -1), softcap=kw.get("softcap"))
    compiled = torch.compile(lambda q, k, v: hopper_flash.hopper_flash(q, k, v, cfg, True), fullgraph=True)
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]  # .to keeps the memory layout
    out = compiled(*leaves)
    grads = torch.autograd.grad((out * do.to(dtype)).sum(), leaves)
    assert launches == ["forward", "backward"], launches
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _assert_against_oracle(out, grads, q, k, v, do, dtype, causal=cfg.causal, scale=scale, window=kw.get("window"),
                           alignment="bottom_right" if kw.get("bottom_right") else "top_left", softcap=cfg.softcap)


def test_native_launcher_chooses_the_hopper_op_under_compile(launches, monkeypatch):
    """The drop-in under torch.compile(fullgraph=True) hands a call `hopper_reasons` accepts to the
    Hopper op (told here that Mosaic GPU can run, with shorter minimum lengths), and with deterministic
    algorithms on keeps it on the Triton kernels, as eager calls do."""
    monkeypatch.setattr(hopper_flash, "mosaic_reasons", lambda device: [])
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "train", 64)
    monkeypatch.setitem(hopper_flash.HOPPER_MIN_LENGTH, "forward", 64)
    q, k, v, do = _inputs(1, 4, 2, 97, 130)
    dtype = torch.bfloat16
    compiled = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                             fullgraph=True)
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
    with sdpa_launcher("native"):
        out = compiled(*leaves)
    grads = torch.autograd.grad((out * do.to(dtype)).sum(), leaves)
    assert launches == ["forward", "backward"], launches
    _assert_against_oracle(out, grads, q, k, v, do, dtype, causal=True, scale=q.shape[-1] ** -0.5)

    # Deterministic algorithms on: the graph holds the Triton op instead (Dynamo guards on the mode).
    graphs = []
    recorded = torch.compile(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                             fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad(), sdpa_launcher("native"):
            recorded(*(x.detach() for x in leaves))
    finally:
        torch.use_deterministic_algorithms(False)
    ops = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert "jaxattn.native_flash.default" in ops and "jaxattn.hopper_flash.default" not in ops, ops


def test_dynamic_shapes_specialise_the_op(launches):
    """torch.compile(dynamic=True): the op's fake implementation specialises symbolic sizes (a Mosaic
    kernel is compiled per shape), so each new length compiles a graph of its own and runs correctly."""
    cfg = FlashConfig(scale=0.1, causal=True)
    compiled = torch.compile(lambda q, k, v: hopper_flash.hopper_flash(q, k, v, cfg, False), fullgraph=True,
                             dynamic=True, backend="aot_eager")
    for l, s in ((97, 130), (65, 200)):
        q, k, v, _ = (x.to(torch.float16) for x in _inputs(1, 2, 1, l, s))
        out = compiled(q, k, v)
        want, _ = reference(q.double(), k.double(), v.double(), causal=True, scale=0.1)
        low, _ = reference(q, k, v, causal=True, scale=0.1, dtype=torch.float16)
        assert_dtype_rule("out", out.double(), want, low.double(), floor=1e-3)
    assert launches == ["forward", "forward"], launches


def test_ops_pass_opcheck(launches):
    """`torch.library.opcheck` of both ops: schema, autograd registration, fake tensors against real
    runs (shapes, dtypes and strides of the padded, folded and transposed results) and AOT dispatch.
    All four checks apply: the real implementation runs the interpreted kernels on CPU tensors."""
    q, k, v, do = (x.to(torch.float16) for x in _inputs(1, 4, 2, 97, 130, "BLHD"))
    cfg = FlashConfig(scale=0.1, causal=True, diag_offset=33)
    spec = hopper_flash._OP.codec.encode(cfg)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch.library.opcheck(torch.ops.jaxattn.hopper_flash.default, (leaves, spec))
    out, lse = torch.ops.jaxattn.hopper_flash.default([q, k, v], spec)
    assert out.stride() == hopper_flash.hopper_forward(q, k, v, cfg)[0].stride()
    torch.library.opcheck(torch.ops.jaxattn.hopper_flash_backward.default, ([q, k, v], [out, lse], [do], spec))


def test_ops_are_left_out_of_cuda_graphs():
    """A first launch loads a kernel's module, which CUDA graph capture forbids: the ops carry the tag
    that makes torch.compile(mode="reduce-overhead") leave them out of its graphs."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    for op in (torch.ops.jaxattn.hopper_flash.default, torch.ops.jaxattn.hopper_flash_backward.default):
        node = torch.fx.Graph().call_function(op, ([], ""))
        assert is_cudagraph_unsafe_fx_node(node), op


def test_eager_calls_keep_the_autograd_function(launches, monkeypatch):
    """Eager calls take the short host path: the autograd.Function with gradients, the forward alone
    without; the custom op is for compiled calls only."""
    monkeypatch.setattr(hopper_flash, "_OP", None)
    q, k, v, do = (x.to(torch.float16) for x in _inputs(1, 2, 2, 64, 64))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    cfg = FlashConfig(scale=0.1)
    out = hopper_flash.hopper_flash(*leaves, cfg, True)
    assert type(out.grad_fn).__name__ == "_HopperFunctionBackward"
    out.backward(do)
    with torch.no_grad():
        assert hopper_flash.hopper_flash(q, k, v, cfg, False).grad_fn is None
    assert launches == ["forward", "backward", "forward"], launches
