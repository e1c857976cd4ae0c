"""Rotary position embedding of (B, T, H, D) tensors at per-sequence positions, in torch.

cos / sin are tables (S_rot, R / 2) (R = rotary_dim <= D, even): row p holds cos(p * f_i) and
sin(p * f_i) for the R / 2 frequencies f_i. The first R dims of each head are rotated, the rest
pass through unchanged. Two pairings of those R dims:

    interleaved (GPT-J):     pairs (x[2i], x[2i + 1])
    not interleaved (NeoX):  pairs (x[i], x[i + R / 2])

each pair (a, b) -> (a cos - b sin, a sin + b cos). The products run in float32 (float64 for
float64 inputs) and the result is cast back to the input's dtype.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 interleaved: bool) -> torch.Tensor:
    """x (B, T, H, D) rotated at `positions` (B, T) (int, rows of cos / sin); a new tensor.

    Inputs are assumed validated (`kvcache_call`): positions within the tables' rows.
    """
    half = cos.shape[1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    index = positions.long()
    c = cos.to(work)[index][:, :, None, :]  # (B, T, 1, R/2): one angle per position, shared by heads
    s = sin.to(work)[index][:, :, None, :]
    rot = x[..., : 2 * half].to(work)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)
