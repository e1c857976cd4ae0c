"""The 1-D device mesh of a sharded call (`ShardedJaxOp`), from what a torch caller names.

A caller names the mesh as a `jax.sharding.Mesh`, a list of torch devices, or None (the devices
its tensors imply), and passes either whole tensors or this process's shards. The answer is the
static description a `ShardedJaxOp` takes: the JAX device ids in mesh order and the axis name.
These are JAX runtime queries, constant while torch.compile traces.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax
import torch
from jax.sharding import Mesh

from .devices import to_jax_device
from .compile_hints import assume_constant_result

#: The axis name of a mesh built from a list of devices (or from None).
DEFAULT_AXIS = "sp"


@assume_constant_result
def resolve_mesh(mesh: Union[None, Mesh, Sequence[Union[str, torch.device]]], tensor_devices: tuple[str, ...],
                 whole: bool, error: type = ValueError, tensors: str = "tensors",
                 mesh_noun: str = "mesh") -> tuple[bool, tuple[int, ...], str]:
    """(whole, device ids of the mesh in order, axis name) of a call.

    Args:
        mesh: a 1-D Mesh; a non-empty list of torch devices; or None: every local device of the
            tensors' kind (whole tensors), the shards' devices (one process; CPU shards: the first
            simulated CPU devices), or every device of every process (several processes).
        tensor_devices: the devices of the call's tensors (one whole tensor, or one per shard), as
            strings.
        whole: the caller passes whole tensors; in a multi-process run they are this process's
            shards instead, and the answer says so (False).
        error: the exception raised for a mesh that does not fit the call (a ValueError subclass).
        tensors, mesh_noun: what the caller's messages call the tensors and the mesh.

    Raises:
        error: a mesh with several axes or a repeated device, or shards that do not match the
            mesh's devices of this process (one per device, in mesh order).
        TypeError: `mesh` is none of the above.
    """
    whole = whole and jax.process_count() == 1
    devices_of_tensors = [torch.device(d) for d in tensor_devices]
    if isinstance(mesh, Mesh):
        if len(mesh.axis_names) != 1:
            raise error(f"mesh: expected a 1-D mesh (one sequence axis), got axes {mesh.axis_names}.")
        devices = list(mesh.devices.flat)
        axis = mesh.axis_names[0]
    elif mesh is None:
        if whole:
            platform = "gpu" if devices_of_tensors[0].type == "cuda" else "cpu"
            devices = jax.local_devices(backend=platform)
        elif jax.process_count() > 1:
            devices = jax.devices()
        elif all(d.type == "cpu" for d in devices_of_tensors):  # CPU shards: the first n (simulated) CPU devices
            devices = jax.local_devices(backend="cpu")[:len(devices_of_tensors)]
        else:
            devices = [to_jax_device(d) for d in devices_of_tensors]
        axis = DEFAULT_AXIS
    elif isinstance(mesh, (list, tuple)) and mesh:
        try:
            devices = [to_jax_device(torch.device(d)) for d in mesh]
        except (TypeError, RuntimeError) as err:
            raise error(f"mesh={mesh!r}: expected torch devices such as ['cuda:0', 'cuda:1'] ({err}).") from None
        axis = DEFAULT_AXIS
    else:
        raise TypeError(f"mesh={mesh!r}: expected None, a 1-D jax.sharding.Mesh or a list of torch devices.")
    if len({d.id for d in devices}) != len(devices):
        raise error(f"mesh: a device appears twice in {devices}.")
    if not whole:
        local = [d for d in devices if d.process_index == jax.process_index()]
        cuda = jax.process_count() == 1 and devices_of_tensors[0].type == "cuda"
        got = [to_jax_device(d) for d in devices_of_tensors] if cuda else None
        if len(devices_of_tensors) != len(local) or (cuda and got != local):
            raise error(
                f"{tensors}: {len(devices_of_tensors)} shard(s) on {[str(d) for d in devices_of_tensors]}, but the "
                f"{mesh_noun}'s devices of this process are {local}; pass one shard per device, in the {mesh_noun}'s "
                "order.")
    return whole, tuple(d.id for d in devices), axis


__all__ = ["DEFAULT_AXIS", "resolve_mesh"]
