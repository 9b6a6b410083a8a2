"""Resumable training checkpoints over ``torch.distributed.checkpoint`` (DCP).

One checkpoint is a folder ``step_00001000/`` written by every rank at once (each writes its own
shards; DCP records the global layout in ``.metadata``). It holds:

    model, optim   ``get_state_dict(model, optimizer)``: keys as in the unwrapped model (no
                   ``module.``/``_orig_mod.``/checkpoint-wrapper prefixes), FSDP shards as DTensors
    optim_groups   the parameter groups' settings of an optimizer with no per-parameter state (in place of optim)
    scheduler      the LR scheduler's ``state_dict()``
    train_state    step, world size and what the caller adds (the data position): JSON
    rng_rank<r>    each rank's Python/NumPy/torch/CUDA generator states

Because DCP stores global tensor layouts, a checkpoint written by N ranks loads on M ranks with
any sharding (FSDP, DDP, or one plain process): DCP reshards while reading. RNG states are
restored only at the same world size (elsewhere there is no rank to give them to), and only by a resume (a
checkpoint of the Checkpointer's own folder).

Crash safety: a checkpoint is written into ``.tmp-step_<n>/`` and renamed to ``step_<n>/`` by
rank 0 once DCP has finished (its ``.metadata`` is written last, after every rank's data); a
process killed mid-save leaves only a temporary folder, which ``latest()`` never returns and
the next save deletes. A checkpoint is *whole* when its ``.metadata`` reads and every data file it names
is there at the length it says; ``load()`` resumes from the newest whole one (warning of damaged ones
after it; refusing where there are only damaged ones), and ``keep`` whole checkpoints are kept, every
step folder before them deleted, damaged ones too. A run resumed from an earlier checkpoint of this
folder (``load(path=...)``) that saves again renames every later one ``abandoned-step_<n>/``: they are
kept, but never resumed from or counted (the resumed step saved again is replaced); a Checkpointer that has
loaded nothing from its folder refuses to save into it while it holds checkpoints it did not write (another
run's). A relative folder is fixed when the Checkpointer is made. Every rank must see the same
folder (one node, or a shared filesystem across nodes).
``train_state`` must be the same on every rank (it is saved once); an optimizer that has not stepped yet is
saved without per-parameter state (its groups' settings, such as a scheduled lr, are saved). The optimizer's
class and parameter groups are recorded, and ``load`` refuses an optimizer of another class or grouping (DCP
would load the state by parameter name into it).

``async_save=True`` uses ``dcp.async_save``: the state is copied to host memory, training goes
on while a background thread writes it (over a separate gloo group), and the rename happens when
the write completes. ``wait()`` (also called by the next ``save`` and ``close``) waits for it.
"""
import json
import logging
import numbers
import os
import pickle
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger("fuselab.distributed")

PREFIX = "step_"
TMP = ".tmp-"
ABANDONED = "abandoned-"  # checkpoints past the step a resumed run saved again
INFO = "info.json"
LAYOUT = "fuselab_optimizer_layout"  # the train state's record of the optimizer's class and groups
SCHEDULER = "fuselab_scheduler_class"  # and of the LR scheduler's class
GROUPS = "optim_groups"  # the checkpoint's entry of an optimizer's group settings where it has no state to save


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def rng_state() -> Dict[str, Any]:
    """This process's generator states: Python, NumPy (if installed), torch CPU, current CUDA device."""
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _json_problem(value: Any, where: str, within: tuple = ()) -> Optional[str]:
    """What in ``value`` JSON would not give back as it is (an int key comes back a string, a tuple a list, a
    tensor not at all), or None: ``train_state`` is read back from JSON."""
    if isinstance(value, (dict, list)):
        if any(value is outer for outer in within):
            return f"{where} contains itself"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, str):
                return f"{where} has the key {key!r} ({type(key).__name__}): JSON gives keys back as strings"
            problem = _json_problem(item, f"{where}[{key!r}]", (*within, value))
            if problem:
                return problem
        return None
    if value is None or isinstance(value, (str, int, float)):  # bool is an int; NumPy's float64 a float
        return None
    kind = type(value)
    scalar = isinstance(value, torch.Tensor) or kind.__module__ == "numpy"
    return (f"{where} is a {kind.__module__}.{kind.__qualname__}: JSON would not give it back as it is"
            + (" (a NumPy or tensor scalar: .item() it)" if scalar else ""))


