"""torch <-> JAX across several devices and processes: runtime set-up and sharded arrays.

One process per GPU, as `torchrun` starts them (step by step):

    1. torchrun --nproc-per-node=2 train.py      # sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    2. in train.py, before any other JAX call:
           from jaxattn.bridge import initialize_from_torchrun
           initialize_from_torchrun()            # jax.distributed.initialize from those variables
    3. torch.cuda.set_device(local_rank); each rank builds its own sequence shard on its GPU.
    4. each rank passes its torch shards to a jaxattn function that runs over the global mesh and
       gets its own output shard back; XLA's collectives (NCCL on GPU, gloo on CPU) move the data.

The JAX coordinator listens on MASTER_PORT + 1 by default (torch's own store uses MASTER_PORT);
set JAXATTN_COORDINATOR_PORT to choose another port.

Arrays: `global_from_shards` assembles torch shards (this process's, in mesh order) into one
global JAX array without copying them; `torch_shards` hands back the addressable shards of a JAX
array as torch tensors, in mesh order. Nothing here knows what the computation is.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import jax
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .dlpack import to_jax, to_torch

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_settings(env: Optional[dict] = None) -> dict:
    """The `jax.distributed.initialize` arguments that torchrun's environment variables describe.

    Returns:
        dict with coordinator_address ("MASTER_ADDR:port"), num_processes (WORLD_SIZE),
        process_id (RANK) and local_rank (LOCAL_RANK, default 0).

    Raises:
        RuntimeError: a variable is missing or malformed (not started by torchrun?).
    """
    env = dict(os.environ if env is None else env)
    missing = [name for name in _ENV if name not in env]
    if missing:
        raise RuntimeError(f"torchrun environment variables {missing} are not set; start the script with "
                           "`torchrun --nproc-per-node=N script.py` (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).")
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        port = int(env.get("JAXATTN_COORDINATOR_PORT", int(env["MASTER_PORT"]) + 1))
    except ValueError as err:
        raise RuntimeError(f"torchrun environment variables are not integers: {err}") from None
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside [0, WORLD_SIZE={world}).")
    return dict(coordinator_address=f"{env['MASTER_ADDR']}:{port}", num_processes=world, process_id=rank,
                local_rank=local)


def initialize_from_torchrun(platform: Optional[str] = None, env: Optional[dict] = None,
                             initialization_timeout: int = 300) -> dict:
    """Starts JAX's multi-process runtime from torchrun's environment; call before any other JAX use.

    Args:
        platform: "gpu" (each process uses the GPU of its LOCAL_RANK) or "cpu" (collectives through
            gloo); None: "gpu" when torch sees CUDA, else "cpu".
        env: the environment to read (default: os.environ).
        initialization_timeout: seconds to wait for every process.

    Returns:
        The settings used (`torchrun_settings`), with "platform".
    """
    settings = torchrun_settings(env)
    if platform is None:
        platform = "gpu" if torch.cuda.is_available() else "cpu"
    if platform not in ("gpu", "cpu"):
        raise ValueError(f"platform={platform!r}: expected 'gpu', 'cpu' or None.")
    kwargs = dict(coordinator_address=settings["coordinator_address"], num_processes=settings["num_processes"],
                  process_id=settings["process_id"], initialization_timeout=initialization_timeout)
    if platform == "gpu":
        kwargs["local_device_ids"] = [settings["local_rank"]]
    else:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return dict(settings, platform=platform)


def sequence_mesh(devices: Optional[Sequence[jax.Device]] = None, axis_name: str = "sp") -> Mesh:
    """A 1-D mesh over `devices` (default: every device of every process, in process order)."""
    devices = list(jax.devices() if devices is None else devices)
    import numpy as np

    return Mesh(np.array(devices), (axis_name,))


def global_from_shards(shards: Sequence[torch.Tensor], mesh: Mesh, spec: P, axis: Optional[int]) -> jax.Array:
    """One global JAX array from this process's torch shards, without copies (DLPack).

    Args:
        shards: the shards this process holds, one per local device of `mesh` in mesh order, each
            on its device (a shard on another device is copied there).
        mesh, spec: the global array's sharding; `spec[axis]` names the mesh axis split along `axis`.
        axis: the split dimension; the global size is the shard size times the mesh axis size.
            None: nothing is split (spec P()), each shard is a full copy of a replicated array.
    """
    # Each shard is imported on its own process-local device (one stream handshake per device).
    # Shards of one torch device bound for several mesh devices (simulated CPU devices) are copied.
    targets = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(targets) != len(shards):
        raise ValueError(f"{len(shards)} shard(s) for the {len(targets)} device(s) this process has in the mesh.")
    arrays = [x if x.devices() == {target} else jax.device_put(x, target)
              for x, target in zip(to_jax(list(shards)), targets)]
    shape = list(arrays[0].shape)
    if axis is not None:
        shape[axis] *= mesh.shape[spec[axis]]
    return jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, spec), arrays)


def torch_shards(x: jax.Array, axis: int) -> list[torch.Tensor]:
    """This process's shards of `x` as torch tensors (zero-copy), ordered by position along `axis`."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[axis].start or 0)
    return to_torch([s.data for s in shards])
