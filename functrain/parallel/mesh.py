"""Process groups and the DeviceMesh: set-up from torchrun's environment, tear-down, rank helpers.

Internals: docs/internals.md "functrain.parallel.mesh".

Example:
    >>> ctx = parallel.setup({"dp_replicate": 1, "dp_shard": -1, "tp": 1})
    >>> print(ctx.rank, ctx.world_size, ctx.dp_rank, ctx.dp_world, ctx.device)
    >>> ...
    >>> parallel.teardown()
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from functrain.config_checks import mesh_shape
from functrain.parallel import gloo

__all__ = [
    "AXES",
    "CP_AXIS",
    "PP_AXIS",
    "DP_AXES",
    "GRAD_AXES",
    "TP_AXIS",
    "ParallelContext",
    "setup",
    "teardown",
    "is_main_process",
    "rank",
    "world_size",
    "barrier",
    "dp_coordinates",
]

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
DP_AXES = ("dp_replicate", "dp_shard")  # the axes that split the batch's rows
CP_AXIS = "cp"
PP_AXIS = "pp"  # pipeline stages: outside the four axes (see "Pipeline stages" above)
GRAD_AXES = (*DP_AXES, CP_AXIS)  # the axes whose ranks see different tokens: gradients averaged over them
TP_AXIS = "tp"

_OWNED_GROUP = False  # whether setup() created the default process group (teardown destroys it)


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """What a program needs to know about its place in the run.

    Attributes:
      mesh: the 4-D `DeviceMesh` ("dp_replicate", "dp_shard", "cp", "tp"), or None on the plain
        single-process path.
      device: this process's compute device (cuda:LOCAL_RANK, or cpu).
      rank: global rank; world_size: number of processes.
      dp_rank, dp_world: index and number of data-parallel replicas (dp_replicate x dp_shard);
        ranks that differ only in their cp or tp coordinate share a dp_rank and read the same batch.
      cp_rank, cp_world: coordinate and size of the context-parallel axis.
      tp_rank, tp_world: coordinate and size of the tensor-parallel axis.
      shape: {axis name: size} for the four axes.
      pp_rank, pp_world: this rank's pipeline stage and the number of stages (`functrain.parallel.pipeline`).
      pp_group: the process group of this rank's pipeline (None without pipeline stages).
    """

    mesh: Any
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dp_world: int
    tp_rank: int
    tp_world: int
    shape: Mapping[str, int]
    cp_rank: int = 0
    cp_world: int = 1
    pp_rank: int = 0
    pp_world: int = 1
    pp_group: Any = None

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc) -> None:
        teardown()


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (and selected), else cpu."""
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _init_process_group(backend: str | None, timeout_s: float | None, single: bool, gloo_threads: int) -> None:
    """Creates the default group from torchrun's env vars, or a 1-rank group on a free port."""
    global _OWNED_GROUP
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # gloo groups with `gloo_threads` worker threads: torch's 2 corrupt the heap (functrain.parallel.gloo)
    kwargs: dict[str, Any] = {"backend": gloo.backend(gloo_threads) if backend == "gloo" else backend}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if single:
        kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs.update(
            store=attempt_store(kwargs.get("timeout")),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    dist.init_process_group(**kwargs)
    _OWNED_GROUP = True


def attempt_store(timeout: datetime.timedelta | None = None):
    """torchrun's agent store, seen under a prefix of this restart attempt's own.

    torchrun keeps one TCPStore for every attempt of a run, and torch's env:// rendezvous hands it to
    the process group unprefixed ("a new TCPStore for every retry", its comment says; not so under
    `--standalone` or c10d rendezvous, torch 2.13 and 2.14). So after `--max-restarts` brings a run
    back, the new attempt's groups find the killed attempt's keys: a gloo group read a dead rank's
    address and failed ("connectFullMesh failed ... Connection refused") or paired with the wrong
    peer. Every group built on the default store inherits this prefix.

    Args:
      timeout: the store's timeout (torch's default when None).

    Returns:
      A `PrefixStore("functrain/attempt_<TORCHELASTIC_RESTART_COUNT>", client of MASTER_ADDR:MASTER_PORT)`.

    Example:
      >>> dist.init_process_group("gloo", store=attempt_store(), rank=rank, world_size=world)
    """
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or datetime.timedelta(seconds=300),
    )
    return dist.PrefixStore(f"functrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def attempt_store_premise_problem() -> str | None:
    """What no longer holds of `attempt_store`'s premise (None: it holds): torch's env:// rendezvous
    under the agent store returns the run's store itself, where a key an earlier attempt wrote is seen.
    A self-test of `functrain.compiler.workarounds`.

    Returns:
      None, or one line naming what changed.

    Example:
      >>> assert attempt_store_premise_problem() is None
    """
    master = dist.TCPStore("127.0.0.1", _free_port(), is_master=True, wait_for_workers=False)
    master.set("left_by_attempt_0", "1")
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master.port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        store, _, _ = next(dist.rendezvous("env://"))
        seen = store.check(["left_by_attempt_0"])
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return None if seen else "env:// under the agent store now keeps restart attempts apart"


def _backend_override(timeout_s: float | None, sizes: dict, world: int, gloo_threads: int, axes=AXES):
    """init_device_mesh's backend_override: on gloo the mesh's subgroups get `gloo_threads` worker
    threads whatever made the default group, and `timeout_s` (None: torch's), which subgroups do not
    inherit from the default group."""
    default = dist.get_backend()
    on_gloo = gloo.is_gloo_backend(default)
    # a world-wide axis reuses the default group; a one-rank group never communicates
    axes = [a for a in axes if 1 < sizes[a] < world]
    if not axes or not (on_gloo or (default == "nccl" and timeout_s is not None)):
        return None
    name = gloo.backend(gloo_threads) if on_gloo else default
    opts = None
    if timeout_s is not None:
        opts = gloo.options() if on_gloo else dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
    return {axis: (name, opts) for axis in axes}


def setup(
    mesh_config: Any = None,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    mesh_on_single_process: bool = False,
    gloo_threads: int = 1,
) -> ParallelContext:
    """Starts the process group (from torchrun's env vars) and builds the DeviceMesh.

    Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) the default group
    is initialized with nccl on GPU, gloo on CPU (an existing default group is reused). Without
    torchrun, one process runs with no process group and no mesh (see the module docstring).

    Args:
      mesh_config: axis sizes (see `mesh_shape`); None = FSDP over all processes.
      backend: force a torch.distributed backend ("gloo", "nccl").
      timeout_s: collective timeout in seconds of the default group and of every mesh group
        (torch's default when None).
      mesh_on_single_process: build a 1-device mesh (and a single-rank group) even on 1 process.
      gloo_threads: worker threads of each gloo group this creates. 1 runs a group's collectives one
        at a time; torch's default of 2 lets two of one group run at once, which corrupts the heap
        in torch 2.13 (`functrain.parallel.gloo`; `bench/gloo_threads.py`).

    Returns:
      A `ParallelContext`; also a context manager that calls `teardown()` on exit.

    Raises:
      ValueError: the mesh config does not fit the world size (one line).

    Example:
      >>> with parallel.setup(config.mesh) as ctx:
      ...     state = parallel.shard_state(state, ctx.mesh, rules)
    """
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if launched and not dist.is_initialized():
        _init_process_group(backend, timeout_s, single=False, gloo_threads=gloo_threads)
    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = mesh_shape(mesh_config, world)  # validate before anything else can hang
    pp = world // _prod(shape.values())
    device = _device()
    mesh, pp_group, pp_rank = None, None, 0
    if world > 1 or mesh_on_single_process:
        if not dist.is_initialized():
            _init_process_group(backend, timeout_s, single=True, gloo_threads=gloo_threads)
        from torch.distributed.device_mesh import init_device_mesh

        sizes, names = {"pp": pp, **shape}, (PP_AXIS, *AXES) if pp > 1 else AXES
        mesh = init_device_mesh(
            device.type,
            tuple(sizes[a] for a in names),
            mesh_dim_names=names,
            backend_override=_backend_override(timeout_s, sizes, world, gloo_threads, names),
        )
        if pp > 1:  # this stage's mesh, and the group along the pipeline
            pp_group, pp_rank, mesh = mesh.get_group(PP_AXIS), mesh.get_local_rank(PP_AXIS), mesh[AXES]
    r = dist.get_rank() if dist.is_initialized() else 0
    dp_rank, dp_world = dp_coordinates(mesh) if mesh is not None else (0, 1)
    return ParallelContext(
        mesh=mesh,
        device=device,
        rank=r,
        world_size=world,
        dp_rank=dp_rank,
        dp_world=dp_world,
        tp_rank=mesh.get_local_rank(TP_AXIS) if mesh is not None else 0,
        tp_world=shape["tp"],
        shape=dict(shape),
        cp_rank=mesh.get_local_rank(CP_AXIS) if mesh is not None else 0,
        cp_world=shape["cp"],
        pp_rank=pp_rank,
        pp_world=pp,
        pp_group=pp_group,
    )


def _prod(xs) -> int:
    """The product of the ints `xs`."""
    out = 1
    for x in xs:
        out *= x
    return out


def dp_coordinates(mesh) -> tuple[int, int]:
    """This process's data-parallel index and the number of dp replicas on `mesh`.

    The dp index enumerates the (dp_replicate, dp_shard) coordinate row-major; ranks that differ
    only in their tp coordinate share it (and read the same batch rows).

    Args:
      mesh: a DeviceMesh with named axes (axes not in `DP_AXES` are ignored).

    Returns:
      `(dp_rank, dp_world)`.

    Example:
      >>> dp_coordinates(ctx.mesh)   # dp_shard=2, tp=2, rank 3 -> (1, 2)
      (1, 2)
    """
    rank, world = 0, 1
    for i, name in enumerate(mesh.mesh_dim_names or ()):
        if name in DP_AXES:
            rank = rank * mesh.size(i) + mesh.get_local_rank(i)
            world *= mesh.size(i)
    return rank, world


def teardown() -> None:
    """Destroys the default process group that `setup` created (safe to call more than once).

    A group the caller initialized before `setup` is left alone (the caller owns it).

    Returns:
      None.

    Example:
      >>> parallel.teardown()
    """
    global _OWNED_GROUP
    if _OWNED_GROUP and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED_GROUP = False


def rank() -> int:
    """This process's global rank.

    Returns:
      The rank in the default process group, 0 without one.

    Example:
      >>> parallel.rank()
      0
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes.

    Returns:
      The default process group's size, 1 without one.

    Example:
      >>> parallel.world_size()
      1
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on global rank 0 (and on a lone process): the one that logs, samples and prints.

    Returns:
      Whether `rank() == 0`.

    Example:
      >>> if parallel.is_main_process(): print(metrics)
    """
    return rank() == 0


def barrier() -> None:
    """Waits for every process (a no-op without a process group).

    Returns:
      None, once every rank has called it.

    Example:
      >>> parallel.barrier()
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
