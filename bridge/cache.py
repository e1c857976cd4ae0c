"""A bounded LRU cache with hit and miss counters and build timing, for compiled JAX executables."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable, Hashable


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """Counters of the compiled-executable cache.

    Attributes:
        hits: lookups that found an executable.
        misses: lookups that traced and compiled one.
        size: executables held now.
        maxsize: capacity; the least recently used executable is dropped beyond it.
        compile_time_s: total seconds spent on misses (trace, lower and compile).
        last_compile_time_s: seconds the latest miss took (0.0 before the first).
    """

    hits: int
    misses: int
    size: int
    maxsize: int
    compile_time_s: float = 0.0
    last_compile_time_s: float = 0.0


class LRUCache:
    """Maps signatures to built values; builds on a miss and evicts the least recently used."""

    def __init__(self, maxsize: int = 256):
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize <= 0:
            raise ValueError(f"maxsize={maxsize!r}: expected a positive int.")
        self.maxsize = maxsize
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.build_seconds = 0.0
        self.last_build_seconds = 0.0

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is not _MISSING:
                self.hits += 1
                self._data.move_to_end(key)
                return value
            self.misses += 1
        start = time.perf_counter()
        value = build()
        elapsed = time.perf_counter() - start
        with self._lock:
            self.build_seconds += elapsed
            self.last_build_seconds = elapsed
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, len(self._data), self.maxsize, self.build_seconds, self.last_build_seconds)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0
            self.build_seconds = self.last_build_seconds = 0.0

    def resize(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize <= 0:
            raise ValueError(f"maxsize={maxsize!r}: expected a positive int.")
        with self._lock:
            self.maxsize = maxsize
            while len(self._data) > maxsize:
                self._data.popitem(last=False)


_MISSING = object()
