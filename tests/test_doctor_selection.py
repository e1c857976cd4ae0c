"""`jaxattn doctor` says which implementation and launcher automatic selection picks for a typical
prefill and decoding call, and why; the same choice a real call with those arguments makes."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from jaxattn import bridge, cli
from jaxattn.jax_core import AttentionRegistry
from jaxattn.torch_api import scaled_dot_product_attention
from jaxattn.torch_api import launch as launch_module
from jaxattn.torch_api import sdpa as sdpa_module
from jaxattn.torch_api.explain import explain_sdpa, typical_calls

LINE = re.compile(r"^  (prefill|decode)\s+(.+): (\w+) via the (native Triton launch|XLA bridge)$")


def _doctor_choices() -> dict[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["doctor"]) == 0
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("automatic selection on cpu"))
    choices, current = {}, None
    for line in lines[start + 1:]:
        hit = LINE.match(line)
        if hit:
            current = choices[hit.group(1)] = {"call": hit.group(2), "impl": hit.group(3),
                                               "launcher": hit.group(4), "why": ""}
        elif current is not None and line.startswith(" " * 11):
            current["why"] += " " + line.strip()
    return choices


def _ran(q_shape, k_shape, dtype, causal, monkeypatch) -> tuple[str, bool]:
    """(implementation jax_core selected, whether the native launcher ran) for a real call."""
    picked = []
    select = AttentionRegistry.select.__func__

    def spy(cls, inputs, metadata=None, implementation=None):
        impl = select(cls, inputs, metadata, implementation)
        picked.append(impl.canonical_name())
        return impl

    bridge.clear_cache()  # no executable traced earlier: this call selects afresh
    monkeypatch.setattr(sdpa_module, "_prepared", {})
    monkeypatch.setattr(AttentionRegistry, "select", classmethod(spy))
    q, k, v = (torch.randn(*shape, dtype=dtype) for shape in (q_shape, k_shape, k_shape))
    scaled_dot_product_attention(q, k, v, is_causal=causal)
    (prepared,) = sdpa_module._prepared.values()
    if prepared.native_call is not None:
        return "flash", True  # the native launcher runs the flash kernels, without jax_core's selection
    assert picked, "the XLA path ran without selecting an implementation"
    return picked[-1], False


def test_doctor_names_the_choice_that_a_real_call_makes(monkeypatch):
    choices = _doctor_choices()
    assert set(choices) == {"prefill", "decode"}
    assert "L512 S512 D64 causal float32" in choices["prefill"]["call"]
    assert "L1 S512" in choices["decode"]["call"]
    for label, q_shape, k_shape, dtype, causal in typical_calls("cpu"):
        shown = choices[label]
        assert shown["why"].startswith(" why: ") and len(shown["why"]) > 20
        impl, native = _ran(q_shape, k_shape, dtype, causal, monkeypatch)
        assert shown["impl"] == impl, (label, shown, impl)
        assert shown["launcher"] == ("native Triton launch" if native else "XLA bridge"), (label, shown)
        assert f"{impl} is the first that can run it" in shown["why"]


def test_explanation_follows_a_forced_implementation_and_launcher():
    choice = explain_sdpa((1, 2, 16, 8), (1, 2, 16, 8), torch.float32, "cpu", implementation="vanilla")
    assert (choice.implementation, choice.launcher) == ("vanilla", "xla")
    assert "implementation='vanilla' asked for by name" in choice.reason
    with pytest.raises(ValueError, match=r"implementation='flash' cannot run this call: platform 'cpu'"):
        explain_sdpa((1, 2, 16, 8), (1, 2, 16, 8), torch.float32, "cpu", implementation="flash")
    with pytest.raises(ValueError, match=r"q_shape=\(1, 2, 16\)"):
        explain_sdpa((1, 2, 16), (1, 2, 16, 8), torch.float32, "cpu")


def test_cuda_choices_come_from_the_launchers_rules(monkeypatch):
    # No GPU here: the launcher is told it can launch on CUDA, as on a GPU machine; the rest of the
    # decision (prefer_native's sizes) is the real one.
    monkeypatch.setattr(launch_module, "can_launch", lambda device: True)
    prefill, decode = (explain_sdpa(q, k, d, "cuda", is_causal=c) for _, q, k, d, c in typical_calls("cuda"))
    assert (prefill.implementation, prefill.launcher) == ("flash", "native")
    assert "measured faster" in prefill.reason
    assert (decode.implementation, decode.launcher) == ("flash", "native")
    assert "decoding call with S=512" in decode.reason
