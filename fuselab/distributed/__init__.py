"""fuselab.distributed: data-parallel training on PyTorch's own engine (torchrun, FSDP2, DDP, DCP).

    from fuselab import distributed as fd

    rt = fd.init()                                  # torchrun's environment, or one plain process
    model = fd.fully_shard_model(model)             # FSDP2 per transformer block, bf16 / fp32 reduce
    ckpt = fd.Checkpointer("ckpt", keep=3)          # DCP: resumable at another world size
    ...
    fd.shutdown()
"""
from fuselab.distributed.checkpoint import Checkpointer, rng_state, set_rng_state
from fuselab.distributed.parallelize import (
    KNOWN_BLOCKS,
    ddp_model,
    find_blocks,
    fully_shard_model,
    is_sharded,
    mixed_precision_policy,
    sharded_fraction,
    unwrap,
    wrap_blocks,
)
from fuselab.distributed.runtime import (
    NVLS_OFF,
    Runtime,
    all_reduce,
    barrier,
    get_runtime,
    init,
    launch_environment,
    rank_zero_first,
    resolve_device,
    shutdown,
)

__all__ = [
    "Checkpointer", "KNOWN_BLOCKS", "NVLS_OFF", "Runtime", "all_reduce", "barrier", "ddp_model", "find_blocks",
    "fully_shard_model", "get_runtime", "init", "is_sharded", "launch_environment", "mixed_precision_policy",
    "rank_zero_first", "resolve_device", "rng_state", "set_rng_state", "sharded_fraction", "shutdown", "unwrap",
    "wrap_blocks",
]
