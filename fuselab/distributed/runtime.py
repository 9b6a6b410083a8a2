"""Process-group lifetime: ``init()`` reads torchrun's environment, ``shutdown()`` ends it.

One code path for every launch::

    python script.py                                 # one process: world size 1 (a trivial group)
    torchrun --standalone --nproc_per_node=8 -m ...  # one node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 ...

``init`` picks NCCL for CUDA and gloo for the CPU, binds each process to GPU ``LOCAL_RANK``, and
gives every collective a timeout: a rank that dies or hangs makes the others raise (gloo) or
their NCCL watchdog abort the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), so the job ends with
a non-zero exit and a message instead of hanging; torchrun stops the remaining ranks as soon as
one exits non-zero. A plain process gets a world-size-1 group over an in-memory store, so
collectives, device meshes and DCP behave as under torchrun.

NVLink multicast (NVLS) is switched off by default, before NCCL starts, in this process and in
``launch_environment()`` for launchers: on shared multi-GPU hosts it can take GPUs out of service.
"""
import gc
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, Mapping, Optional, TypeVar, Union

import torch
import torch.distributed as dist

T = TypeVar("T")

# Defaults applied (setdefault: an explicit value in the environment wins) before NCCL starts.
NVLS_OFF: Dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# The NCCL watchdog tears the process down on a collective error or timeout (3: without cleanup,
# which could itself hang on a dead peer).
NCCL_ERRORS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
DEFAULT_TIMEOUT_S = 600.0

logger = logging.getLogger("fuselab.distributed")


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among ``world_size`` and the device it drives."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout: timedelta
    launched: bool  # started by torchrun (False: a plain process with a trivial group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def mesh(self):
        """The 1-D device mesh over every rank (FSDP's data-parallel mesh)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,))


_RUNTIME: Optional[Runtime] = None


def launch_environment(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``env`` (default: this process's) with NVLink multicast off and NCCL errors fatal, for a
    launcher to hand to the processes it starts (explicit values in ``env`` are kept)."""
    out = dict(os.environ if env is None else env)
    for key, value in {**NVLS_OFF, **NCCL_ERRORS}.items():
        out.setdefault(key, value)
    return out


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, tqdm's redirection)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging(rank: int, level: int) -> None:
    root = logging.getLogger("fuselab")
    handler = next((h for h in root.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        root.addHandler(handler)
        root.propagate = False
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s", "%H:%M:%S"))
    # Rank 0 reports progress; the others only warnings and errors.
    root.setLevel(level if rank == 0 else max(level, logging.WARNING))


def resolve_device(device: Union[str, torch.device, None], local_rank: int = 0) -> torch.device:
    """``cuda``/``cpu``/None (CUDA when available) -> the device of this process (``cuda:LOCAL_RANK``)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu")
        index = local_rank if device.index is None else device.index
        count = torch.cuda.device_count()
        if index >= count:
            raise RuntimeError(f"local rank {local_rank} needs GPU {index}, but this node has {count} GPU(s): "
                               f"start at most {count} processes per node (torchrun --nproc_per_node)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise RuntimeError(f"unsupported device {device} (cpu or cuda)")
    return device


def init(device: Union[str, torch.device, None] = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
         backend: Optional[str] = None, log_level: int = logging.INFO) -> Runtime:
    """Join (or form) the process group of this job and return where this process runs.

    Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the group is rendezvoused through
    ``env://`` (torchrun's store, single- or multi-node); a plain process forms a group of one.
    ``device``: ``"cuda"`` (this process gets ``cuda:LOCAL_RANK``), ``"cpu"``, or None (CUDA if
    available). ``backend``: default NCCL on CUDA, gloo on the CPU. ``timeout_s``: the longest a
    collective may wait for a peer before the job fails. Calling ``init`` again returns the same
    runtime.
    """
    global _RUNTIME
    for key, value in {**NVLS_OFF, **NCCL_ERRORS}.items():
        os.environ.setdefault(key, value)  # before the first NCCL communicator exists
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched != ("RANK" in os.environ or "WORLD_SIZE" in os.environ):  # one process would train as one of several
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("WORLD_SIZE", "RANK")
        raise RuntimeError(f"{have}={os.environ[have]} is set but {lack} is not: start the ranks with torchrun (it "
                           f"sets both), or unset {have} for a single process")
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world if launched else 1)
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    _setup_logging(rank, log_level)
    if _RUNTIME is not None and dist.is_initialized():
        if (_RUNTIME.timeout, _RUNTIME.device) != (timeout, dev):
            logger.warning("init() again with collective timeout %.0f s and device %s: the group formed first keeps "
                           "%.0f s and %s (shutdown() first to change them)", timeout_s, dev,
                           _RUNTIME.timeout.total_seconds(), _RUNTIME.device)
        return _RUNTIME
    if not dist.is_initialized():
        if launched:
            # device_id binds the NCCL communicator to this GPU (and creates it now, not at the
            # first collective), so a wrong GPU count or a missing peer fails here.
            extra = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timeout, **extra)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:  # someone else formed the group (a test harness, a notebook): adopt it
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    _RUNTIME = Runtime(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       device=dev, backend=backend, timeout=timeout, launched=launched)
    logger.info("process group: %d rank(s) on %d node(s), backend %s, device %s, collective timeout %.0f s%s",
                world, _RUNTIME.num_nodes, backend, dev.type, timeout_s,
                "" if launched else " (a single process, not started by torchrun)")
    return _RUNTIME


def get_runtime() -> Runtime:
    """The runtime ``init`` returned (an error before ``init``)."""
    if _RUNTIME is None:
        raise RuntimeError("fuselab.distributed.init() has not been called in this process")
    return _RUNTIME


def shutdown() -> None:
    """Leave the process group after a successful run (every rank must call it).

    On an error path do not call it: exiting is enough (torchrun stops the other ranks), and a
    graceful teardown could wait on a peer that is gone.
    """
    global _RUNTIME
    if dist.is_initialized():
        # Garbage held in reference cycles (a finished DDP reducer, say) keeps the group and gloo's
        # pending work alive until interpreter exit, where freeing them aborted a rank now and then
        # ("terminate called without an active exception"): freed here, while the group is whole.
        gc.collect()
        # Every rank past its last collective before any tears down: a gloo rank that destroys
        # its group while a peer still uses its connections can abort the peer at exit.
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    _RUNTIME = None


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce(value: Union[float, torch.Tensor], op: str = "mean") -> Union[float, torch.Tensor]:
    """``value`` reduced over every rank (``mean``, ``sum``, ``max``, ``min``); a float in, a float out."""
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"op must be one of {list(ops)}, got {op!r}")
    as_float = not isinstance(value, torch.Tensor)
    rt = _RUNTIME
    device = rt.device if rt is not None else torch.device("cpu")
    t = torch.tensor(float(value), dtype=torch.float64, device=device) if as_float else value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=ops[op])
        if op == "mean":
            t = t / dist.get_world_size()
    return t.item() if as_float else t


def rank_zero_first(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank, global rank 0 first, then the first rank of each other node, then
    the rest: a download, extraction or cache that ``fn`` fills is written once per node, not
    raced by its ranks (with a shared filesystem, once in all)."""
    rt = _RUNTIME
    if rt is None or rt.world_size == 1:
        return fn()
    result = fn() if rt.rank == 0 else None
    barrier()
    if rt.rank != 0 and rt.local_rank == 0:
        result = fn()
    barrier()
    if rt.local_rank != 0:
        result = fn()
    return result