def _check_save_arguments(step: Any, train_state: Optional[Dict[str, Any]], asynchronous: bool) -> None:
    """Raise on every rank if any rank's ``step`` is not an int >= 0 or its ``train_state`` sets a key the checkpoint
    records itself (ValueError) or holds what JSON would not give back (TypeError; see ``_json_problem``), and
    ValueError if they differ between ranks: they are saved once (rank 0's) and every rank gets that back, so a
    per-rank value (a rank's own data position) would silently become rank 0's; also if ``asynchronous`` (the
    save's async_save) differs (the ranks would wait in different collectives). One collective: a rank that
    raised alone would leave the others waiting in the next."""
    problem, encoded = None, None
    reserved = sorted({"step", "world_size", "time", LAYOUT, SCHEDULER} & set(train_state or {}))
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        problem = ("ValueError", f"step must be an int >= 0, got {step!r}")
    elif reserved:
        problem = ("ValueError", f"train_state may not set {reserved}: the checkpoint records them itself")
    else:
        state = {"step": int(step), **(train_state or {})}
        found = _json_problem(state, "train_state")
        if not found:
            try:  # what the walk passes can still fail to encode (an int of more digits than Python writes)
                encoded = json.dumps(state, sort_keys=True)
            except (ValueError, RecursionError) as e:
                found = f"train_state cannot be written as JSON ({type(e).__name__}: {e})"
        if found:
            problem = ("TypeError", f"{found}; train_state holds dicts with string keys, lists, strings, numbers, "
                                    "bools and None")
    states: List[Any] = [(problem, encoded, asynchronous)]
    if _world() > 1:  # gathered even where this rank's is refused: no rank waits alone
        states = [None] * _world()
        dist.all_gather_object(states, (problem, encoded, asynchronous))
    refused = [(rank, p) for rank, (p, _, _) in enumerate(states) if p]
    if refused:
        rank, (kind, message) = refused[0]
        raise (TypeError if kind == "TypeError" else ValueError)(
            message if len(states) == 1 else f"rank {rank}'s {message}")
    if any(a != states[0][2] for _, _, a in states):
        raise ValueError(f"save()'s async_save differs between ranks ({[a for _, _, a in states]}): every rank must "
                         "save the same way")
    if any(other[1] != states[0][1] for other in states):
        decoded = [json.loads(state) for _, state, _ in states]
        # compared as written, not as Python values: True and 1 (or 1 and 1.0) are equal but saved differently
        def written(d, k):
            return json.dumps(d[k], sort_keys=True) if k in d else "(missing)"

        keys = sorted({k for d in decoded for k in set(d) | set(decoded[0]) if written(d, k) != written(decoded[0], k)})
        rank = next(r for r, d in enumerate(decoded) if written(d, keys[0]) != written(decoded[0], keys[0]))
        raise ValueError(f"save()'s step and train_state differ between ranks in {keys} ({keys[0]!r}: rank 0 "
                         f"{written(decoded[0], keys[0])[:60]}, rank {rank} {written(decoded[rank], keys[0])[:60]}): "
                         "they are saved once and every rank gets rank 0's back; keep per-rank positions derivable "
                         "from shared values (e.g. the samples seen in all)")


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective; the value itself where there is one process)."""
    if _world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _state_to_load_into(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
    """``get_state_dict(model, optimizer)`` with the optimizer's per-parameter state made for every parameter (what DCP
    loads into). torch makes it by a step at lr 0 only where no parameter holds a gradient: gradients left over (a
    forward and backward before the resume) would make it skip that, and the checkpoint's optimizer state would
    silently not be loaded. They are set aside meanwhile."""
    if optimizer is None:
        return get_state_dict(model, [])
    grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    if not optimizer.state:
        for p in grads:
            p.grad = None
    try:
        return get_state_dict(model, optimizer)
    finally:
        for p, grad in grads.items():
            p.grad = grad


def _check_optimizer_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ValueError for an optimizer holding tensors that are not the model's parameters: one built before
    fully_shard_model (whose parameters it replaces) steps tensors the model no longer uses, and trains nothing."""
    own = {id(p) for p in model.parameters()}
    others = sum(id(p) not in own for group in optimizer.param_groups for p in group["params"])
    if others:
        raise ValueError(f"the optimizer holds {others} tensor(s) that are not parameters of the model: built before "
                         "fully_shard_model (which replaces the parameters)? Build it after sharding; nothing was "
                         "saved or loaded")


