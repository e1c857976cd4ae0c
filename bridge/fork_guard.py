"""A process forked after JAX's runtime started in its parent cannot use that runtime.

JAX's XLA client runs thread pools; `fork` copies the process but not its threads, so the child's
first JAX call waits forever on threads that do not exist (multiprocessing's default "fork" start
method on Linux, DataLoader workers). The bridge's entry points call `check_not_forked` first and
raise a clear error in such a child instead of hanging. A child forked before JAX's runtime
started, or started with "spawn"/"forkserver", is unaffected.
"""

from __future__ import annotations

import os

_forked_after_runtime = False


def _runtime_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without this query: assume it started
        return True


def _after_fork_in_child() -> None:
    global _forked_after_runtime
    _forked_after_runtime = _forked_after_runtime or _runtime_started()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_not_forked(what: str) -> None:
    """Raises RuntimeError in a process forked after its parent started JAX's runtime."""
    if _forked_after_runtime:
        raise RuntimeError(
            f"{what}: this process was forked after its parent started JAX's runtime (jaxattn had run there); "
            "the runtime's threads do not survive fork, so this call would hang. Start worker processes with "
            "multiprocessing.get_context('spawn') or 'forkserver' (DataLoader: multiprocessing_context='spawn'), "
            "or fork them before the first jaxattn call in the parent."
        )
