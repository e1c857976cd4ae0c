"""A bounded LRU cache with hit and miss counters and build timing, for compiled JAX executables;
and JAX's persistent (on-disk) compilation cache, for processes that restart often."""

from __future__ import annotations

import collections
import dataclasses
import threading
import os
import time
from typing import Any, Callable, Hashable, Union

import jax


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
    """Maps signatures to built values; builds on a miss and evicts the least recently used.

    Thread-safe. A key is built once even when several threads miss it at the same time: the
    first builds (a miss) while the others wait for its value (a hit each; if that build raises,
    one of them builds instead). Every lookup counts exactly once, as a hit or a miss.
    """

    def __init__(self, maxsize: int = 256):
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize <= 0:
            raise ValueError(f"maxsize={maxsize!r}: expected a positive int.")
        self.maxsize = maxsize
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Hashable, tuple[threading.Event, int]] = {}  # key -> (done, builder thread)
        self.hits = 0
        self.misses = 0
        self.build_seconds = 0.0
        self.last_build_seconds = 0.0
        self.ever_built = False  # not reset by `clear`: the process ran an XLA computation of ours

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value held for `key`; on a miss, `build()`'s, kept (evicting beyond maxsize).

        Raises:
            Whatever `build` raises, in the thread that ran it; threads waiting on it look again.
        """
        while True:
            with self._lock:
                value = self._data.get(key, _MISSING)
                if value is not _MISSING:
                    self.hits += 1
                    self._data.move_to_end(key)
                    return value
                pending = self._building.get(key)
                me = threading.get_ident()
                if pending is None or pending[1] == me:  # nobody builds it (or this thread, re-entered)
                    self.misses += 1
                    done = threading.Event()
                    self._building[key] = (done, me)
                    break
            pending[0].wait()  # then look again: built (a hit), or the build failed or was evicted
        try:
            start = time.perf_counter()
            self.ever_built = True
            value = build()
            elapsed = time.perf_counter() - start
            with self._lock:
                self.build_seconds += elapsed
                self.last_build_seconds = elapsed
                self._data[key] = value
                self._data.move_to_end(key)
                while len(self._data) > self.maxsize:
                    self._data.popitem(last=False)
        finally:
            with self._lock:
                if self._building.get(key, (None,))[0] is done:
                    del self._building[key]
            done.set()
        return value

    def info(self) -> CacheInfo:
        with self._lock:  # one consistent snapshot while other threads count
            return CacheInfo(
                self.hits, self.misses, len(self._data), self.maxsize, self.build_seconds, self.last_build_seconds
            )

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


def enable_persistent_cache(directory: Union[str, os.PathLike], *, min_compile_time_s: float = 0.0) -> None:
    """Keeps compiled executables on disk (JAX's persistent compilation cache) across processes.

    A process that starts again with the same `directory` loads the executables of shapes it has
    compiled before instead of compiling them (the in-memory cache above still counts these as
    misses; their compile time is then mostly loading). Call it before the first compiled call.

    Args:
        directory: where JAX writes its cache entries (`~` expands; created if missing; may be
            shared by processes on one machine).
        min_compile_time_s: only executables that took at least this long to compile are kept.
    """
    if isinstance(min_compile_time_s, bool) or not isinstance(min_compile_time_s, (int, float)) or min_compile_time_s < 0:
        raise ValueError(f"min_compile_time_s={min_compile_time_s!r}: expected a float >= 0.")
    directory = os.path.expanduser(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