def _saved_part(optim_state: Dict[str, Any], saved: set, path: Path) -> Dict[str, Any]:
    """``optim_state`` without the per-parameter state the checkpoint does not hold (a parameter that had no gradient
    before the save, a head used later, has none); ValueError where it holds state entries this optimizer does not
    keep (other settings), RuntimeError where it holds state for parameters ``optim_state`` has no place for (an
    optimizer that has stepped but not on those parameters)."""
    kept = {name: {k: v for k, v in per_param.items() if f"optim.state.{name}.{k}" in saved}
            for name, per_param in optim_state["state"].items()}
    prefix = "optim.state."
    entries = {}  # the checkpoint's state entries, by parameter
    for key in saved:
        if key.startswith(prefix):
            name, entry = key[len(prefix):].rsplit(".", 1)
            entries.setdefault(name, set()).add(entry)
    params = {name for group in optim_state["param_groups"] for name in group["params"]}
    extra = sorted({e for name, found in entries.items() if name in params
                    for e in found - set(optim_state["state"].get(name, ()))})
    if extra:  # amsgrad's max_exp_avg_sq, SGD's momentum_buffer: the loaded settings would ask for what is dropped
        raise ValueError(f"{path} holds optimizer state ({', '.join(extra)}) that this optimizer does not keep: it was "
                         "saved with other settings (amsgrad, momentum, ...); build the optimizer as the saved run "
                         "did, or load the model alone (optimizer=None)")
    missing = sorted({k[len(prefix):].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)} - set(kept))
    if missing:
        raise RuntimeError(f"{path} holds optimizer state for {', '.join(missing[:5])} that this optimizer has no "
                           "state for: it has stepped without them; load into a freshly built optimizer")
    return {**optim_state, "state": {name: entry for name, entry in kept.items() if entry}}


def _diverged_buffers(model: torch.nn.Module) -> List[str]:
    """The saved buffers (plain tensors, not DTensor shards) whose values differ between ranks: a checkpoint holds
    one copy of each, so every rank resumes with one rank's (FSDP keeps no buffer in step: BatchNorm's statistics)."""
    if _world() == 1:
        return []
    named = [(f"{prefix}.{name}" if prefix else name, b) for prefix, m in model.named_modules()
             for name, b in m._buffers.items()
             if b is not None and name not in m._non_persistent_buffers_set and type(b) is torch.Tensor
             and b.layout == torch.strided]
    if not named:
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # compared bit for bit (the bytes' max and min over ranks): any dtype, NaN equal to itself
    flat = torch.cat([b.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for _, b in named])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    differs = high != low
    out, start = [], 0
    for name, b in named:
        size = b.numel() * b.element_size()
        if differs[start:start + size].any():
            out.append(name)
        start += size
    return out


_WRAPPERS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}  # DDP, compile, AC, FSDP1


