"""SparseAdamW: AdamW for dense gradients, lazy row-wise AdamW for sparse (COO) gradients."""
import math
import numbers
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim.adamw import adamw

from fuselab.kernels._runtime import ExecutionPath, execution_path, untraced
from fuselab.kernels.sparse_adamw import check_row_ids, sparse_adamw_step_cpp, sparse_adamw_update_


def _check_hyperparameters(group: dict) -> None:
    """ValueError naming the first bad hyperparameter of a parameter group."""
    for name in ("lr", "eps", "weight_decay"):  # else a bare TypeError of a comparison, naming nothing
        value = group[name]
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
            raise ValueError(f"invalid {name} {value!r}: must be a real number")
    if group["foreach"] and group["fused"]:
        raise ValueError("foreach=True and fused=True cannot be used together (torch.optim.AdamW refuses them too)")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):  # torch.optim.AdamW's own checks, made here at construction too
        if lr.numel() != 1:
            raise ValueError(f"a tensor lr must have one element, got shape {tuple(lr.shape)}")
        if group["foreach"] and not group["fused"]:
            raise ValueError("a tensor lr needs fused=True or foreach=False for dense parameters (torch.optim.AdamW's "
                             "foreach path takes a tensor lr only with capturable=True)")
    if not 0.0 <= group["lr"]:
        raise ValueError(f"invalid learning rate {group['lr']}: must be >= 0")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"invalid eps {group['eps']}: must be >= 0")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"invalid weight_decay {group['weight_decay']}: must be >= 0")
    if not isinstance(group["graphs"], bool):
        raise ValueError(f"graphs must be True or False, got {group['graphs']!r}")
    betas = group["betas"]
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() == 1 and not beta.is_complex():
            beta = beta.item()
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
            raise ValueError(f"invalid beta{i + 1} {beta!r}: must be a real number in [0, 1)")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"invalid beta{i + 1} {beta}: must be in [0, 1)")


_MOMENTS = ("exp_avg", "exp_avg_sq")  # the per-row state a sparse update reads and writes


