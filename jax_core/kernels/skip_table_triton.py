"""The flash kernels' block-skip table, written by a Triton kernel that both launchers launch.

The flash kernels skip (query block x key block) tiles that a bool mask or a -inf bias masks
entirely; they read, per row of their grid, which blocks of their loop are live. This module holds
the kernel writing that table and the plain-Python plan of its launch (grid, warps and every scalar
argument by name, over ints only), so the JAX launcher (jax-triton, every scalar a constexpr:
`skip_table_entry_static`) and the torch launcher (sizes and strides as runtime arguments, one
compilation for every length: `skip_table_entry_dynamic`) launch it identically. Imports only
`triton`.

Shape legend: B batch, H heads, L query length, S key length (of the logits); a mask or bias is
(B|1, H|1, L|1, S|1), described by its 4 element strides in that order, stride 0 on size-1
(broadcast) dims. BLOCK_M / BLOCK_N are the flash kernel's query / key tiles.

Table (int32, contiguous, (B|1, H|1, R, 2 * C + 1)): along "k" (forward and dQ kernels) a row is a
query block and the loop runs over key blocks, R = cdiv(L, BLOCK_M), C = cdiv(S, BLOCK_N); along
"q" (dK/dV kernel) the tile grid is transposed, R = cdiv(S, BLOCK_N), C = cdiv(L, BLOCK_M). Per
row: C + 1 prefix counts of live blocks (entry c = live blocks before block c), then the C block
indices, the live ones first in ascending order, then the dead ones in ascending order. A tile is
live when some element of it inside [0, L) x [0, S) has mask != 0 and bias != -inf (NaN counts as
visible; only the given inputs take part).
"""

import triton
import triton.language as tl

_SUB = 64  # largest sub-tile side loaded at once: bounds the registers a tile scan needs
_CHUNK = 128  # block indices placed per vector step of the ordering pass


@triton.jit
def _tile_live(mask_ptr, bias_ptr, q0, k0, L, S, smm, smn, sbm, sbn,
               HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
               SUB_M: tl.constexpr, SUB_N: tl.constexpr):
    """1 if some element of the TILE_M x TILE_N tile at (q0, k0) is visible, else 0 (int32 scalar).

    mask_ptr / bias_ptr already point at this (b, h) slice; the tile is scanned SUB_M x SUB_N at a
    time and reduced once at the end.
    """
    seen = tl.zeros((SUB_M, SUB_N), tl.int32)
    for dm in tl.static_range(0, TILE_M, SUB_M):
        for dn in tl.static_range(0, TILE_N, SUB_N):
            rows = (q0 + dm + tl.arange(0, SUB_M)).to(tl.int64)[:, None]
            cols = (k0 + dn + tl.arange(0, SUB_N)).to(tl.int64)[None, :]
            vis = (rows < L) & (cols < S)
            if HAS_MASK:
                m = tl.load(mask_ptr + rows * smm + cols * smn, mask=vis, other=0)
                vis = vis & (m != 0)
            if HAS_BIAS:
                x = tl.load(bias_ptr + rows * sbm + cols * sbn, mask=vis, other=0.0)
                vis = vis & (x != float("-inf"))  # NaN != -inf: a NaN bias stays visible
            seen = tl.maximum(seen, vis.to(tl.int32))
    return tl.max(tl.max(seen, axis=1), axis=0)


@triton.jit
def _skip_table_body(Mask, Bias, Table, H, L, S, smb, smh, smm, smn, sbb, sbh, sbm, sbn,
                     HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, ALONG_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
                     SUB_M: tl.constexpr, SUB_N: tl.constexpr, CHUNK: tl.constexpr):
    """Writes one row of the table. Grid (R, B|1 * H|1): program (row, b * H + h).

    Pass 1 scans the row's C tiles in order, keeping the live count in a register and storing the
    prefix counts. Pass 2 places every block index at once from those counts: live block c goes to
    counts[c], dead block c after all live ones at total + (c - counts[c]). Reading the counts back
    needs the row's stores visible to every thread of the program, hence the barrier.
    """
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    mask_ptr = Mask + b * smb + h * smh
    bias_ptr = Bias + b * sbb + h * sbh
    if ALONG_Q:
        R = tl.cdiv(S, BLOCK_N)
        C = tl.cdiv(L, BLOCK_M)
    else:
        R = tl.cdiv(L, BLOCK_M)
        C = tl.cdiv(S, BLOCK_N)
    out = Table + (bh.to(tl.int64) * R + row) * (2 * C + 1)

    tl.store(out, 0)
    n = 0
    for c in range(0, C):
        if ALONG_Q:
            q0 = c * BLOCK_M
            k0 = row * BLOCK_N
        else:
            q0 = row * BLOCK_M
            k0 = c * BLOCK_N
        n += _tile_live(mask_ptr, bias_ptr, q0, k0, L, S, smm, smn, sbm, sbn,
                        HAS_MASK, HAS_BIAS, TILE_M, TILE_N, SUB_M, SUB_N)
        tl.store(out + 1 + c, n)

    tl.debug_barrier()
    for c0 in range(0, C, CHUNK):
        cs = c0 + tl.arange(0, CHUNK)
        inside = cs < C
        before = tl.load(out + cs, mask=inside, other=0)
        after = tl.load(out + 1 + cs, mask=inside, other=0)
        pos = tl.where(after > before, before, n + cs - before)
        tl.store(out + 1 + C + pos, cs, mask=inside)


