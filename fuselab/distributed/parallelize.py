"""Data parallelism with PyTorch's own engines: FSDP2 (``fully_shard``) per block, or DDP.

``fully_shard_model`` follows the recipe of torchtitan's ``parallelize`` functions, in this order:
activation checkpointing on each block (optional), ``torch.compile`` of each block (optional),
``fully_shard`` on each block, then on the root (embeddings, final norm and head, tied or not).
Each block is one FSDP unit: its parameters are all-gathered just before its forward and
backward and freed after; gradients are reduce-scattered per block, overlapping the backward.

fuselab's fused layers: fuse before or after sharding. ``fuse_linear_relu`` after
``fully_shard_model`` converts a sharded layer in place (its class changes, its FSDP bookkeeping
stays), in transformers blocks that FSDP2 renamed too (``FSDPOPTDecoderLayer``). A fused layer
whose weight is still a sharded DTensor (called outside its FSDP unit's all-gather) raises
DTensor's error, naming ``fuselab.matmul_relu``. Sparse-gradient embeddings cannot be sharded
(FSDP2 reduce-scatters dense gradients): ``ddp_model`` takes them.
"""
import logging
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

logger = logging.getLogger("fuselab.distributed")

# Transformer blocks by class name (transformers' classes; no import of transformers needed).
KNOWN_BLOCKS: Set[str] = {
    "GPT2Block", "GPTNeoBlock", "GPTJBlock", "GPTNeoXLayer", "BloomBlock", "FalconDecoderLayer",
    "OPTDecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer", "MixtralDecoderLayer", "Qwen2DecoderLayer",
    "Qwen3DecoderLayer", "GemmaDecoderLayer", "Gemma2DecoderLayer", "Gemma3DecoderLayer", "PhiDecoderLayer",
    "Phi3DecoderLayer", "BertLayer", "RobertaLayer", "ViTLayer", "T5Block",
}
# torchvision ResNet: a stage (layer1..layer4) is an nn.Sequential of these.
RESNET_BLOCKS: Set[str] = {"BasicBlock", "Bottleneck"}

BlockTypes = Optional[Iterable[Union[str, Type[nn.Module]]]]


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside torch.compile's and checkpoint_wrapper's wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None:
            inner = getattr(module, "_checkpoint_wrapped_module", None)
        if inner is None:
            return module
        module = inner


def _type_name(module: nn.Module) -> str:
    # FSDP swaps a sharded module's class for FSDP<name>(FSDPModule, <name>): skip those
    return next(c.__name__ for c in type(_unwrapped(module)).__mro__ if not c.__name__.startswith("FSDP"))


