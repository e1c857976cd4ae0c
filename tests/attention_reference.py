"""A plain-torch attention reference with the flash features (shared by several test files)."""

import torch


def reference(q, k, v, *, causal=False, alignment="top_left", window=None, softcap=None, sinks=None, scale=None,
              bias=None, mask=None, dtype=torch.float64):
    """Attention with the flash features computed by plain torch ops in `dtype` (float64: the oracle;
    a low precision: torch's same-dtype error for the 2x rule); returns (out, lse)."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(hq // hk, dim=1) for x in (k, v))
    l, s = q.shape[2], k.shape[2]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    logits = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    pos = torch.arange(l, device=q.device)[:, None] + (s - l if alignment == "bottom_right" else 0)
    key = torch.arange(s, device=q.device)[None, :]
    visible = torch.ones(l, s, dtype=torch.bool, device=q.device)
    if causal:
        visible &= key <= pos
    if window is not None:
        if window[0] >= 0:
            visible &= key >= pos - window[0]
        if window[1] >= 0:
            visible &= key <= pos + window[1]
    visible = visible.to(q.device)
    if bias is not None:
        logits = logits + bias.to(dtype)
    if mask is not None:
        visible = visible & mask
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, hq, 1, -1).expand(q.shape[0], hq, l, -1)
        full = torch.cat([logits, sink], dim=-1)
    else:
        full = logits
    lse = torch.logsumexp(full, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return probs @ v, lse


def assert_close_finite(name, got, want, tol=2e-4):
    """`got` has the non-finite pattern of `want` and, elsewhere, a max error <= tol * max(1, |want|)."""
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite pattern differs"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= tol * max(1.0, want[finite].abs().max().item()), f"{name}: max error {err}"
