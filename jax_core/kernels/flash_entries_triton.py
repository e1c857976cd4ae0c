"""Entry kernels of the flash kernels, in two flavours over one kernel source.

Each entry forwards its arguments to the kernel of `flash_fwd_triton` / `flash_bwd_triton`; the
flavours differ only in which scalars are compile-time constants:

- `*_entry_static`: every scalar is a constexpr (jax-triton specialises nothing else, and the
  constants let Triton fold addressing and vectorise); arrays first, outputs after the inputs
  (jax-triton's convention). One compilation per shape: fine inside a jitted JAX program.
- `*_entry_dynamic`: sizes, strides, windows and the diagonal offset are runtime arguments (Triton
  still specialises ints equal to 1 and multiples of 16), so one compilation serves every length:
  a growing KV cache or a new batch size launches at once. Floats (scale, soft cap, dropout rate),
  switches and tile sizes stay constexpr in both flavours, so both compute the same float values
  in the same order.

`Alibi` (float32 ALiBi slopes) and its batch stride `sab` (0 for one slope per head) are read only
with the ALIBI switch; other calls pass a placeholder that is never read (the switch removes the
ALiBi code at compile time).

Argument names are those of `flash_plan` (`Launch.args`), so a launcher passes the plan's dict as
keywords. Imports only `triton`.
"""

import triton
import triton.language as tl

from .flash_bwd_triton import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel, flash_bwd_preprocess_kernel
from .flash_common_triton import dropout_mask_kernel
from .flash_fwd_triton import flash_fwd_kernel


@triton.jit
def fwd_entry_static(
    Q, K, V, Bias, Mask, Sinks, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, Out, Lse,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sob: tl.constexpr, soh: tl.constexpr, som: tl.constexpr, sod: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
    sab: tl.constexpr, ALIBI: tl.constexpr,
):
    flash_fwd_kernel(
        Q, K, V, Bias, Mask, Sinks, Out, Lse,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sob, soh, som, sod,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, HAS_SINKS, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )



@triton.jit
def fwd_entry_dynamic(
    Q, K, V, Bias, Mask, Sinks, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, Out, Lse,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sbb, sbh, sbm, sbn,
    smb, smh, smm, smn,
    sob, soh, som, sod,
    Hq, Hk, L, S, D, Dv,
    scale: tl.constexpr, softcap: tl.constexpr, window_left, window_right,
    diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb, sth, str_, BLOCK_SKIP: tl.constexpr,
    sab, ALIBI: tl.constexpr,
):
    flash_fwd_kernel(
        Q, K, V, Bias, Mask, Sinks, Out, Lse,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sob, soh, som, sod,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, HAS_SINKS, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )



@triton.jit
def dkdv_entry_static(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, dK, dV,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sdob: tl.constexpr, sdoh: tl.constexpr, sdom: tl.constexpr, sdod: tl.constexpr,
    sdkb: tl.constexpr, sdkh: tl.constexpr, sdkn: tl.constexpr, sdkd: tl.constexpr,
    sdvb: tl.constexpr, sdvh: tl.constexpr, sdvn: tl.constexpr, sdvd: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
    sab: tl.constexpr, ALIBI: tl.constexpr,
):
    flash_bwd_dkdv_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dK, dV,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )



@triton.jit
def dkdv_entry_dynamic(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, dK, dV,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sbb, sbh, sbm, sbn,
    smb, smh, smm, smn,
    sdob, sdoh, sdom, sdod,
    sdkb, sdkh, sdkn, sdkd,
    sdvb, sdvh, sdvn, sdvd,
    Hq, Hk, L, S, D, Dv,
    scale: tl.constexpr, softcap: tl.constexpr, window_left, window_right,
    diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb, sth, str_, BLOCK_SKIP: tl.constexpr,
    sab, ALIBI: tl.constexpr,
):
    flash_bwd_dkdv_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dK, dV,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )



@triton.jit
def dq_entry_static(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, dQ, dS,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sdob: tl.constexpr, sdoh: tl.constexpr, sdom: tl.constexpr, sdod: tl.constexpr,
    sdqb: tl.constexpr, sdqh: tl.constexpr, sdqm: tl.constexpr, sdqd: tl.constexpr,
    sdsb: tl.constexpr, sdsh: tl.constexpr, sdsm: tl.constexpr, sdsn: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    WRITE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
    sab: tl.constexpr, ALIBI: tl.constexpr,
):
    flash_bwd_dq_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dS,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdqb, sdqh, sdqm, sdqd, sdsb, sdsh, sdsm, sdsn,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, WRITE_DS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )



@triton.jit
def dq_entry_dynamic(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, Alibi, dQ, dS,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sbb, sbh, sbm, sbn,
    smb, smh, smm, smn,
    sdob, sdoh, sdom, sdod,
    sdqb, sdqh, sdqm, sdqd,
    sdsb, sdsh, sdsm, sdsn,
    Hq, Hk, L, S, D, Dv,
    scale: tl.constexpr, softcap: tl.constexpr, window_left, window_right,
    diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    WRITE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb, sth, str_, BLOCK_SKIP: tl.constexpr,
    sab, ALIBI: tl.constexpr,
):
    flash_bwd_dq_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dS,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdqb, sdqh, sdqm, sdqd, sdsb, sdsh, sdsm, sdsn,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, WRITE_DS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP, Alibi, sab, ALIBI,
    )


@triton.jit
def delta_entry_static(
    Out, dOut, Delta,
    sob: tl.constexpr, soh: tl.constexpr, som: tl.constexpr, sod: tl.constexpr,
    sdob: tl.constexpr, sdoh: tl.constexpr, sdom: tl.constexpr, sdod: tl.constexpr,
    Hq: tl.constexpr, L: tl.constexpr, Dv: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    flash_bwd_preprocess_kernel(Out, dOut, Delta, sob, soh, som, sod, sdob, sdoh, sdom, sdod, Hq, L, Dv,
                                BLOCK_M, BLOCK_DV)


@triton.jit
def delta_entry_dynamic(
    Out, dOut, Delta, sob, soh, som, sod, sdob, sdoh, sdom, sdod, Hq, L, Dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    flash_bwd_preprocess_kernel(Out, dOut, Delta, sob, soh, som, sod, sdob, sdoh, sdom, sdod, Hq, L, Dv,
                                BLOCK_M, BLOCK_DV)


@triton.jit
def dropout_mask_entry(Seed, Keep, BH: tl.constexpr, L: tl.constexpr, S: tl.constexpr, dropout_p: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    dropout_mask_kernel(Seed, Keep, BH, L, S, dropout_p, BLOCK_M, BLOCK_N)