def _optimizer_layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's class and which parameters (by their unwrapped names) each of its groups holds: what a
    checkpoint's optimizer state means, and what DCP's loading by name does not check."""
    names = {id(p): ".".join(part for part in name.split(".") if part not in _WRAPPERS)
             for name, p in model.named_parameters(remove_duplicate=False)}
    return {"class": _class_name(optimizer),
            "groups": [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]}


def _layout_change(saved: Dict[str, Any], now: Dict[str, Any]) -> Optional[str]:
    if saved["class"] != now["class"]:
        return (f"the checkpoint's optimizer is {saved['class']}, this one {now['class']}: its state would drive "
                "another update rule")
    if [sorted(g) for g in saved["groups"]] != [sorted(g) for g in now["groups"]]:
        sizes = lambda groups: ", ".join(str(len(g)) for g in groups)  # noqa: E731
        return (f"the checkpoint's optimizer has {len(saved['groups'])} parameter group(s) of {sizes(saved['groups'])} "
                f"parameters, this one {len(now['groups'])} of {sizes(now['groups'])} (or the same sizes holding other "
                "parameters): each group's rate and weight decay would apply to other parameters")
    return None


def _data_sizes(metadata) -> Dict[str, int]:
    """The length each data file of a checkpoint must have, from its DCP metadata (file name -> bytes)."""
    needed: Dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    return needed


def _short_files(path: Path, needed: Dict[str, int]) -> Optional[str]:
    """What is missing from checkpoint ``path`` given its data files' lengths (truncated by a full disk or a
    partial copy: DCP's own error names neither file nor checkpoint, a zip reader's "central directory"), or
    None."""
    short = []
    for name, size in sorted({**needed, INFO: 1}.items()):
        try:
            have = (path / name).stat().st_size if (path / name).is_file() else None
        except OSError:  # gone meanwhile
            have = None
        if have is None or have < size:
            short.append(f"{name} ({'missing' if have is None else f'{have} bytes, {size} expected'})")
    return f"{path} is damaged: {'; '.join(short)}" if short else None


def _first_failure(error: "CheckpointException") -> str:
    """The first rank's failure of a DCP CheckpointException, as one line."""
    for failure in (getattr(error, "failures", None) or {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack summary)
        return f"{type(cause).__name__}: {str(cause).strip()}"
    return str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _raise_everywhere(final: Path, errors: List[BaseException]) -> None:
    """Rank 0 publishes a checkpoint: every rank learns whether it did, and all raise (``errors``: rank 0's) or
    none."""
    failure = [repr(errors[0]) if errors else None]
    if _world() > 1:
        dist.broadcast_object_list(failure, src=0)
    _barrier()
    if errors:
        raise RuntimeError(f"checkpoint {final} was written but not published") from errors[0]
    if failure[0] is not None:
        raise RuntimeError(f"checkpoint {final} was written but not published (on rank 0: {failure[0]})")


class Checkpointer:
    """Save and resume ``model``/``optimizer``/``scheduler``/train state under ``directory``.

        ckpt = Checkpointer("ckpt/run1", keep=3)
        state = ckpt.load(model, optimizer, scheduler)      # None when there is none yet
        start = state["step"] if state else 0
        ...
        ckpt.save(step, model, optimizer, scheduler, train_state={"tokens_seen": n})
        ckpt.close()

    Every rank must call ``save``/``load`` (they are collective). Build the optimizer (and
    scheduler) before ``load``: their states are loaded in place.
    """

    def __init__(self, directory, *, keep: Optional[int] = 3, async_save: bool = False):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 (or None: keep all), got {keep!r}")
        self.dir = Path(directory).absolute()  # fixed here: a later os.chdir does not move it
        self.keep = keep
        self.async_save = async_save
        self._pending: Optional[Tuple[Any, Path, Path, threading.Event]] = None
        self._group = None
        self._resumed_from: Optional[int] = None  # the step load() restored: this run's line starts there
        self._saved: set = set()  # steps this Checkpointer wrote
        self._sizes: Dict[Path, Tuple[tuple, Dict[str, int]]] = {}  # folder -> (its .metadata's stat, _data_sizes)
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        if async_save and dist.is_initialized():
            # The background thread's collectives get their own gloo group: no NCCL work from a
            # second thread racing the training stream (what torchtitan does too).
            self._group = dist.new_group(backend="gloo")
        _barrier()

    # -- finding checkpoints ------------------------------------------------------------------

    def checkpoints(self) -> List[Tuple[int, Path]]:
        """(step, folder) of every checkpoint with a ``.metadata``, oldest first (``latest()``: the newest whole
        one, which ``load()`` resumes from)."""
        return [(n, p) for n, p in self._step_folders() if (p / ".metadata").exists()]

    def _step_folders(self) -> List[Tuple[int, Path]]:
        """(step, folder) of every ``step_<n>`` folder, complete or damaged (no .metadata), oldest first."""
        if not self.dir.is_dir():
            return []
        named = ((p, p.name[len(PREFIX):]) for p in self.dir.glob(f"{PREFIX}*") if p.is_dir())
        return sorted((int(n), p) for p, n in named if n.isascii() and n.isdigit())

    def latest(self) -> Optional[Path]:
        """The checkpoint ``load()`` resumes from: the newest whole one (None if there is none)."""
        return self._newest_whole()[0]

    def _newest_whole(self) -> Tuple[Optional[Path], List[str]]:
        """The newest whole checkpoint (``_problem``), or None, and what is wrong with the folders after it."""
        damaged = []
        for _, path in reversed(self._step_folders()):
            problem = self._problem(path)
            if problem is None:
                return path, damaged
            damaged.append(problem[1])
        return None, damaged

    def _problem(self, path: Path) -> Optional[Tuple[type, str]]:
        """None where checkpoint ``path`` is whole: its ``.metadata`` reads, and its data files and info.json are
        there at their lengths; else (the exception to raise, its message). Pruning and ``latest()`` parse a
        ``.metadata`` once per version (a large model's is megabytes; ``load`` reads the one it loads again)."""
        meta = path / ".metadata"
        try:  # a folder renamed or pruned meanwhile (rank 0's commit) reads as missing, not as an OSError
            st = meta.stat()
        except OSError:
            if not path.exists():
                return FileNotFoundError, f"{path} does not exist"
            return FileNotFoundError, f"{path} is not a complete checkpoint (no .metadata)"
        version = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        cached = self._sizes.get(path)
        if cached is None or cached[0] != version:
            try:
                cached = self._sizes[path] = (version, _data_sizes(dcp.FileSystemReader(str(path)).read_metadata()))
            except Exception as e:  # noqa: BLE001  a truncated or foreign .metadata: name the checkpoint
                return RuntimeError, f"could not read {meta}: {type(e).__name__}: {e}"
        short = _short_files(path, cached[1])
        return (RuntimeError, short) if short else None

    def train_state(self, path=None) -> Optional[Dict[str, Any]]:
        """The train state (``step``, ``world_size`` and what ``save`` was given) of the latest (or ``path``'s)
        checkpoint, read without loading it (a resume can check it first); None when there is none."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        try:
            return json.loads((path / INFO).read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"could not read {path / INFO}: {type(e).__name__}: {e}") from e

    # -- saving -------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
             scheduler=None, train_state: Optional[Dict[str, Any]] = None, *,
             async_save: Optional[bool] = None) -> Path:
        """Write a checkpoint of ``step`` (collective); returns its final folder. With ``async_save`` (this call's;
        default: the Checkpointer's) it returns once the state is staged in host memory. ValueError for a step
        that is not an int >= 0, or a step or ``train_state`` that differs between ranks, TypeError for a
        ``train_state`` that JSON would not give back as it is (before anything is written)."""
        asynchronous = self.async_save if async_save is None else bool(async_save)
        _check_save_arguments(step, train_state, asynchronous)
        if optimizer is not None:
            _check_optimizer_of(model, optimizer)
        self.wait()
        # Checkpoints of a line this Checkpointer did not load from (another run's) are never replaced, set aside or
        # joined (a second Checkpointer of one run: save through the first, with async_save per call)
        foreign = _from_rank0([n for n, _ in self.checkpoints() if n not in self._saved]
                              if self._resumed_from is None and _rank() == 0 else [])
        if foreign:  # rank 0's view: every rank raises
            raise ValueError(f"{self.dir} holds checkpoints of step(s) {', '.join(map(str, foreign[:5]))} that this "
                             "Checkpointer neither loaded nor wrote (another run's, or this run's before a restart "
                             f"without resuming): saving step {step} would replace, set aside or mix with them; load() "
                             "first to continue that run, or save into another directory")
        final = self.dir / f"{PREFIX}{step:08d}"
        own = int(step) in self._saved  # saved again by this run: replaced; else (a rollback's old line) set aside
        tmp = self.dir / f"{TMP}{final.name}"
        if _rank() == 0:
            for stale in self.dir.glob(f"{TMP}*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        info = {"step": int(step), "world_size": _world(), "time": time.time(), **(train_state or {})}
        if optimizer is not None:
            info[LAYOUT] = _optimizer_layout(model, optimizer)
        if scheduler is not None:
            info[SCHEDULER] = _class_name(scheduler)
        diverged = _diverged_buffers(model)
        if diverged and _rank() == 0:
            logger.warning("buffers differ between ranks (%s%s): the checkpoint keeps one rank's copy, and a resume "
                           "gives it to every rank; synchronize them before saving (broadcast from rank 0, as "
                           "experiments/train_ddp.py's sync_buffers) or use SyncBatchNorm", ", ".join(diverged[:5]),
                           ", ..." if len(diverged) > 5 else "")
        state: Dict[str, Any] = {"train_state": json.dumps(info), f"rng_rank{_rank()}": pickle.dumps(rng_state())}
        # An optimizer that has not stepped has no state to save: get_state_dict would make one by stepping it
        # (AdamW's step count would start at 1 and its first real update come out smaller).
        stepped = optimizer is not None and bool(optimizer.state)
        msd, osd = get_state_dict(model, optimizer if stepped else [])
        state["model"] = msd
        if stepped:
            state["optim"] = osd
        elif optimizer is not None:  # its groups' settings count: SGD without momentum keeps no state, but an lr
            state[GROUPS] = pickle.dumps([{k: v for k, v in g.items() if k != "params"}
                                          for g in optimizer.param_groups])
        if scheduler is not None:
            state["scheduler"] = pickle.dumps(scheduler.state_dict())
        t0 = time.perf_counter()
        if asynchronous:
            if self._group is None and dist.is_initialized():  # every rank takes this branch: a collective is fine
                self._group = dist.new_group(backend="gloo")
            response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            future = getattr(response, "upload_completion", response)  # newer torch: AsyncSaveResponse
            done, errors = threading.Event(), []

            def commit(fut):
                try:
                    if fut.exception() is None and _rank() == 0:
                        self._commit(tmp, final, info, own)
                        logger.info("checkpoint %s written (async, %.1f s)", final, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001  raised by wait(), on every rank
                    logger.exception("committing checkpoint %s failed", final)
                    errors.append(e)
                finally:
                    done.set()

            future.add_done_callback(commit)
            self._pending = (future, final, done, errors)
            logger.info("checkpoint of step %d staged in %.1f s; writing in the background", step,
                        time.perf_counter() - t0)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            error = None
            if _rank() == 0:
                try:
                    self._commit(tmp, final, info, own)
                except Exception as e:  # noqa: BLE001  raised below, on every rank
                    error = e
            _raise_everywhere(final, [error] if error is not None else [])
            logger.info("checkpoint %s written in %.1f s", final, time.perf_counter() - t0)
        self._saved.add(int(step))
        return final

    def _commit(self, tmp: Path, final: Path, info: Dict[str, Any], own: bool) -> None:
        """Rank 0, after DCP finished: publish ``tmp`` as ``final`` (atomic rename), prune old ones. ``own``: a
        checkpoint of this step already there is this Checkpointer's (replaced), not an abandoned line's."""
        with open(tmp / INFO, "w") as f:  # DCP syncs its files; this one too (a whole checkpoint needs it)
            f.write(json.dumps(info, indent=1))
            f.flush()
            os.fsync(f.fileno())
        problem = self._problem(tmp)  # another rank's files elsewhere: its own folder, not one shared with rank 0
        if problem is not None:
            raise RuntimeError(f"{problem[1]} (every rank must write into the same folder: one node, or a "
                               "filesystem shared by all nodes); not published, nothing pruned")
        old = None
        step = info["step"]
        if final.exists() and own:  # the same step saved again: move the old one aside first
            old = final.with_name(f"{TMP}old-{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        # the old line's checkpoints from this step on and, after a resume, from the step resumed from on (not this
        # line's own), complete or damaged
        resumed = self._resumed_from
        later = [(n, path) for n, path in self._step_folders()
                 if n >= step or (resumed is not None and n > resumed and n not in self._saved)]
        for n, path in later:
            aside, again = path.with_name(f"{ABANDONED}{path.name}"), 1
            while aside.exists():  # abandoned before, by another rollback
                aside, again = path.with_name(f"{ABANDONED}{again}-{path.name}"), again + 1
            os.replace(path, aside)
            self._sizes.pop(path, None)
        if later:
            since = f" after resuming from step {resumed}" if resumed is not None else ""
            logger.warning("step %d saved%s: the later folder(s) of steps %s are renamed %s* (kept, and never resumed "
                           "from or pruned)", step, since, ", ".join(str(n) for n, _ in later), ABANDONED)
        os.replace(tmp, final)
        self._sizes[final] = self._sizes.pop(tmp)  # the .metadata read to check tmp above: the same file
        _fsync_dir(self.dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.keep is not None:
            kept = 0  # the newest `keep` whole checkpoints; folders before them go, damaged ones too
            for n, path in reversed(self._step_folders()):
                kept += self._problem(path) is None
                if kept == self.keep:
                    for m, older in self._step_folders():
                        if m < n:
                            shutil.rmtree(older, ignore_errors=True)
                            self._sizes.pop(older, None)
                    break

    def wait(self) -> None:
        """Block until a pending asynchronous save is written and published (re-raises its error)."""
        if self._pending is None:
            return
        future, final, done, errors = self._pending
        self._pending = None
        future.result()
        done.wait()
        _raise_everywhere(final, errors)

    def close(self) -> None:
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # -- loading ------------------------------------------------------------------------------

    def load(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, scheduler=None,
             path=None) -> Optional[Dict[str, Any]]:
        """Load the latest (or ``path``'s) checkpoint into ``model``/``optimizer``/``scheduler``
        in place, restore RNG states (same world size only), and return its train state (``step``,
        ``world_size`` and what ``save`` was given); None when there is no checkpoint.

        A load of a checkpoint of this folder is a resume: this run continues from the loaded step (the next
        save sets the later ones aside; saving the loaded step again replaces it) and this process's random
        generators continue from theirs. A checkpoint of another folder (``path``: a warm start, or an evaluation
        through another Checkpointer) leaves the generators as they are. An optimizer saved without per-parameter
        state (before its first step, or one that keeps none) gets its parameter groups' settings back."""
        self.wait()
        if optimizer is not None:
            _check_optimizer_of(model, optimizer)
        in_folder = path is None  # this folder's checkpoint (a resume of this run), or another's (a warm start)
        # Rank 0 decides what is loaded and every rank follows (ranks reading a shared filesystem at different
        # moments could otherwise load different checkpoints, or one raise while the others wait in DCP's load)
        if path is not None:
            path = Path(path)
            in_folder = path.absolute().parent.resolve() == self.dir.resolve()  # a linked step folder is this one's
            problem = _from_rank0(self._problem(path) if _rank() == 0 else None)
            if problem is not None:
                raise problem[0](problem[1])
        else:
            path, damaged = _from_rank0(self._newest_whole() if _rank() == 0 else None)
            if damaged and path is None:  # starting from scratch would silently restart the run
                raise RuntimeError(f"{self.dir} holds no checkpoint to resume from, only damaged ones: "
                                   f"{'; '.join(damaged)}; move them away to start from scratch, or repair them")
            if damaged:
                logger.warning("damaged checkpoints: %s; resuming from %s, the latest whole one before them",
                               "; ".join(damaged), path.name)
        if path is None:
            logger.info("no checkpoint in %s: starting from scratch", self.dir)
            return None
        try:
            saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        except Exception as e:  # noqa: BLE001  changed since it was checked
            raise RuntimeError(f"could not read {path / '.metadata'}: {type(e).__name__}: {e}") from e
        t0 = time.perf_counter()
        with_optim = optimizer is not None and any(k.startswith("optim.") for k in saved)
        with_groups = optimizer is not None and not with_optim and GROUPS in saved
        layout = (self.train_state(path) or {}).get(LAYOUT) if with_optim or with_groups else None
        change = layout and _layout_change(layout, _optimizer_layout(model, optimizer))
        if change:  # DCP would load the state by parameter name into whatever groups and rule this optimizer has
            raise ValueError(f"{path}: {change}; build the optimizer as the saved run did, or load the model "
                             "alone (optimizer=None)")
        saved_scheduler = (self.train_state(path) or {}).get(SCHEDULER) if scheduler is not None else None
        if saved_scheduler is not None and saved_scheduler != _class_name(scheduler):  # its state would not fit
            raise ValueError(f"{path}: the LR scheduler is {saved_scheduler}, this one {_class_name(scheduler)}; "
                             "build the scheduler as the saved run did (nothing was loaded)")
        if optimizer is not None and not with_optim:  # left untouched: get_state_dict would step it
            (logger.info if with_groups else logger.warning)(
                "%s holds no per-parameter optimizer state (saved before the first step, or an optimizer that keeps "
                "none, as SGD without momentum): %s", path, "its parameter groups' settings (lr, ...) are restored"
                if with_groups else "the optimizer starts fresh")
        msd, osd = _state_to_load_into(model, optimizer if with_optim else None)
        state: Dict[str, Any] = {"model": msd, "train_state": ""}
        if with_optim:
            state["optim"] = _saved_part(osd, saved, path)
        if with_groups:
            state[GROUPS] = b""
        if scheduler is not None:
            if "scheduler" in saved:
                state["scheduler"] = b""
            else:
                logger.warning("%s holds no LR scheduler state", path)
        rng_key = f"rng_rank{_rank()}"
        saved_world = sum(k.startswith("rng_rank") for k in saved)  # one per rank that saved
        if saved_world == _world() and in_folder:  # a resume; another folder's (a warm start, an evaluation): not
            state[rng_key] = b""
        unused = sorted(k for k in saved if k.startswith("model.") and k[len("model."):] not in msd)
        if unused:  # DCP loads only the keys asked for: a smaller model would take part of the checkpoint
            raise ValueError(f"{path} holds model entries this model does not have ({', '.join(unused[:5])}"
                             f"{', ...' if len(unused) > 5 else ''}): it was saved from another model")
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as e:  # a BaseException: `except Exception` would not see it
            raise RuntimeError(f"could not load {path}: {_first_failure(e)}") from e
        info = json.loads(state["train_state"])
        set_model_state_dict(model, state["model"])
        if "optim" in state:  # not strict: a parameter that had no gradient before the save has no state in it
            set_optimizer_state_dict(model, optimizer, state["optim"], options=StateDictOptions(strict=False))
        if with_groups:
            for group, settings in zip(optimizer.param_groups, pickle.loads(state[GROUPS])):
                group.update(settings)
        if "scheduler" in state:
            scheduler.load_state_dict(pickle.loads(state["scheduler"]))
        if rng_key in state:
            set_rng_state(pickle.loads(state[rng_key]))
        elif in_folder:
            logger.warning("checkpoint written by %s rank(s), resumed on %d: model, optimizer and data position "
                           "restored (resharded), random generator states not", info.get("world_size"), _world())
        # A run's line continues from a checkpoint of this folder: what it wrote after that is another line now (a
        # save of such a step sets it aside), and the step resumed from is this line's (saved again: replaced) unless
        # it was an abandoned- copy (this line's checkpoint of that step is then set aside, not replaced). A warm
        # start from another folder's does not make this folder's other checkpoints this run's.
        if in_folder:
            own = path.name == f"{PREFIX}{info['step']:08d}"
            self._resumed_from, self._saved = info["step"], ({info["step"]} if own else set())
        else:
            self._resumed_from = None
        logger.info("resumed from %s (step %d) in %.1f s", path, info["step"], time.perf_counter() - t0)
        return info
