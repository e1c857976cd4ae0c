"""Running an attention body under `shard_map` over the batch and head axes of a mesh."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .metadata import AttentionMetadata


def _four_d(x: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def run_sharded(
    body: Callable[..., Any],
    metadata: AttentionMetadata,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    softmax_aux: Optional[jax.Array] = None,
    dropout_rng: Optional[jax.Array] = None,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
    with_weights: bool = False,
) -> Any:
    """Calls `body(q, k, v, bias, mask, softmax_aux, dropout_rng, segment_ids, cu_seqlens)`, under
    shard_map if a mesh is set.

    q/k/v are (B, T, H, D) and are split over the batch and head axes of `metadata.partition_axis`;
    bias and mask are made 4-D and split the same way where they are not broadcast; the (B, T) and
    (B, S) segment ids are split over the batch axis; cu_seqlens (and the dropout key) are
    replicated. The body returns the (B, T, Hq, Dv) output, and with `with_weights` also
    (B, Hq, T, S) weights and the (B, Hq, T) LSE.
    """
    bias, mask = _four_d(bias), _four_d(mask)
    args = (query, key, value, bias, mask, softmax_aux, dropout_rng, segment_ids, cu_seqlens)
    if metadata.mesh is None:
        return body(*args)

    qs, ks, vs, _, _, outs = metadata.get_shardings("__train__", BTHD=True)
    batch, head = qs[0], qs[2]
    # Only batch and heads are split here: positions along T and S must stay global.
    qs, ks, vs, outs = (P(batch, None, head, None),) * 4

    def bh_spec(x):
        return None if x is None else P(batch if x.shape[0] != 1 else None, head if x.shape[1] != 1 else None, None, None)

    def sharded_body(q, k, v, bias, mask, aux, rng, seg, cu):
        if rng is not None:
            index = 0
            for axis in metadata.mesh.axis_names:
                index = index * metadata.mesh.shape[axis] + jax.lax.axis_index(axis)
            rng = jax.random.fold_in(rng, index)
        return body(q, k, v, bias, mask, aux, rng, seg, cu)

    in_specs = (
        qs, ks, vs, bh_spec(bias), bh_spec(mask), None if softmax_aux is None else P(head),
        None if dropout_rng is None else P(),
        None if segment_ids is None else (P(batch, None), P(batch, None)),
        None if cu_seqlens is None else (P(), P()),
    )
    out_specs = (outs, P(batch, head, None, None), P(batch, head, None)) if with_weights else outs
    fn = jax.shard_map(sharded_body, mesh=metadata.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return fn(*args)
