"""Bad inputs across the public API: one table of cases, each a bad call and what it must raise.

Every row of `CASES` is a `Case`:
    id:     the test id, "<api>-<what is wrong>";
    call:   a zero-argument callable making one bad call (all bad inputs are built at import);
    error:  the exception type the call must raise;
    match:  a regex the message must match (`re.search`); each one names the argument, its
            offending value and what was expected, the project's "name: got <value>; expected
            <what> (hint)" style.

APIs: `scaled_dot_product_attention` (sdpa-), `flash_attention` (flash-, varlen-),
`decode_attention` (decode-), `ring_attention` on simulated CPU devices (ring-; conftest.py sets
XLA_FLAGS), the bridge (bridge-: `jax_op`, `JaxOp`, `to_jax`) and `sdpa_implementation` /
`KVCache` (select-, kvcache-).

After every bad call the test checks that nothing was left behind: the `sdpa_implementation`
choice and the sequence buckets are unchanged, and a valid call with fresh random inputs (one
shape, so one compilation) still matches torch's math SDPA in float32. Further tests cover NaN/inf
propagation with the finite check off, and a paged KVCache whose failed append must not leak pages.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import Mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.bridge import JaxOp, jax_op, to_jax, to_torch
from jaxattn.torch_api import (
    AttentionInputError,
    KVCache,
    current_implementation,
    current_sequence_buckets,
    decode_attention,
    flash_attention,
    ring_attention,
    scaled_dot_product_attention,
    sdpa_implementation,
    set_finite_check,
)

NAN, INF = float("nan"), float("inf")
#: The valid call's shapes: an awkward L=7, S=9, E=12 with two heads and two sequences.
B, H, L, S, E = 2, 2, 7, 9, 12
_RING = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 simulated CPU devices (conftest.py)")


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded standard normal values (never zeros), cast to `dtype`."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ints(*values: int) -> torch.Tensor:
    """A 1-D int32 tensor."""
    return torch.tensor(values, dtype=torch.int32)


def with_value(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    """A copy of `t` with one element replaced."""
    t = t.clone()
    t[index] = value
    return t


def _mesh(n: int, shape: tuple = None, names: tuple = ("sp",)) -> Mesh:
    """A mesh of the first n simulated CPU devices."""
    return Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape or (n,)), names)


@jax_op(name="tests.test_reliability_bad_inputs.axpy")
def _axpy(x, y, *, alpha):
    return alpha * x + y


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table (see the module docstring); `marks` are pytest marks for the row."""

    id: str
    call: Callable[[], object]
    error: type
    match: str
    marks: tuple = ()


# --- inputs (all built once) -----------------------------------------------------------------------

Q, K, V = randn(B, H, L, E, seed=1), randn(B, H, S, E, seed=2), randn(B, H, S, E, seed=3)
# varlen: 7 packed query rows and 9 key rows, two sequences
PQ, PK, PV = randn(L, H, E, seed=4), randn(S, H, E, seed=5), randn(S, H, E, seed=6)
CU_Q, CU_K = ints(0, 3, 7), ints(0, 4, 9)
# decode: B=2 sequences, Hq=4, Hkv=2, T=1, a 9-slot cache, or 5 pages of 4 slots with a (2, 3) table
DQ = randn(B, 4, 1, E, seed=7)
DK, DV = randn(B, S, 2, E, seed=8), randn(B, S, 2, E, seed=9)
LENS = ints(5, 9)
PAGES_K, PAGES_V = randn(5, 4, 2, E, seed=10), randn(5, 4, 2, E, seed=11)
TABLE = ints(0, 1, 2, 3, 4, 0).view(B, 3)
# ring: one sequence of 8 (or 7) positions
RQ, RK, RV = randn(1, 2, 8, E, seed=12), randn(1, 2, 8, E, seed=13), randn(1, 2, 8, E, seed=14)
R7 = randn(1, 2, 7, E, seed=15)


def sdpa(q=Q, k=K, v=V, **kw):
    """scaled_dot_product_attention with the valid inputs unless replaced."""
    return scaled_dot_product_attention(q, k, v, **kw)


def flash(q=Q, k=K, v=V, **kw):
    """flash_attention, padded layout."""
    return flash_attention(q, k, v, **kw)