def _outermost(model: nn.Module, match) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every module ``match`` accepts, not descending into the ones taken."""
    found: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module):
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if match(child):
                found.append((full, child))
            else:
                visit(full, child)

    visit("", model)
    return found


def find_blocks(model: nn.Module, block_types: BlockTypes = None) -> List[Tuple[str, nn.Module]]:
    """The (name, module) pairs that become one FSDP unit each, in model order.

    ``block_types``: classes or class names; by default a known transformer block (GPT2Block,
    OPT/Llama/Mistral/Qwen decoder layers, ...), else torchvision ResNet stages (the Sequentials of
    BasicBlock/Bottleneck), else the children of the largest ModuleList/Sequential whose children
    all have one class. Raises ValueError naming the model when nothing qualifies.
    """
    if block_types is not None:
        names = {t if isinstance(t, str) else t.__name__ for t in block_types}
        found = _outermost(model, lambda m: _type_name(m) in names)
        if not found:
            raise ValueError(f"no module of type {sorted(names)} in {type(model).__name__}")
        return found
    found = _outermost(model, lambda m: _type_name(m) in KNOWN_BLOCKS)
    if found:
        return found

    def resnet_stage(m):
        kids = list(_unwrapped(m).children())
        return isinstance(_unwrapped(m), nn.Sequential) and kids and all(_type_name(k) in RESNET_BLOCKS for k in kids)

    found = _outermost(model, resnet_stage)
    if found:
        return found
    best, best_params = None, 0
    for name, m in model.named_modules():
        kids = list(m.children())
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2 and len({type(k) for k in kids}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = (name, m), n
    if best is not None:
        return [(f"{best[0]}.{i}" if best[0] else str(i), k) for i, k in enumerate(best[1].children())]
    if isinstance(model, torch.fx.GraphModule):  # fuse_linear_relu's torch.fx path flattens the blocks away
        raise ValueError(f"no block to shard in {type(model).__name__}, a torch.fx GraphModule (fuse_linear_relu's fx "
                         "path returns one: its blocks are inlined): shard the model itself; fuse_linear_relu after "
                         "sharding fuses by module patching only (nn.Sequential pairs, known transformers blocks)")
    raise ValueError(f"no transformer block or repeated layer found in {type(model).__name__}: pass block_types=")


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.register_module(attr, new)


def wrap_blocks(model: nn.Module, *, block_types: BlockTypes = None, activation_checkpointing: bool = False,
                compile_blocks: bool = False, compile_options: Optional[dict] = None) -> List[nn.Module]:
    """Activation checkpointing and/or ``torch.compile`` on each block, in place; returns the
    (wrapped) blocks. The first step of ``fully_shard_model``, also useful without sharding
    (one GPU). Wrappers change ``model.state_dict()`` keys (``_orig_mod.``,
    ``_checkpoint_wrapped_module.``); ``torch.distributed.checkpoint.state_dict`` (what
    ``Checkpointer`` uses) strips them, so checkpoints load with or without wrappers."""
    blocks = []
    for name, block in find_blocks(model, block_types):
        new = block
        if activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

            # Non-reentrant: works with torch.compile and with FSDP's hooks; the block's forward
            # is recomputed in the backward (RNG state replayed, so dropout masks match).
            new = checkpoint_wrapper(new, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compile_blocks:
            # A wrapper module (as torchtitan does), so FSDP's hooks run around the compiled
            # forward rather than inside the traced graph. The blocks share one compiled graph.
            new = torch.compile(new, **(compile_options or {}))
        if new is not block:
            _set_submodule(model, name, new)
        blocks.append(new)
    return blocks


def mixed_precision_policy(mixed_precision: bool = True, param_dtype: torch.dtype = torch.bfloat16,
                           reduce_dtype: torch.dtype = torch.float32):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not mixed_precision:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def fully_shard_model(model: nn.Module, *, block_types: BlockTypes = None, mixed_precision: bool = True,
                      param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
                      activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                      compile_blocks: bool = False, compile_options: Optional[dict] = None, mesh=None) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh`` (default: every rank), one unit per block, then the root.

    Args:
        block_types: classes or class names of the blocks (default: found, see ``find_blocks``).
        mixed_precision: parameters all-gathered and computed in ``param_dtype`` (bf16), gradients
            reduce-scattered in ``reduce_dtype`` (fp32); the sharded master copy and the optimizer
            stay fp32. False: everything fp32.
        activation_checkpointing: recompute each block's forward in its backward (memory for time).
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3;
            gathered again for the backward) or keep them until the backward (ZeRO-2: memory for
            one all-gather less per block). The last block and the root keep theirs either way:
            the backward starts with them.
        compile_blocks: ``torch.compile`` each block (``compile_options``: its keyword arguments).
    Returns ``model``, sharded in place (its class becomes an ``FSDPModule``): build the optimizer
    afterwards, from ``model.parameters()`` (DTensor shards). Needs ``init()`` (a process group).
    """
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("fully_shard_model needs a process group: call fuselab.distributed.init() first")
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:  # FSDP2 reduce-scatters dense gradients only: its backward fails deep inside otherwise
        raise ValueError(f"FSDP2 cannot shard sparse-gradient embeddings ({', '.join(sparse[:3])}"
                         f"{', ...' if len(sparse) > 3 else ''}: sparse=True): use ddp_model (SparseAdamW works "
                         "there) or sparse=False")
    if mesh is None:
        from fuselab.distributed.runtime import _RUNTIME

        device_type = _RUNTIME.device.type if _RUNTIME is not None else (
            "cuda" if next(model.parameters()).is_cuda else "cpu")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    blocks = wrap_blocks(model, block_types=block_types, activation_checkpointing=activation_checkpointing,
                         compile_blocks=compile_blocks, compile_options=compile_options)
    shared = _shared_across_blocks(blocks)
    if shared:  # FSDP2 shards a parameter in one unit: another unit's use fails deep inside ("value was None")
        more = ", ..." if len(shared) > 3 else ""
        raise ValueError(f"parameters shared between blocks ({', '.join(shared[:3])}{more}): FSDP2 shards each in one "
                         "unit; move the shared module out of the blocks (it is then sharded with the root) or pass "
                         "block_types that keep its users in one block")
    mp = mixed_precision_policy(mixed_precision, param_dtype, reduce_dtype)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=bool(reshard_after_forward) and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    logger.info("FSDP2: %d %s block(s) + root over %d rank(s)%s%s%s", len(blocks),
                _type_name(blocks[0]) if blocks else "-", mesh.size(),
                ", bf16 params / fp32 reduce" if mixed_precision else ", fp32",
                ", activation checkpointing" if activation_checkpointing else "",
                ", compiled blocks" if compile_blocks else "")
    return model


def _shared_across_blocks(blocks: List[nn.Module]) -> List[str]:
    """Names (in the first block holding them) of parameters that two of ``blocks`` hold."""
    owner: Dict[int, Tuple[int, str]] = {}
    shared = []
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (i, name))
            if first[0] != i and first[1] not in shared:
                shared.append(first[1])
    return shared


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def ddp_model(model: nn.Module, *, always: bool = False, **ddp_kwargs) -> nn.Module:
    """``DistributedDataParallel(model)`` on this process's device (the model must be on it already).

    At world size 1 the model comes back unwrapped (nothing to synchronize) unless ``always``.
    ``ddp_kwargs`` go to DDP (``bucket_cap_mb``, ``gradient_as_bucket_view``, ...).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        if always:
            raise RuntimeError("ddp_model(always=True) needs a process group: call fuselab.distributed.init()")
        return model
    if dist.get_world_size() == 1 and not always:
        return model
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    return DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (``module``) and torch.compile (``_orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) if isinstance(model, nn.parallel.DistributedDataParallel) else None
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def sharded_fraction(model: nn.Module) -> Sequence[Tuple[str, int, int]]:
    """(name, local elements, global elements) of every parameter: what this rank holds."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        local = p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        out.append((name, local, p.numel()))
    return out