@triton.jit
def skip_table_entry_static(
    Mask, Bias, Table,
    H: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, ALONG_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    SUB_M: tl.constexpr, SUB_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """The table kernel with every scalar a constexpr (jax-triton specialises nothing else)."""
    _skip_table_body(Mask, Bias, Table, H, L, S, smb, smh, smm, smn, sbb, sbh, sbm, sbn,
                     HAS_MASK, HAS_BIAS, ALONG_Q, BLOCK_M, BLOCK_N, TILE_M, TILE_N, SUB_M, SUB_N, CHUNK)


@triton.jit
def skip_table_entry_dynamic(
    Mask, Bias, Table,
    H, L, S,
    smb, smh, smm, smn,
    sbb, sbh, sbm, sbn,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, ALONG_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    SUB_M: tl.constexpr, SUB_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """The table kernel with sizes and strides as runtime arguments (one compilation for all lengths)."""
    _skip_table_body(Mask, Bias, Table, H, L, S, smb, smh, smm, smn, sbb, sbh, sbm, sbn,
                     HAS_MASK, HAS_BIAS, ALONG_Q, BLOCK_M, BLOCK_N, TILE_M, TILE_N, SUB_M, SUB_N, CHUNK)


# ------------------------------------------------------------------------------------------- plans


def _blocks(l: int, s: int, block_m: int, block_n: int, along: str) -> tuple[int, int]:
    """(R, C): blocks of the grid's axis and of the loop's axis."""
    if along not in ("k", "q"):
        raise ValueError(f"along must be 'k' or 'q', got {along!r}")
    qb, kb = triton.cdiv(l, block_m), triton.cdiv(s, block_n)
    return (kb, qb) if along == "q" else (qb, kb)


def skip_table_shape(b: int, h: int, l: int, s: int, block_m: int, block_n: int,
                     along: str) -> tuple[int, int, int, int]:
    """Shape (b, h, R, 2 * C + 1) of the int32 table; b, h are the table's B|1 and H|1."""
    rows, cols = _blocks(l, s, block_m, block_n, along)
    return (b, h, rows, 2 * cols + 1)


def broadcast_strides(shape: tuple[int, ...], strides: tuple[int, ...] = None) -> tuple[int, int, int, int]:
    """Element strides of a (B|1, H|1, L|1, S|1) mask or bias, 0 on its size-1 dims.

    strides: its element strides, or None for a contiguous (row-major) array.
    """
    if len(shape) != 4:
        raise ValueError(f"mask / bias must be 4-d (B|1, H|1, L|1, S|1), got shape {tuple(shape)}")
    if strides is None:
        strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    return tuple(0 if n == 1 else int(st) for n, st in zip(shape, strides))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def skip_table_launch(b: int, h: int, l: int, s: int, block_m: int, block_n: int, along: str,
                      mask_strides: tuple[int, int, int, int] = None,
                      bias_strides: tuple[int, int, int, int] = None) -> tuple[tuple[int, int], int, dict]:
    """Everything a launch of either entry needs except its buffers.

    Args:
        b, h: the table's B|1 and H|1 (the broadcast of the mask's and the bias's).
        l, s: query and key lengths of the logits.
        block_m, block_n: the flash kernel's tiles (powers of 2).
        along: "k" (forward, dQ) or "q" (dK/dV).
        mask_strides, bias_strides: the int8 mask's / float bias's (B, H, L, S) element strides, 0 on
            broadcast dims (`broadcast_strides`); None when absent (pass a 1-element placeholder).

    Returns:
        (grid, num_warps, args): launch `entry[grid](mask, bias, table, **args, num_warps=...)` or
        `triton_call(mask, bias, kernel=entry, grid=grid, num_warps=..., **args)`; args holds only
        ints and bools, named as the entries' parameters.
    """
    if not (_is_pow2(block_m) and _is_pow2(block_n)):
        raise ValueError(f"block sizes must be powers of 2, got ({block_m}, {block_n})")
    rows, _ = _blocks(l, s, block_m, block_n, along)
    given = [st for st in (mask_strides, bias_strides) if st is not None]
    # Along a dim every input broadcasts, all rows (keys) of a tile are equal: scan only the first.
    tile_m = 1 if all(st[2] == 0 for st in given) else block_m
    tile_n = 1 if all(st[3] == 0 for st in given) else block_n
    sub_m, sub_n = min(tile_m, _SUB), min(tile_n, _SUB)
    zeros = (0, 0, 0, 0)
    smb, smh, smm, smn = mask_strides or zeros
    sbb, sbh, sbm, sbn = bias_strides or zeros
    args = dict(
        H=h, L=l, S=s, smb=smb, smh=smh, smm=smm, smn=smn, sbb=sbb, sbh=sbh, sbm=sbm, sbn=sbn,
        HAS_MASK=mask_strides is not None, HAS_BIAS=bias_strides is not None, ALONG_Q=along == "q",
        BLOCK_M=block_m, BLOCK_N=block_n, TILE_M=tile_m, TILE_N=tile_n, SUB_M=sub_m, SUB_N=sub_n,
        CHUNK=_CHUNK,
    )
    num_warps = 4 if sub_m * sub_n >= 2048 else 2
    return (rows, b * h), num_warps, args
