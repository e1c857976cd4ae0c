"""What `import jaxattn.torch_api` (and `jaxattn.flash_attn_interface`) loads: not torch._dynamo or
torch._inductor (about 1.3 s), which only torch.compile needs, nor transformers (`register_transformers`
imports it); and the torch.compile route still works with the ops registered late."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from jaxattn.bridge import compile_hints
from jaxattn.bridge.triton_autograd import TritonOp

#: Modules a plain drop-in call does not need, which `import jaxattn.torch_api` must leave unloaded.
DEFERRED = ("torch._dynamo", "torch._inductor", "transformers")


def test_importing_torch_api_leaves_the_compiler_unloaded():
    code = ("import sys, torch, jaxattn.torch_api, jaxattn.flash_attn_interface\n"
            f"print(sorted(m for m in {DEFERRED!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"imported eagerly: {done.stdout.strip()}"


def test_constant_mark_is_the_one_torch_sets():
    def marked_by_torch():
        return 1

    torch._dynamo.assume_constant_result(marked_by_torch)
    assert vars(marked_by_torch) == {compile_hints.MARK: True}


@dataclasses.dataclass(frozen=True)
class _Scale:
    factor: float
    num_inputs: int = 1


def test_triton_op_registers_on_the_first_compiled_call():
    # Plain torch bodies: the registration and the compiled route are what is tested, not kernels.
    op = TritonOp("jaxattn_test::scale", lambda spec, x: (x * spec.factor,),
                  lambda spec, inputs, outputs, grads, needs: [grads[0] * spec.factor],
                  num_outputs=1, spec_types=[_Scale])
    assert not hasattr(torch.ops.jaxattn_test, "scale")
    compiled = torch.compile(lambda x: op(_Scale(3.0), x)[0] + 1, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    assert hasattr(torch.ops.jaxattn_test, "scale")
    torch.testing.assert_close(y, x.detach() * 3 + 1)
    torch.testing.assert_close(x.grad, torch.full((4,), 3.0))