def varlen(q=PQ, k=PK, v=PV, cu_q=CU_Q, cu_k=CU_K, **kw):
    """flash_attention, varlen layout: two packed sequences."""
    return flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)


def decode(q=DQ, k=DK, v=DV, lengths=LENS, **kw):
    """decode_attention against the contiguous (B, S_max, Hkv, D) cache."""
    return decode_attention(q, k, v, lengths, **kw)


def paged(lengths=LENS, table=TABLE, **kw):
    """decode_attention against 5 pages of 4 positions."""
    return decode_attention(DQ, PAGES_K, PAGES_V, lengths, block_table=table, **kw)


def ring(q=RQ, k=RK, v=RV, **kw):
    """ring_attention of full tensors over 2 simulated CPU devices unless `mesh` is given."""
    kw.setdefault("mesh", _mesh(2))
    return ring_attention(q, k, v, **kw)


def in_block(choice: str, call: Callable[[], object]) -> Callable[[], object]:
    """`call` made inside `with sdpa_implementation(choice)` (the block must restore the choice)."""

    def run():
        with sdpa_implementation(choice):
            return call()

    return run


def enter(choice) -> None:
    """Enters and leaves an `sdpa_implementation` block."""
    with sdpa_implementation(choice):
        pass


def small_cache() -> KVCache:
    """A fresh, empty contiguous cache: B sequences of up to 8 positions, 2 KV heads."""
    return KVCache.contiguous(B, 8, 2, E)


def ring_case(id: str, call, error, match) -> Case:
    """A row that needs the simulated CPU devices."""
    return Case(id, call, error, match, marks=(_RING,))


# --- the table ----------------------------------------------------------------------------------------

AIE, TE, VE = AttentionInputError, TypeError, ValueError