class SparseAdamW(torch.optim.Optimizer):
    r"""AdamW that also takes sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``).

    Dense gradients get exactly ``torch.optim.AdamW`` (torch's foreach/fused implementation).
    A sparse COO gradient (``sparse_dim == 1``: rows of a parameter of shape (rows, ...)) gets
    a lazy update. Duplicate row indices are summed first; then, with ``t`` the parameter's step
    count (one per parameter, counted on every step that it has a gradient, sparse or dense,
    even one that touches no rows) and for each touched row ``r`` only::

        g      = -grad[r] if maximize else grad[r]
        m[r]   = beta1 * m[r] + (1 - beta1) * g
        v[r]   = beta2 * v[r] + (1 - beta2) * g**2
        p[r]   = p[r] * (1 - lr * weight_decay)                       # decoupled decay
        p[r]   = p[r] - lr / (1 - beta1**t) * m[r] / (sqrt(v[r]) / sqrt(1 - beta2**t) + eps)

    That is AdamW's update of a touched row, eps added after bias correction as AdamW does
    (``torch.optim.SparseAdam`` adds eps before it: ``lr*sqrt(1-beta2**t)/(1-beta1**t) *
    m/(sqrt(v)+eps)``). The difference from dense AdamW: untouched rows are neither decayed nor
    moved, and their moments do not decay either. On CUDA the sparse update is a sort and two
    fused Triton kernels (``torch.ops.fuselab.sparse_adamw_update_``: fp32 math for fp32/bf16/fp16
    parameters, bitwise-deterministic sums, no host sync, so a whole training step can be captured
    in a CUDA graph, dense parameters of that step given fused=True; cost O(lookups + touched rows x
    row size) however often a row repeats); on CPU, and for float64 parameters, it runs in PyTorch
    (``coalesce()``, which syncs with the host).
    Complex parameters are updated as (real, imag) pairs, as ``torch.optim.AdamW`` does.

    ``graphs=True`` (CUDA parameters the fused kernels update): each sparse parameter's update (the step
    count, the sort, both kernels) is captured in a CUDA graph of its own at the second consecutive step
    with the same key (number of lookups, hyperparameters, and the device, addresses, dtypes and strides
    of the parameter, its state and its step count), then replayed for that key, the step's ids and
    values copied into the graph's buffers first: one graph launch where an eager step issues a dozen
    calls from the host. A step with a new key runs eagerly (a scheduler's new lr each step never
    captures); a step taken while the caller captures a graph, or traced (torch.compile), runs as without
    ``graphs``. The results are bitwise those of the eager update. Up to four graphs are kept per
    parameter, the least recently used dropped first; each holds a copy of the gradient's values and the
    sort's buffers (for 65,536 lookups of 128 fp32 columns, ~35 MB). A capture that fails warns and the
    step runs eagerly; after three failures the parameter is updated eagerly for good.

    ``amsgrad`` applies to dense gradients only. Raises ValueError at construction (and in
    ``add_param_group``) for lr, eps or weight_decay that are not numbers >= 0, betas that are not two
    numbers in [0, 1), foreach=True with fused=True, and fused=True with complex parameters; at ``step()``
    for a sparse gradient in a group with amsgrad=True, a sparse gradient that is not a row-sparse COO
    tensor of a parameter with contiguous rows that do not overlap in memory, and optimizer state of
    another shape than its parameter, with rows that are not contiguous, or without both moments; TypeError
    at ``step()`` for a sparse gradient of a parameter that is not floating-point or complex; IndexError at
    ``step()`` for a row id outside its parameter's rows; each before any
    parameter of the step or its step count changes (on CUDA, where checking ids on the host would wait for
    the GPU, a device-side assert instead, as at ``nn.Embedding``'s id out of range: it ends the process's
    CUDA context). State (``exp_avg``, ``exp_avg_sq``) is kept in the parameter's dtype, as
    ``torch.optim.AdamW`` keeps it: in bf16, ``beta2 * v`` at beta2 = 0.999 rounds back to ``v`` (v never
    decays) and in fp16 a small ``(1 - beta2) * g**2`` underflows to 0; train fp32 parameters (a master
    copy under autocast) where that matters.
    Whatever the ids, eager or compiled, the kernels never write outside the parameter (a compiled step keeps
    the check as the kernels' input; whether it asserts there is inductor's indexing check).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None, graphs: bool = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, fused=fused, graphs=graphs)
        _check_hyperparameters(defaults)
        self._graphs: Dict[torch.Tensor, Dict[tuple, _GraphedUpdate]] = {}  # per parameter, by key
        self._last_key: Dict[torch.Tensor, tuple] = {}  # per parameter: the key of its last eager update
        self._failed_captures: Dict[torch.Tensor, int] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        # Checked before torch adds it: a bad group raises here, not inside a later step().
        group = {**self.defaults, **param_group}
        _check_hyperparameters(group)
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a generator is read once, here (torch rejects sets)
            params = param_group["params"] = list(params)
        named = [params] if isinstance(params, torch.Tensor) else params
        tensors = [p[1] if isinstance(p, tuple) else p for p in named]  # (name, parameter) pairs too
        if group["fused"] and any(isinstance(p, torch.Tensor) and torch.is_complex(p) for p in tensors):
            raise ValueError("fused=True does not take complex parameters (neither does torch.optim.AdamW): "
                             "use foreach=True or the default")
        super().add_param_group(param_group)

    def _state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if not state:  # the layout torch.optim.AdamW uses, so state dicts look alike
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_on_device(self, p: torch.Tensor) -> torch.Tensor:
        """The step count moved to ``p``'s device, where fused kernels read it: no step waits for the
        host, and a whole training step can be captured in a CUDA graph."""
        state = self.state[p]
        if state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)
        return state["step"]

    @staticmethod
    def _rows(t: torch.Tensor, what: str = "a parameter") -> torch.Tensor:
        """``t`` as (rows, row_numel) real numbers with unit-stride rows, or a ValueError naming ``what`` ``t``
        is and why not. A complex tensor is viewed as (real, imag) pairs, as torch.optim.AdamW treats it."""
        if t.is_complex():
            t = torch.view_as_real(t)
        # An embedding table already is its rows (no view: host time a step); a Parameter subclass's view is a
        # plain tensor, which the C++ eager path takes
        rows = t if t.dim() == 2 and type(t) in (torch.Tensor, torch.nn.Parameter) else None
        if rows is None:
            try:
                rows = t.view(t.shape[0], math.prod(t.shape[1:]))  # not -1: ambiguous for a parameter of no rows
            except RuntimeError:
                pass
        if rows is None or (rows.shape[1] > 1 and rows.stride(1) != 1):
            raise ValueError(f"sparse gradients need {what} whose rows are contiguous, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")
        if rows.shape[0] > 1 and rows.shape[1] > 0 and rows.stride(0) < rows.shape[1]:  # expand(): one row's write wins
            raise ValueError(f"sparse gradients need {what} whose rows do not overlap in memory, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()} (an expanded tensor? clone it)")
        return rows

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        param_rows = self._check_sparse_gradients()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            betas = float(beta1), float(beta2)
            dense = ([], [], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, group["amsgrad"])
                if p.grad.is_sparse:
                    grad = p.grad
                    rows = param_rows[p]
                    if len(rows) == 1:  # its state made just now, in the parameter's layout
                        rows = [rows[0], *(self._rows(state[name]) for name in _MOMENTS)]
                    self._step_on_device(p)
                    values = grad._values()
                    values = torch.view_as_real(values) if values.is_complex() else values
                    values = values.reshape(grad._nnz(), rows[0].shape[1])
                    hyper = (float(group["lr"]), *betas, float(group["eps"]), float(group["weight_decay"]),
                             group["maximize"])
                    indices = grad._indices()[0]
                    if group["graphs"] and _graphable(p, grad, rows, indices, values):
                        self._graphed_update(p, rows, indices, values, state["step"], hyper)
                    else:
                        _eager_update(rows, indices, values, state["step"], hyper)
                else:
                    for lst, t in zip(dense, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                              state.get("max_exp_avg_sq"), state["step"])):
                        lst.append(t)
            if dense[0]:
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = dense
                if group["fused"]:
                    steps = [self._step_on_device(p) for p in params]
                # has_complex: torch's foreach code views complex tensors as real pairs only when told to.
                adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if group["amsgrad"] else [], steps,
                      foreach=group["foreach"], fused=group["fused"], amsgrad=group["amsgrad"], beta1=beta1,
                      beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                      maximize=group["maximize"], has_complex=any(torch.is_complex(p) for p in params))
        return loss

    def _check_sparse_gradients(self) -> Dict[torch.Tensor, List[torch.Tensor]]:
        """What the update of any sparse gradient would refuse, checked for all before any update, so that a
        refusal leaves every parameter of the step as it was (raised mid-step, it left those before updated):
        amsgrad, the gradient's, parameter's and loaded state's layouts, and the row ids that can be checked without
        waiting for a GPU (one out of range: IndexError). Returns each such parameter's rows (``_rows``), then its
        state's where it has state already."""
        param_rows = {}
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None or not grad.is_sparse:
                    continue
                if group["amsgrad"]:
                    raise ValueError(f"amsgrad is not supported with sparse gradients (parameter of shape "
                                     f"{tuple(p.shape)}): put such parameters in a group with amsgrad=False")
                if not (p.is_floating_point() or p.is_complex()):  # the update would truncate into the integers
                    raise TypeError(f"SparseAdamW updates floating-point or complex parameters, got a {p.dtype} "
                                    f"parameter of shape {tuple(p.shape)}")
                if grad.layout != torch.sparse_coo:
                    raise ValueError(f"sparse gradients must be COO (torch.sparse_coo), got {grad.layout}")
                if grad.sparse_dim() != 1:
                    raise ValueError(f"sparse gradient must be row-sparse (sparse_dim 1), got sparse_dim "
                                     f"{grad.sparse_dim()} for a parameter of shape {tuple(p.shape)}")
                rows = [self._rows(p)]
                state = self.state.get(p, {})
                if state and not all(name in state for name in _MOMENTS):
                    raise ValueError(f"the optimizer state of a parameter of shape {tuple(p.shape)} holds "
                                     f"{sorted(state)}, not both {' and '.join(_MOMENTS)}: a partial state dict?")
                for name in _MOMENTS:  # a state dict of another model (another vocabulary size, layout)
                    if name in state and state[name].shape != p.shape:
                        raise ValueError(f"the optimizer state's {name} has shape {tuple(state[name].shape)}, its "
                                         f"parameter {tuple(p.shape)}: was the state dict saved for another model?")
                    if name in state:
                        rows.append(self._rows(state[name], f"the optimizer state {name!r}"))
                param_rows[p] = rows
                if not p.is_cuda and grad._nnz():
                    check_row_ids(grad._indices()[0], None, p)
        return param_rows

    def _graphed_update(self, p: torch.Tensor, rows: list, indices: torch.Tensor, values: torch.Tensor,
                        step: torch.Tensor, hyper: tuple) -> None:
        """``graphs=True``: replay ``p``'s captured update for this key, else update eagerly, capturing
        when the same key comes a second time in a row."""
        # What the captured launches baked in: device, shapes, dtypes, strides, addresses, hyperparameters.
        key = (p.device, tuple(indices.shape), indices.dtype, tuple(values.shape), values.dtype, hyper,
               *((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in (*rows, step)))
        graphs = self._graphs.setdefault(p, {})
        with torch.cuda.device(p.device):  # the capture, copies and replay on the parameter's GPU
            graphed = graphs.pop(key, None)
            retry = self._failed_captures.get(p, 0) < MAX_FAILED_CAPTURES
            if graphed is None and self._last_key.get(p) == key and retry:
                try:
                    graphed = _GraphedUpdate.capture(rows, indices, values, step, hyper)
                except RuntimeError as e:  # nothing ran: the eager update below serves this step
                    self._failed_captures[p] = self._failed_captures.get(p, 0) + 1
                    warnings.warn(f"SparseAdamW(graphs=True): capturing the update of a parameter of shape "
                                  f"{tuple(p.shape)} failed, it is updated eagerly: {e}", RuntimeWarning, stacklevel=3)
            if graphed is not None:
                graphs[key] = graphed  # the most recent last: the least recently used goes first
                while len(graphs) > GRAPHS_PER_PARAMETER:
                    graphs.pop(next(iter(graphs)))
                graphed.replay(indices, values, rows)
                return
        self._last_key[p] = key
        _eager_update(rows, indices, values, step, hyper)

    def load_state_dict(self, state_dict: dict) -> None:
        # A group saved without some option (before it existed, or by torch.optim.SparseAdam) keeps the
        # value of the group it replaces, not the constructor's default that __setstate__ fills in.
        replaced = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, saved, old in zip(self.param_groups, state_dict["param_groups"], replaced):
            group.update({k: v for k, v in old.items() if k != "params" and k not in saved})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for param_state in self.state.values():  # SparseAdam (and old AdamW) count steps in a Python int
            if "step" in param_state and not isinstance(param_state["step"], torch.Tensor):
                param_state["step"] = torch.tensor(float(param_state["step"]), dtype=torch.float32)
        self._graphs, self._last_key, self._failed_captures = {}, {}, {}  # not pickled: captured again


def _eager_update(rows: list, indices: torch.Tensor, values: torch.Tensor, step: torch.Tensor, hyper: tuple) -> None:
    """Count the step, then update; an update that raises (row ids out of range, say) leaves the count as it was.
    The C++ eager path does both where it has the launches planned (most steps after the first)."""
    if sparse_adamw_step_cpp(*rows, indices, values, step, *hyper):
        return
    step += 1
    try:
        sparse_adamw_update_(*rows, indices, values, step, *hyper)
    except BaseException:
        step -= 1
        raise


def _graphable(p: torch.Tensor, grad: torch.Tensor, rows: list, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``graphs=True`` applies: the fused kernels update ``p`` (CUDA, not float64: PyTorch's update
    syncs with the host), nothing traces the step, and the caller is not capturing a graph itself."""
    return (p.is_cuda and execution_path(rows[0]) is ExecutionPath.TRITON and untraced(p, grad, *rows, indices, values)
            and not torch.cuda.is_current_stream_capturing())


# Graphs kept per parameter (a few lookup counts in turn, such as an epoch's last short batch) and the
# failed captures (an out-of-memory, say) after which a parameter is updated eagerly for good.
GRAPHS_PER_PARAMETER = 4
MAX_FAILED_CAPTURES = 3


class _GraphedUpdate:
    """One parameter's sparse update captured in a CUDA graph: the step count's increment, then
    ``sparse_adamw_update_`` on static copies of the lookups and values."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", indices: torch.Tensor, values: torch.Tensor):
        self.graph, self.indices, self.values = graph, indices, values

    @classmethod
    def capture(cls, rows, indices, values, step, hyper) -> "_GraphedUpdate":
        """Capture on the current device (a stream of its own); the caller's stream is current again after,
        whether the capture succeeds or not."""
        static_indices, static_values = indices.clone(), values.contiguous().clone()
        graph, caller = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            # thread_local: another thread's CUDA calls (a DataLoader's pinned-memory thread) are not in it
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                step += 1  # recorded, not run: replay() runs it
                sparse_adamw_update_(*rows, static_indices, static_values, step, *hyper)
        finally:
            torch.cuda.set_stream(caller)
        return cls(graph, static_indices, static_values)

    def replay(self, indices: torch.Tensor, values: torch.Tensor, rows: list) -> None:
        self.indices.copy_(indices)
        self.values.copy_(values)
        self.graph.replay()
        torch.autograd.graph.increment_version(rows)  # as the eager update's in-place writes do
