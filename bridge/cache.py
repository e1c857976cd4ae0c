"""A bounded LRU cache with hit and miss counters, for compiled JAX executables."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Hashable


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    maxsize: int


class LRUCache:
    """Maps signatures to built values; builds on a miss and evicts the least recently used."""

    def __init__(self, maxsize: int = 256):
        if maxsize <= 0:
            raise ValueError(f"maxsize={maxsize!r}: expected a positive int.")
        self.maxsize = maxsize
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._data:
                self.hits += 1
                self._data.move_to_end(key)
                return self._data[key]
            self.misses += 1
        value = build()
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, len(self._data), self.maxsize)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def resize(self, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError(f"maxsize={maxsize!r}: expected a positive int.")
        with self._lock:
            self.maxsize = maxsize
            while len(self._data) > maxsize:
                self._data.popitem(last=False)