CASES = [
    # scaled_dot_product_attention: ranks, sizes, GQA
    Case("sdpa-key-rank-1", lambda: sdpa(k=K[0, 0, 0]), AIE,
         r"^key: expected at least 2 dims \(\.\.\., L, E\), got shape \(12,\)"),
    Case("sdpa-value-rank-differs", lambda: sdpa(v=V[0]), AIE,
         r"must have the same number of dims; got shapes \(2, 2, 7, 12\), \(2, 2, 9, 12\), \(2, 9, 12\)"),
    Case("sdpa-batch-mismatch", lambda: sdpa(k=randn(3, H, S, E), v=randn(3, H, S, E)), AIE,
         r"^key: dim 0 is 3 but query's is 2 .*leading dims must match or be 1"),
    Case("sdpa-head-dim-mismatch", lambda: sdpa(k=K[..., :8]), AIE, r"^key: head dim 8 != query head dim 12"),
    Case("sdpa-gqa-without-enable-gqa", lambda: sdpa(q=randn(B, 4, L, E)), AIE,
         r"^key: 2 heads but query has 4 .*pass enable_gqa=True"),
    Case("sdpa-gqa-ratio-not-integral", lambda: sdpa(q=randn(B, 3, L, E), enable_gqa=True), AIE,
         r"^enable_gqa=True: query heads 3 must be a multiple of key/value heads 2"),
    Case("sdpa-empty-head-dim", lambda: sdpa(Q[..., :0], K[..., :0], V), AIE,
         r"^query: is empty \(shape \(2, 2, 7, 0\)\); every dimension must be > 0"),
    # masks
    Case("sdpa-mask-wrong-shape", lambda: sdpa(attn_mask=torch.ones(L, S - 1, dtype=torch.bool)), AIE,
         r"^attn_mask: shape \(7, 8\) does not broadcast to \(N, \.\.\., Hq, L, S\) = \(2, 2, 7, 9\)"),
    Case("sdpa-mask-int-dtype", lambda: sdpa(attn_mask=torch.ones(L, S, dtype=torch.int8)), AIE,
         r"^attn_mask: dtype torch.int8 is neither bool nor the query dtype torch.float32 \(use a bool mask"),
    Case("sdpa-mask-other-device", lambda: sdpa(attn_mask=torch.ones(L, S, dtype=torch.bool, device="meta")), AIE,
         r"^attn_mask: on meta but query is on cpu \(move it with \.to\(query\.device\)\)"),
    # dtypes and devices
    Case("sdpa-int64-inputs", lambda: sdpa(Q.long(), K.long(), V.long()), AIE,
         r"^query: dtype torch.int64 is not a floating type; expected one of float16, bfloat16, float32, float64"),
    Case("sdpa-complex-key", lambda: sdpa(k=K.to(torch.complex64)), AIE,
         r"^key: dtype torch.complex64 is not a floating type; expected one of float16"),
    Case("sdpa-key-other-device", lambda: sdpa(k=K.to("meta")), AIE,
         r"^query, key and value must be on one device; got cpu, meta, cpu \(move them"),
    # options
    Case("sdpa-is-causal-str", lambda: sdpa(is_causal="True"), TE, r"^is_causal='True': expected a bool"),
    Case("sdpa-enable-gqa-int", lambda: sdpa(enable_gqa=1), TE, r"^enable_gqa=1: expected a bool"),
    Case("sdpa-dropout-int-out-of-range", lambda: sdpa(dropout_p=2), AIE,
         r"^dropout_p=2: expected a float in \[0, 1\)"),
    Case("sdpa-scale-list", lambda: sdpa(scale=[0.5]), TE,
         r"^scale=\[0\.5\]: expected None or a finite float, got list"),
    Case("sdpa-scale-minus-inf", lambda: sdpa(scale=-INF), AIE, r"^scale=-inf: expected None or a finite float"),
    Case("sdpa-unknown-implementation", lambda: sdpa(implementation="flash_attn9"), VE,
         r"^implementation='flash_attn9' is not registered; available: \[.*'vanilla'"),
    Case("sdpa-bad-call-inside-block", in_block("vanilla", lambda: sdpa(k=K[..., :8])), AIE,
         r"^key: head dim 8 != query head dim 12"),
    Case("sdpa-inf-in-value", lambda: sdpa(v=with_value(V, (1, 0, 2, 3), -INF)), AIE,
         r"^value: contains NaN or inf values at 1 position\(s\) .*set_finite_check\('off'\)"),
    # flash_attention, padded layout
    Case("flash-rank-3-without-cu-seqlens", lambda: flash(Q[0], K[0], V[0]), AIE,
         r"^q: expected \(B, Hq, L, E\), got shape \(2, 7, 12\)"),
    Case("flash-batch-broadcast", lambda: flash(k=K[:1], v=V[:1]), AIE,
         r"^k: batch 1 != q batch 2 \(q \(2, 2, 7, 12\), k \(1, 2, 9, 12\)\); expected equal batch dims"),
    Case("flash-gqa-ratio-not-integral", lambda: flash(q=randn(B, 3, L, E)), AIE,
         r"^q heads 3 must be a multiple of k/v heads 2"),
    Case("flash-complex-value", lambda: flash(v=V.to(torch.complex64)), AIE,
         r"^v: dtype torch.complex64 is not a floating type"),
    Case("flash-causal-str", lambda: flash(causal="yes"), TE, r"^causal='yes': expected a bool, got str"),
    Case("flash-return-lse-none", lambda: flash(return_lse=None), TE,
         r"^return_lse=None: expected a bool, got NoneType"),
    Case("flash-scale-inf", lambda: flash(scale=INF), AIE, r"^scale=inf: expected None or a finite float"),
    Case("flash-scale-str", lambda: flash(scale="0.3"), TE, r"^scale='0\.3': expected None or a finite float, got str"),
    Case("flash-softcap-nan", lambda: flash(softcap=NAN), AIE,
         r"^softcap=nan: expected a positive finite float or None"),
    Case("flash-window-right-negative", lambda: flash(window=(0, -5)), AIE,
         r"^window=\(0, -5\): expected \(left, right\) ints >= -1"),
    Case("flash-window-bool", lambda: flash(window=(True, 0)), AIE,
         r"^window=\(True, 0\): expected \(left, right\) ints >= -1"),
    Case("flash-sinks-wrong-heads", lambda: flash(sinks=randn(3)), AIE,
         r"^sinks: expected a \(Hq,\) or \(Hq, n\) tensor with Hq=2, got \(3,\)"),
    Case("flash-sinks-other-device", lambda: flash(sinks=randn(2).to("meta")), AIE,
         r"^sinks: expected a float tensor on cpu, got torch.float32 on meta"),
    Case("flash-sinks-nan", lambda: flash(sinks=torch.tensor([0.5, NAN])), AIE,
         r"^sinks: contains NaN values at 1 position\(s\)"),
    Case("flash-nan-in-q", lambda: flash(q=with_value(Q, (0, 1, 6, 0), NAN)), AIE,
         r"^q: contains NaN or inf values at 1 position\(s\)"),
    Case("flash-dropout-nan", lambda: flash(dropout_p=NAN), AIE, r"^dropout_p=nan: expected a float in \[0, 1\)"),
    Case("flash-segment-ids-other-device", lambda: flash(Q, Q, Q, segment_ids=ints(*[0] * L).expand(B, L).to("meta")),
         AIE, r"^segment_ids: segment_ids is on meta but q is on cpu \(move it with \.to\(q\.device\)\)"),
    Case("flash-unknown-implementation", lambda: flash(implementation="nope"), VE,
         r"^implementation='nope' is not registered; available: \["),
    # flash_attention, varlen layout
    Case("varlen-cu-seqlens-decreasing", lambda: varlen(cu_q=ints(0, 5, 3)), AIE,
         r"^cu_seqlens_q: values \[0, 5, 3\] must start at 0 and never decrease"),
    Case("varlen-cu-seqlens-not-from-zero", lambda: varlen(cu_k=ints(2, 4, 9)), AIE,
         r"^cu_seqlens_k: values \[2, 4, 9\] must start at 0 and never decrease"),
    Case("varlen-cu-seqlens-beyond-total", lambda: varlen(cu_k=ints(0, 4, 10)), AIE,
         r"^cu_seqlens_k: last value 10 exceeds the 9 packed rows of k \(shape\[0\]\); "
         r"expected cumulative lengths ending at most at 9"),
    Case("varlen-max-seqlen-below-longest", lambda: varlen(cu_q=ints(0, 5, 7), max_seqlen_q=3), AIE,
         r"^max_seqlen_q=3: the longest sequence in cu_seqlens_q \[0, 5, 7\] is 5 \(> 4, "
         r".*expected None or an int >= 5"),
    Case("varlen-cu-seqlens-other-device", lambda: varlen(cu_q=CU_Q.to("meta")), AIE,
         r"^cu_seqlens_q: on meta but q is on cpu \(move it with \.to\(q\.device\)\)"),
    Case("varlen-cu-seqlens-int16", lambda: varlen(cu_k=CU_K.short()), AIE,
         r"^cu_seqlens_k: expected a 1-D int32 tensor of N \+ 1 >= 2 cumulative lengths, "
         r"got shape \(3,\), dtype torch.int16"),
    # decode_attention
    Case("decode-q-rank-3", lambda: decode(q=DQ[:, :, 0]), AIE,
         r"^q: expected a non-empty 4-D tensor \(B, Hq, T, D\), got shape \(2, 4, 12\)"),
    Case("decode-heads-not-multiple", lambda: decode(q=randn(B, 3, 1, E)), AIE,
         r"^q: 3 heads is not a multiple of the cache's 2 KV heads"),
    Case("decode-int-cache", lambda: decode(k=DK.int()), AIE,
         r"^k_cache: dtype torch.int32 is not a float dtype \(float16, bfloat16, float32, float64\)"),
    Case("decode-empty-cache", lambda: decode(k=DK[:, :0], v=DV[:, :0]), AIE,
         r"^k_cache: expected a non-empty 4-D tensor \(B, S_max, Hkv, D\), got shape \(2, 0, 2, 12\)"),
    Case("decode-cache-other-device", lambda: decode(v=DV.to("meta")), AIE,
         r"^q, k_cache and v_cache must be on one device, got cpu, cpu, meta"),
    Case("decode-cache-seqlens-negative", lambda: decode(lengths=ints(-1, 5)), AIE,
         r"^cache_seqlens: values \[-1, 5\] must lie in \[0, 9\] \(the cache capacity in positions\)"),
    Case("decode-cache-seqlens-list", lambda: decode(lengths=[5, 9]), AIE,
         r"^cache_seqlens: expected an int32 tensor of shape \(B,\) = \(2,\), got a list"),
    Case("decode-cache-starts-other-device", lambda: decode(cache_starts=ints(0, 0).to("meta")), AIE,
         r"^cache_starts: on meta but q is on cpu \(move it with \.to\(q\.device\)\)"),
    Case("decode-paged-seqlens-beyond-pages", lambda: paged(lengths=ints(13, 5)), AIE,
         r"^cache_seqlens: values \[13, 5\] must lie in \[0, 12\]"),
    Case("decode-block-table-beyond-pages", lambda: paged(table=ints(0, 1, 2, 3, 4, 5).view(B, 3)), AIE,
         r"^block_table: entry \[1, 2\] = 5 is not a page of k_cache \(5 pages; 1 bad entries in all\); "
         r"expected page indices in \[0, 4\]"),
    Case("decode-block-table-negative", lambda: paged(table=ints(0, -1, 2, 3, 4, 0).view(B, 3)), AIE,
         r"^block_table: entry \[0, 1\] = -1 is not a page of k_cache .*expected page indices in \[0, 4\]"),
    Case("decode-block-table-float", lambda: paged(table=TABLE.float()), AIE,
         r"^block_table: expected an int32 tensor of shape \(B, max_pages\) = \(2, 3\), "
         r"got shape \(2, 3\), dtype torch.float32"),
    Case("decode-window-negative", lambda: decode(window=-3), AIE, r"^window=-3: expected None or an int >= 0"),
    Case("decode-return-lse-str", lambda: decode(return_lse="no"), TE, r"^return_lse='no': expected a bool"),
    Case("decode-softcap-inf", lambda: decode(softcap=INF), AIE, r"^softcap=inf: expected None or a positive finite float"),
    Case("decode-scale-str", lambda: decode(scale="0.3"), TE, r"^scale='0\.3': expected None or a finite float, got str"),
    Case("decode-nan-in-q", lambda: decode(q=with_value(DQ, (1, 3, 0, 11), NAN)), AIE,
         r"^q: contains NaN or inf values at 1 position\(s\)"),
    Case("decode-sinks-nan", lambda: decode(sinks=torch.tensor([0.0, 1.0, NAN, 2.0])), AIE,
         r"^sinks: contains NaN values at 1 position\(s\)"),
    # ring_attention (simulated CPU devices)
    ring_case("ring-mesh-does-not-divide-sequence", lambda: ring(R7, R7, R7, inputs_in_layout=True), VE,
              r"^inputs_in_layout=True: T=7 and S=7 must be multiples of 2 .*on 2 devices \(pad them"),
    ring_case("ring-shards-unequal", lambda: ring_attention(*[list(R7.split(4, dim=2))] * 3), AIE,
              r"^shard 1: shapes q \(1, 2, 3, 12\), k \(1, 2, 3, 12\) differ from shard 0's q \(1, 2, 4, 12\)"
              r".*must be equal in size"),
    ring_case("ring-shard-count-vs-mesh", lambda: ring(*[list(x.chunk(2, dim=2)) for x in (RQ, RK, RV)], mesh=_mesh(4)),
              AIE, r"^q: 2 shard\(s\) on \['cpu', 'cpu'\], but the ring's devices of this process are \[.*\]; "
              r"pass one shard per device"),
    ring_case("ring-mesh-2d", lambda: ring(mesh=_mesh(4, (2, 2), ("a", "b"))), AIE,
              r"^mesh: expected a 1-D mesh \(one sequence axis\), got axes \('a', 'b'\)"),
    ring_case("ring-mesh-str", lambda: ring(mesh="cpu"), TE,
              r"^mesh='cpu': expected None, a 1-D jax.sharding.Mesh or a list of torch devices"),
    ring_case("ring-mesh-meta-devices", lambda: ring(mesh=["meta", "meta"]), AIE,
              r"^mesh=\['meta', 'meta'\]: expected torch devices such as \['cuda:0', 'cuda:1'\] \(device meta"),
    ring_case("ring-batch-broadcast", lambda: ring(q=torch.cat([RQ, RQ])), AIE,
              r"^k: batch 1 != q batch 2 .*expected equal batch dims"),
    ring_case("ring-key-other-device", lambda: ring(k=RK.to("meta")), AIE,
              r"^q, k and v must be on one device; got cpu, meta, cpu \(move them with \.to\(q\.device\)\)"),
    ring_case("ring-scale-inf", lambda: ring(scale=INF), AIE, r"^scale=inf: expected None or a finite float"),
    ring_case("ring-softcap-inf", lambda: ring(softcap=INF), AIE,
              r"^softcap=inf: expected a positive finite float or None"),
    ring_case("ring-window-negative", lambda: ring(window=(-4, 0)), AIE,
              r"^window=\(-4, 0\): expected \(left, right\) ints >= -1"),
    ring_case("ring-return-lse-str", lambda: ring(return_lse="y"), TE, r"^return_lse='y': expected a bool, got str"),
    ring_case("ring-nan-in-v", lambda: ring(v=with_value(RV, (0, 1, 7, 0), NAN)), AIE,
              r"^v: contains NaN or inf values at 1 position\(s\)"),
    # bridge
    Case("bridge-positional-float", lambda: _axpy(Q, 2.0, alpha=1.0), TE,
         r"^tests\.test_reliability_bad_inputs\.axpy: positional argument 1 is a float; "
         r"positional arguments must be tensors or None"),
    Case("bridge-other-device", lambda: _axpy(Q, Q.to("meta"), alpha=1.0), VE,
         r"axpy: argument 1 is on meta but argument 0 is on cpu; move all tensors to one device"),
    Case("bridge-complex-dtype", lambda: _axpy(Q.to(torch.complex64), Q.to(torch.complex64), alpha=1.0), TE,
         r"^dtype torch.complex64 has no JAX equivalent; supported: \["),
    Case("bridge-list-static", lambda: _axpy(Q, Q, alpha=[1.0]), TE,
         r"axpy: keyword argument alpha=\[1\.0\] is a list; "
         r"expected a static Python constant \(bool, int, float, str, None"),
    Case("bridge-tensor-static", lambda: _axpy(Q, Q, alpha=torch.tensor(2.0)), TE,
         r"axpy: keyword argument alpha=tensor\(2\.\) is a Tensor; "
         r"expected a static Python constant .*pass tensors positionally"),
    Case("bridge-no-tensor", lambda: _axpy(None, None, alpha=1.0), VE,
         r"axpy: at least one positional argument must be a tensor"),
    Case("bridge-num-outputs-bool", lambda: JaxOp(jnp.sin, name=f"{__name__}.sin", num_outputs=True), VE,
         r"^num_outputs=True: expected an int >= 1"),
    Case("bridge-to-jax-meta", lambda: to_jax([Q.to("meta")]), TE,
         r"^device meta: only cpu and cuda tensors can cross into JAX"),
    Case("bridge-to-jax-single-tensor", lambda: to_jax(Q), TE,
         r"^to_jax: tensors must be a list or tuple of torch.Tensor, got a Tensor \(wrap a single one: to_jax\(\[x\]\)\)"),
    Case("bridge-to-jax-ndarray", lambda: to_jax([Q.numpy()]), TE,
         r"^to_jax: tensors\[0\] is a ndarray; expected a torch.Tensor"),
    Case("bridge-to-torch-tensor", lambda: to_torch([Q]), TE,
         r"^to_torch: arrays\[0\] is a Tensor; expected a jax.Array"),
    # sdpa_implementation and KVCache
    Case("select-unknown-name", lambda: enter("fastest"), VE,
         r"^implementation='fastest' is not registered; available: \["),
    Case("select-empty-list", lambda: enter([]), TE,
         r"^implementations=\[\]: expected None, a registered name or a non-empty list of names; registered: \["),
    Case("select-list-with-int", lambda: enter(["vanilla", 1]), TE,
         r"^implementations=\['vanilla', 1\]: expected None"),
    Case("kvcache-zero-batch", lambda: KVCache.contiguous(0, 8, 2, E), AIE, r"^batch=0: expected a positive int"),
    Case("kvcache-rank-3-buffers", lambda: KVCache(DK[0], DV[0]), AIE,
         r"^key, value: expected 4-D tensors \(\(B, S_max, Hkv, D\) or pages \(P, PS, Hkv, D\)\), "
         r"got shape \(9, 2, 12\)"),
    Case("kvcache-buffers-on-two-devices", lambda: KVCache(DK, DV.to("meta")), AIE,
         r"^key \(2, 9, 2, 12\) torch.float32 on cpu and value \(2, 9, 2, 12\) torch.float32 on meta "
         r"must agree on all but the last dim, dtype and device"),
    Case("kvcache-block-table-list", lambda: KVCache(PAGES_K, PAGES_V, block_table=[[0, 1]]), AIE,
         r"^block_table: expected a \(B, max_pages\) int32 tensor on cpu or None, got a list"),
    Case("kvcache-append-beyond-capacity", lambda: small_cache().append(randn(B, 2, 9, E), randn(B, 2, 9, E)), AIE,
         r"^append: 9 new positions would make a sequence 9 long, beyond the capacity 8"),
    Case("kvcache-append-wrong-heads", lambda: small_cache().append(randn(B, 3, 1, E), randn(B, 3, 1, E)), AIE,
         r"^key: expected a torch.float32 tensor of shape \(B, Hkv, T, D\) = \(2, 2, T, 12\) on cpu, "
         r"got \(2, 3, 1, 12\)"),
    Case("kvcache-starts-wrong-length", lambda: small_cache().set_starts([0, 0, 0]), AIE,
         r"^starts: expected shape \(B,\) = \(2,\), got \(3,\)"),
    Case("kvcache-attend-int-query", lambda: small_cache().attend(DQ.int()), AIE,
         r"^q: dtype torch.int32 is not a float dtype"),
]
PARAMS = [pytest.param(c, id=c.id, marks=c.marks) for c in CASES]


