"""`KVCache`: keys and values in torch-owned memory, appended in place, for `decode_attention`.

    >>> cache = KVCache.contiguous(batch=4, max_len=2048, kv_heads=8, head_dim=128,
    ...                            dtype=torch.bfloat16, device="cuda")
    >>> cache.append(k, v)              # k, v: (B, Hkv, T, D), e.g. a prefill or one new token
    >>> out = cache.attend(q)           # q: (B, Hq, T, D) -> (B, Hq, T, D)

Layouts (those of `decode_attention`):
    contiguous: key/value (B, S_max, Hkv, D|Dv).
    paged: key/value pages (P, PS, Hkv, D|Dv) and block_table (B, max_pages) int32; pages come
        from a free list as sequences grow (`reset` returns them).

`append` writes only the new positions (an index_put into the buffers: no copy of the cache) and
advances the (B,) int32 `lengths` on the device, without a host synchronisation: the cache keeps a
host-side mirror of the lengths for its capacity checks and page allocation.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .decode import decode_attention
from .validation import AttentionInputError, describe


class KVCache:
    """A per-layer key/value cache; build it with `KVCache.contiguous` or `KVCache.paged`.

    Attributes:
        key, value: the buffers (layouts in the module docstring).
        lengths: (B,) int32 device tensor, valid positions per sequence.
        starts: (B,) int32 device tensor of first valid positions, or None (all 0).
        block_table: (B, max_pages) int32 device tensor (paged caches), else None.
        capacity: positions a sequence can hold.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, *, block_table: Optional[torch.Tensor] = None):
        if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor) or key.dim() != 4 or value.dim() != 4:
            raise AttentionInputError(f"key, value: expected 4-D tensors ((B, S_max, Hkv, D) or pages (P, PS, Hkv, "
                                      f"D)), got {describe(key)} and {describe(value)}.")
        if key.shape[:3] != value.shape[:3] or key.dtype != value.dtype or key.device != value.device:
            raise AttentionInputError(f"key {tuple(key.shape)} {key.dtype} on {key.device} and value "
                                      f"{tuple(value.shape)} {value.dtype} on {value.device} must agree on all but the "
                                      "last dim, dtype and device.")
        if block_table is not None and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2
                                        or block_table.dtype not in (torch.int32, torch.int64)
                                        or block_table.device != key.device):
            raise AttentionInputError(f"block_table: expected a (B, max_pages) int32 tensor on {key.device} or None, "
                                      f"got {describe(block_table)}.")
        self.key, self.value, self.block_table = key, value, block_table
        self.device = key.device
        if block_table is None:
            self.batch, self.capacity, self.page_size = key.shape[0], key.shape[1], 0
        else:
            self.batch, self.page_size = block_table.shape[0], key.shape[1]
            self.capacity = block_table.shape[1] * self.page_size
            self._free = list(range(key.shape[0] - 1, -1, -1))  # pop() hands out page 0 first
            self._pages: list[list[int]] = [[] for _ in range(self.batch)]
        self.lengths = torch.zeros(self.batch, dtype=torch.int32, device=self.device)
        self.starts: Optional[torch.Tensor] = None
        self._host_lengths = [0] * self.batch

    @classmethod
    def contiguous(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, *, value_head_dim: Optional[int] = None,
                   dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> "KVCache":
        """A (B, max_len, Hkv, D) cache (and (.., Dv) values), uninitialised: only written slots are read."""
        _positive(batch=batch, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim)
        shape = (batch, max_len, kv_heads)
        return cls(torch.empty(*shape, head_dim, dtype=dtype, device=device),
                   torch.empty(*shape, value_head_dim or head_dim, dtype=dtype, device=device))

    @classmethod
    def paged(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, *, page_size: int = 16,
              num_pages: Optional[int] = None, value_head_dim: Optional[int] = None, dtype: torch.dtype = torch.float32,
              device: Union[str, torch.device] = "cpu") -> "KVCache":
        """Pages (num_pages, page_size, Hkv, D) shared by `batch` sequences of up to `max_len` positions.

        num_pages defaults to enough for every sequence at full length; fewer pages make a pool that
        `append` draws from until it runs out.
        """
        _positive(batch=batch, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size)
        max_pages = -(-max_len // page_size)
        num_pages = batch * max_pages if num_pages is None else num_pages
        _positive(num_pages=num_pages)
        shape = (num_pages, page_size, kv_heads)
        table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
        return cls(torch.empty(*shape, head_dim, dtype=dtype, device=device),
                   torch.empty(*shape, value_head_dim or head_dim, dtype=dtype, device=device), block_table=table)

    @property
    def host_lengths(self) -> list[int]:
        """The lengths as Python ints (a host-side mirror; reading it costs no synchronisation)."""
        return list(self._host_lengths)

    def reset(self, starts: Optional[Union[torch.Tensor, Sequence[int]]] = None) -> None:
        """Empties every sequence (pages go back to the pool); `starts` sets the first valid positions."""
        self.lengths.zero_()
        self._host_lengths = [0] * self.batch
        if self.block_table is not None:
            for pages in self._pages:
                self._free.extend(reversed(pages))
                pages.clear()
        self.set_starts(starts)

    def set_starts(self, starts: Optional[Union[torch.Tensor, Sequence[int]]]) -> None:
        """First valid position per sequence ((B,) ints, e.g. left-padding counts), or None for 0."""
        if starts is None:
            self.starts = None
            return
        starts = torch.as_tensor(starts, dtype=torch.int32).to(self.device)
        if tuple(starts.shape) != (self.batch,):
            raise AttentionInputError(f"starts: expected shape (B,) = ({self.batch},), got {tuple(starts.shape)}.")
        self.starts = starts

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Writes T new positions per sequence at [length, length + T) and advances the lengths.

        Args:
            key: (B, Hkv, T, D) new keys (torch SDPA's layout, as a model's projections give them).
            value: (B, Hkv, T, Dv).
        """
        b, hkv, t = self.batch, self.key.shape[2], key.shape[2] if isinstance(key, torch.Tensor) and key.dim() == 4 else -1
        for name, x, dim in (("key", key, self.key.shape[3]), ("value", value, self.value.shape[3])):
            if (not isinstance(x, torch.Tensor) or tuple(x.shape) != (b, hkv, t, dim) or x.dtype != self.key.dtype
                    or x.device != self.key.device):
                raise AttentionInputError(
                    f"{name}: expected a {self.key.dtype} tensor of shape (B, Hkv, T, D) = ({b}, {hkv}, T, {dim}) on "
                    f"{self.key.device}, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                    f"{'' if not isinstance(x, torch.Tensor) else f' {x.dtype} on {x.device}'}.")
        longest = max(self._host_lengths) + t
        if longest > self.capacity:
            raise AttentionInputError(f"append: {t} new positions would make a sequence {longest} long, beyond the "
                                      f"capacity {self.capacity}; build a larger cache.")
        positions = self.lengths[:, None].long() + torch.arange(t, device=self.device)[None, :]  # (B, T)
        rows = torch.arange(b, device=self.device)[:, None]
        new_k, new_v = key.transpose(1, 2), value.transpose(1, 2)  # (B, T, Hkv, D)
        if self.block_table is None:
            self.key[rows, positions] = new_k
            self.value[rows, positions] = new_v
        else:
            self._allocate(t)
            pages = self.block_table[rows, positions // self.page_size].long()
            slots = positions % self.page_size
            self.key[pages, slots] = new_k
            self.value[pages, slots] = new_v
        self.lengths += t
        self._host_lengths = [n + t for n in self._host_lengths]

    def _allocate(self, t: int) -> None:
        """Gives each sequence the pages it needs for t more positions, from the pool (all or none)."""
        missing = [max(0, -(-(length + t) // self.page_size) - len(pages))
                   for length, pages in zip(self._host_lengths, self._pages)]
        if sum(missing) > len(self._free):
            raise AttentionInputError(f"append: the page pool ({self.key.shape[0]} pages) is exhausted: {t} new "
                                      f"positions need {sum(missing)} more page(s), {len(self._free)} free; build the "
                                      "cache with more num_pages or reset finished sequences.")
        updates = []
        for seq, (count, pages) in enumerate(zip(missing, self._pages)):
            for _ in range(count):
                pages.append(self._free.pop())
                updates.append((seq, len(pages) - 1, pages[-1]))
        if updates:
            seqs, slots, pages = (torch.tensor(u, dtype=torch.long) for u in zip(*updates))
            self.block_table[seqs.to(self.device), slots.to(self.device)] = pages.to(self.device, torch.int32)

    def attend(self, query: torch.Tensor, *, window: Optional[int] = None, softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None, scale: Optional[float] = None, return_lse: bool = False,
               kernel: Optional[str] = None, alibi_slopes: Optional[torch.Tensor] = None):
        """`decode_attention` of (B, Hq, T, D) queries (the last T positions) against this cache."""
        return decode_attention(query, self.key, self.value, self.lengths, cache_starts=self.starts,
                                block_table=self.block_table, window=window, softcap=softcap, sinks=sinks, scale=scale,
                                return_lse=return_lse, kernel=kernel, alibi_slopes=alibi_slopes)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AttentionInputError(f"{name}={value!r}: expected a positive int.")
