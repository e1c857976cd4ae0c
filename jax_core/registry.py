"""`AttentionRegistry`: implementations by name, and selection by platform priority."""

from __future__ import annotations

import warnings
from typing import Optional, TypeVar

from .base import AttentionImpl, mode_for
from .capabilities import AttentionInputs
from .metadata import AttentionMetadata

ImplT = TypeVar("ImplT", bound=type[AttentionImpl])


class ImplementationUnavailableError(ValueError, NotImplementedError):
    """A forced implementation cannot run the call (a ValueError and a NotImplementedError)."""


#: Automatic selection order per platform; names not registered are skipped.
PRIORITIES: dict[str, tuple[str, ...]] = {
    # cuDNN (through sdpa) first; flash takes what cuDNN cannot (soft cap, sinks, bottom-right, ...)
    # and, on CUDA, the shapes where it measured faster (`platform_order`).
    "gpu": ("sdpa", "flash", "vanilla"),
    "tpu": ("flash", "sdpa", "vanilla"),
    "cpu": ("sdpa", "vanilla"),
}

#: On CUDA, cuDNN (through `sdpa`) goes before `flash` only for long sequences with head dims up to
#: 128: there it was faster, elsewhere our kernels were (`benchmarks/flash_gpu.py` selection table,
#: H100, 2026-11-22: cuDNN 1.03 ms vs flash 1.35 ms forward at (2, 16, 8192, 128) causal; flash ahead
#: at (16, 16, 1024, 64) forward+backward, at every size below, and 5.5x ahead at head dim 256).
CUDNN_MIN_QUERY_KEY_PAIRS = 4096 * 4096


def platform_order(inputs: AttentionInputs) -> tuple[str, ...]:
    """`PRIORITIES[inputs.platform]`, with `flash` moved before `sdpa` on CUDA where it measured faster."""
    order = PRIORITIES.get(inputs.platform, ("vanilla",))
    if inputs.backend != "cuda" or "flash" not in order or "sdpa" not in order:
        return order
    cudnn_faster = (inputs.q_len * inputs.kv_len >= CUDNN_MIN_QUERY_KEY_PAIRS
                    and max(inputs.head_dim, inputs.value_head_dim) <= 128)
    if cudnn_faster:
        return order
    rest = tuple(n for n in order if n != "flash")
    at = rest.index("sdpa")
    return rest[:at] + ("flash",) + rest[at:]


#: Implementations tried before the platform's list in a mode (`base.mode_for(q_len, kv_len)`):
#: decoding calls on GPU go to the split-K decode kernel first.
MODE_PRIORITIES: dict[str, dict[str, tuple[str, ...]]] = {
    "__autoregressive__": {"gpu": ("decode",)},
}


def sequence_parallel_first(metadata: Optional[AttentionMetadata]) -> tuple[str, ...]:
    """("ring",) when `metadata.mesh` has an axis named `metadata.sequence_axis_name` of size > 1: the
    caller shards the sequence, so automatic selection tries ring attention first (not for decoding
    calls). Without such a mesh, ring is never chosen automatically (only when asked for by name)."""
    if metadata is None or metadata.mesh is None:
        return ()
    return ("ring",) if metadata.mesh.shape.get(metadata.sequence_axis_name, 1) > 1 else ()


#: Names still accepted, with a DeprecationWarning, for the name to use instead. They resolve before
#: any lookup and are not listed among the registered names.
DEPRECATED_NAMES: dict[str, str] = {
    # flash-attn 2's name, but the implementation behind it is cuDNN's fused attention (through sdpa)
    "cuda_flash_attn2": "cudnn",
}


