"""Copying and saving modules that hold jaxattn functions, as EMA copies, target networks and
checkpoints do: `copy.deepcopy`, `pickle` and `torch.save`/`torch.load` of a module holding a
`jax_op` that has run, the drop-in, or `F.scaled_dot_product_attention` looked up while the patch
was active. The loaded module must compute what the original did (oracle: torch's SDPA)."""

import copy
import io
import pickle
import subprocess
import sys

import torch
import torch.nn.functional as F

from jaxattn.torch_api import patch_sdpa, scaled_dot_product_attention
from jaxattn.torch_api.patch import TORCH_SDPA
from jaxattn.torch_api.sdpa import _sdpa_jax


class Holder(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.proj = torch.nn.Linear(16, 16)


def _qkv(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 9, 16, generator=gen, dtype=torch.float64) for _ in range(3)]


def _roundtrips(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return [copy.deepcopy(module), pickle.loads(pickle.dumps(module)), torch.load(buf, weights_only=False)]


def test_module_holding_a_jax_op_that_ran_copies_and_saves():
    q, k, v = _qkv()
    kw = dict(is_causal=True, scale=None, dropout_p=0.0, implementation="vanilla", platform="cpu")
    before = _sdpa_jax(q, k, v, None, None, **kw)  # the op now holds executables and JAX devices
    for copied in _roundtrips(Holder(_sdpa_jax)):
        assert copied.fn is _sdpa_jax  # an op is one named function per process
        torch.testing.assert_close(copied.fn(q, k, v, None, None, **kw), before)
    torch.testing.assert_close(before, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_module_holding_the_drop_in_copies_and_saves():
    q, k, v = _qkv(1)
    for copied in _roundtrips(Holder(scaled_dot_product_attention)):
        torch.testing.assert_close(copied.fn(q, k, v, is_causal=True),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_module_that_stored_the_patched_function_saves_and_loads():
    q, k, v = _qkv(2)
    with patch_sdpa(implementation="vanilla"):
        module = Holder(F.scaled_dot_product_attention)
        copies = _roundtrips(module)
        for copied in copies:
            torch.testing.assert_close(copied.fn(q, k, v), TORCH_SDPA(q, k, v))
    for copied in copies:  # without a patch the stored function is torch's again
        torch.testing.assert_close(copied.fn(q, k, v), TORCH_SDPA(q, k, v))


def test_a_pickled_jax_op_loads_in_a_fresh_process(tmp_path):
    """Only torch imported: unpickling imports the module that defines the op."""
    path = tmp_path / "ops.pt"
    torch.save({"fn": _sdpa_jax}, path)
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        f"m = torch.load({str(path)!r}, weights_only=False)\n"
        "assert 'jaxattn.torch_api.sdpa' in sys.modules\n"
        "g = torch.Generator().manual_seed(3)\n"
        "q, k, v = (torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64) for _ in range(3))\n"
        "out = m['fn'](q, k, v, None, None, is_causal=False, scale=None, dropout_p=0.0, implementation='vanilla',"
        " platform='cpu')\n"
        "torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))\n"
        "print('loaded', type(m['fn']).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded JaxOp" in done.stdout