# --- the checks -----------------------------------------------------------------------------------


def torch_math_sdpa(q, k, v, **kw) -> torch.Tensor:
    """torch's own SDPA, math backend (the oracle)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def assert_valid_call_matches_torch(seed: int) -> None:
    """A valid call with fresh inputs of the one shared shape agrees with torch's math SDPA."""
    q, k, v = randn(B, H, L, E, seed=seed), randn(B, H, S, E, seed=seed + 1), randn(B, H, S, E, seed=seed + 2)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), torch_math_sdpa(q, k, v), atol=1e-5, rtol=1e-5)


def test_table_is_large_and_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", PARAMS)
def test_bad_input_raises_named_error_and_leaves_no_state(case: Case):
    choice, buckets = current_implementation(), current_sequence_buckets()
    with pytest.raises(case.error, match=case.match):
        case.call()
    assert (current_implementation(), current_sequence_buckets()) == (choice, buckets)
    assert_valid_call_matches_torch(seed=zlib.crc32(case.id.encode()) % 10_000)


# --- NaN and inf ------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_non_finite_query_propagates_like_torch_with_check_off(bad, is_causal):
    q, k, v = randn(B, H, L, E, seed=40), randn(B, H, S, E, seed=41), randn(B, H, S, E, seed=42)
    q = with_value(with_value(q, (0, 1, 3, 5), bad), (1, 0, 6, 0), bad)
    set_finite_check("off")
    try:
        out = scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    finally:
        set_finite_check("cpu")
    want = torch_math_sdpa(q, k, v, is_causal=is_causal)
    assert want.isnan().any()  # the case does exercise propagation
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    torch.testing.assert_close(out[finite], want[finite], atol=1e-5, rtol=1e-5)
    with pytest.raises(AttentionInputError, match=r"^query: contains NaN or inf values at 2 position\(s\)"):
        scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # the default CPU check is back


# --- KVCache state after a failed append -----------------------------------------------------------------


def test_failed_paged_append_takes_no_pages_and_cache_stays_correct():
    cache = KVCache.paged(B, 12, 2, E, page_size=4, num_pages=4)
    keys, values = [randn(B, 2, 4, E, seed=50)], [randn(B, 2, 4, E, seed=51)]
    cache.append(keys[0], values[0])  # one page each, two left
    table = cache.block_table.clone()
    exhausted = r"^append: the page pool \(4 pages\) is exhausted: 5 new positions need 4 more page\(s\), 2 free"
    with pytest.raises(AttentionInputError, match=exhausted):
        cache.append(randn(B, 2, 5, E), randn(B, 2, 5, E))
    assert cache.host_lengths == [4, 4] and torch.equal(cache.block_table, table)
    keys.append(randn(B, 2, 1, E, seed=52))
    values.append(randn(B, 2, 1, E, seed=53))
    cache.append(keys[1], values[1])  # needs exactly the two pages left
    q = randn(B, 4, 1, E, seed=54)
    want = torch_math_sdpa(q, torch.cat(keys, 2), torch.cat(values, 2), enable_gqa=True)
    torch.testing.assert_close(cache.attend(q), want, atol=1e-5, rtol=1e-5)