class AttentionRegistry:
    """Registry of `AttentionImpl` classes, keyed by every name and alias they declare."""

    _impls: dict[str, type[AttentionImpl]] = {}

    @classmethod
    def register(cls, impl_cls: ImplT) -> ImplT:
        """Class decorator: registers `impl_cls` under each name of `get_impl_name()`."""
        names = impl_cls.get_impl_name()
        names = (names,) if isinstance(names, str) else tuple(names)
        for name in names:  # check every alias before registering any
            existing = cls._impls.get(name)
            if existing is not None and existing is not impl_cls:
                raise ValueError(f"attention implementation name {name!r} is already taken by {existing.__name__}.")
        for name in names:
            cls._impls[name] = impl_cls
        return impl_cls

    @classmethod
    def current_name(cls, impl_name: str) -> str:
        """`impl_name`, or the name that replaces it if it is deprecated (with a DeprecationWarning)."""
        if isinstance(impl_name, str) and impl_name in DEPRECATED_NAMES:
            new = DEPRECATED_NAMES[impl_name]
            warnings.warn(f"implementation={impl_name!r} is deprecated: it runs {new} (cuDNN's fused attention "
                          f"through sdpa), not flash-attn's kernels; use implementation={new!r}.",
                          DeprecationWarning, stacklevel=3)
            return new
        return impl_name

    @classmethod
    def get(cls, impl_name: str) -> type[AttentionImpl]:
        """The class registered under `impl_name` (a deprecated name: the class of its replacement, with
        a DeprecationWarning); ValueError listing the known names otherwise."""
        impl_name = cls.current_name(impl_name)
        try:
            return cls._impls[impl_name]
        except (KeyError, TypeError):
            raise ValueError(
                f"implementation={impl_name!r} is not registered; available: {cls.list_implementations()}."
            ) from None

    @classmethod
    def create(cls, impl_name: str, metadata: AttentionMetadata) -> AttentionImpl:
        return cls.get(impl_name)(metadata)

    @classmethod
    def list_implementations(cls) -> list[str]:
        """Every registered name, aliases included, sorted."""
        return sorted(cls._impls)

    @classmethod
    def canonical_names(cls) -> list[str]:
        """One name per registered class, in registration order."""
        seen, out = set(), []
        for impl in cls._impls.values():
            if impl not in seen:
                seen.add(impl)
                out.append(impl.canonical_name())
        return out

    @classmethod
    def select(
        cls,
        inputs: AttentionInputs,
        metadata: Optional[AttentionMetadata] = None,
        implementation: Optional[str | tuple[str, ...]] = None,
    ) -> type[AttentionImpl]:
        """Chooses the implementation for `inputs`.

        Args:
            inputs: the call's signature.
            metadata: settings (a mesh adds divisibility rules).
            implementation: None for automatic selection: "ring" first when the mesh has the
                sequence axis (`sequence_parallel_first`), then `MODE_PRIORITIES` for the call's mode,
                then `PRIORITIES[inputs.platform]`; a name to
                force one; a tuple of names to choose among them in that order.

        Raises:
            ValueError: a forced implementation cannot run the call (with its reasons), or a name
                is unknown.
            NotImplementedError: no candidate can run the call (with every candidate's reasons).
        """
        return cls.select_with_reason(inputs, metadata, implementation)[0]

    @classmethod
    def select_with_reason(
        cls,
        inputs: AttentionInputs,
        metadata: Optional[AttentionMetadata] = None,
        implementation: Optional[str | tuple[str, ...]] = None,
    ) -> tuple[type[AttentionImpl], str]:
        """`select`'s choice and why it was made (the order tried, and why earlier candidates were
        passed over); raises as `select`."""
        if isinstance(implementation, str):
            impl = cls.get(implementation)
            reasons = impl.not_supported_reasons(inputs, metadata)
            if reasons:
                raise ImplementationUnavailableError(
                    f"implementation={implementation!r} cannot run this call: " + "; ".join(reasons) + "."
                )
            return impl, f"implementation={implementation!r} asked for by name"
        if implementation is None:
            mode = mode_for(inputs.q_len, inputs.kv_len)
            ring = sequence_parallel_first(metadata) if mode == "__train__" else ()
            ordered = (ring + MODE_PRIORITIES.get(mode, {}).get(inputs.platform, ())
                       + platform_order(inputs))
            names = [n for n in dict.fromkeys(ordered) if n in cls._impls]
            why = f"automatic selection on {inputs.platform} ({inputs.backend}), order {names}"
        else:
            names = [cls.current_name(name) for name in implementation]
            for name in names:
                cls.get(name)
            why = f"first of implementation={names} that can run the call"
        all_reasons = {}
        for name in names:
            impl = cls._impls[name]
            reasons = impl.not_supported_reasons(inputs, metadata)
            if not reasons:
                passed = "".join(f"; {n} passed over: " + ", ".join(r) for n, r in all_reasons.items())
                return impl, f"{why}: {name} is the first that can run it{passed}"
            all_reasons[name] = reasons
        detail = "\n".join(f"  {name}: " + "; ".join(r) for name, r in all_reasons.items())
        raise NotImplementedError(f"no attention implementation can run this call:\n{detail}")
