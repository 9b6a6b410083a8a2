"""fuselab.optim.SparseAdamW against torch.optim.AdamW / SparseAdam and a float64 reference of its rule,
its Triton kernels (through the interpreter on a CPU), and the sparse_embedding experiment.

Tolerances are derived, not picked: the fused update computes in fp32, so each output may differ
from the float64 reference by the fp32 error of its computation (first order, ``reference_update``)
plus one rounding to the stored dtype (``reference.assert_close``).
"""
import copy
import importlib
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from reference import DEVICES, assert_close

from fuselab.kernels import sparse_adamw as kernel_module
from fuselab.kernels.sparse_adamw import sparse_adamw_torch, sparse_adamw_triton
from fuselab.optim import SparseAdamW

HP = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
ROW_SIZES = [16, 64, 300, 1024, 4096]
U32 = 2.0**-24  # the fused update's arithmetic is fp32


def embedding(rows, dim, device, dtype=torch.float64):
    emb = torch.nn.Embedding(rows, dim, sparse=True, device=device, dtype=dtype)
    torch.nn.init.normal_(emb.weight)
    return emb


def train(emb, opt, batches, head=None):
    for idx in batches:
        opt.zero_grad()
        out = emb(idx)
        loss = (out * torch.linspace(-1, 1, out.shape[-1], device=out.device, dtype=out.dtype)).sum() + (out ** 2).sum()
        if head is not None:
            loss = loss + head(out).pow(2).sum()
        loss.backward()
        opt.step()


# ----------------------------------------------------------------------------------------------
# The float64 reference of the docstring's rule, and the fused update's error bound
# ----------------------------------------------------------------------------------------------


def sum_depth(lookups: torch.Tensor, dim: int) -> torch.Tensor:
    """Additions any one gradient passes through in the kernels' sum of a row looked up L times (additions
    of exact zeros excepted): the scan inside its chunk (log2(CHUNK) deep) or, where a chunk holds this row
    only (a short last chunk too), Triton's reduction in an order it does not promise (up to min(L, CHUNK)
    - 1 deep); then its tile's sum of at most min(HEADS, chunks) partials, then the tiles one after another."""
    heads = kernel_module._blocks(dim)[3]
    chunks = torch.ceil(lookups / kernel_module.CHUNK) + 1
    in_chunk = (lookups.clamp(max=kernel_module.CHUNK) - 1).clamp(min=kernel_module.LOG2_CHUNK)
    return torch.minimum(lookups - 1, in_chunk + 2 + chunks.clamp(max=heads) + chunks / heads)


def reference_update(p, m, v, idx, values, step, lr, betas, eps, weight_decay, maximize=False, depth=sum_depth):
    """The SparseAdamW rule in float64. Returns (rows, new p, m, v of those rows, fp32 error bounds of
    p, m, v): the bound of a first-order analysis of the fused kernels' fp32 arithmetic, ``depth``
    the additions a gradient passes through in its row's sum."""
    b1, b2 = betas
    values = values.double()
    rows, inverse = torch.unique(idx.long(), return_inverse=True)
    g = torch.zeros(len(rows), values.shape[1], dtype=torch.float64, device=values.device)
    g = g.index_add(0, inverse, values)
    g_abs = torch.zeros_like(g).index_add(0, inverse, values.abs())
    lookups = torch.bincount(inverse).double()[:, None]
    g = -g if maximize else g
    p0, m0, v0 = (t[rows].double() for t in (p, m, v))
    m1 = b1 * m0 + (1 - b1) * g
    v1 = b2 * v0 + (1 - b2) * g * g
    c1, c2 = 1 - b1**step, math.sqrt(1 - b2**step)
    p_dec = p0 * (1 - lr * weight_decay)
    den = v1.sqrt() / c2 + eps
    update = lr / c1 * m1 / den
    p1 = p_dec - update
    # fp32 error bounds: the summed gradient (one rounding per addition on its path), then each
    # operation of the rule (a few roundings each; bias corrections and hyperparameters as fp32)
    dg = depth(lookups, values.shape[1]) * U32 * g_abs
    dm = (1 - b1) * dg + 4 * U32 * (b1 * m0.abs() + (1 - b1) * g.abs())
    dv = (1 - b2) * (2 * g.abs() * dg + dg**2) + 5 * U32 * (b2 * v0 + (1 - b2) * g * g)
    d_sqrt = torch.minimum(dv / (2 * v1.sqrt()).clamp_min(1e-300), dv.sqrt())
    d_den = d_sqrt / c2 + 4 * U32 * den
    dp = (2 * U32 * p_dec.abs() + lr / c1 / den * dm + lr / c1 * m1.abs() / den**2 * d_den
          + 8 * U32 * update.abs() + U32 * p1.abs())
    return rows, (p1, m1, v1), (dp, dm, dv)


def check_update(before, after, idx, values, step, hp, maximize=False, what="", depth=sum_depth):
    """``after`` (p, m, v) is ``before`` with the rule applied to the touched rows: within the bound
    there, bitwise unchanged elsewhere."""
    rows, refs, bounds = reference_update(*before, idx, values, step, hp["lr"], hp["betas"], hp["eps"],
                                          hp["weight_decay"], maximize, depth)
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool, device=rows.device)
    untouched[rows] = False
    for name, old, new, ref, bound in zip("pmv", before, after, refs, bounds):
        assert_close(new[rows], ref, bound, f"{what} {name}")
        assert torch.equal(new[untouched], old[untouched]), f"{what} {name}: an untouched row changed"


def fused_step(state, idx, values, step, hp, maximize=False):
    """The fused update (the Triton kernels; the interpreter on a CPU) on copies of ``state``."""
    out = [t.clone() for t in state]
    step_t = torch.tensor(float(step), device=state[0].device)
    sparse_adamw_triton(*out, idx, values, hp["lr"], *hp["betas"], hp["eps"], hp["weight_decay"], step_t, maximize)
    return out


def random_state(rows, dim, dtype, device):
    return [torch.randn(rows, dim, device=device).to(dtype), (torch.randn(rows, dim, device=device) * 0.1).to(dtype),
            torch.rand(rows, dim, device=device).to(dtype)]


def ids_with_repeats(rows, lookups, hot_lookups, device):
    """``lookups`` uniform ids plus one row looked up ``hot_lookups`` times (crossing chunk
    boundaries), in random order."""
    idx = torch.cat([torch.randint(0, rows, (lookups,), device=device),
                     torch.full((hot_lookups,), int(torch.randint(0, rows, (1,))), device=device)])
    return idx[torch.randperm(len(idx), device=device)]


# ----------------------------------------------------------------------------------------------
# The fused kernels against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dim", ROW_SIZES)
def test_fused_update_matches_reference(device, dtype, dim):
    # Row sizes from one column block to 64 of them (300: a partial block); ids mostly distinct,
    # some repeated, one row repeated 150 times (its segment crosses chunk boundaries).
    rows = 40
    idx = ids_with_repeats(rows, 60 if dim < 1024 else 20, 150, device)
    values = torch.randn(len(idx), dim, device=device).to(dtype)
    state = random_state(rows, dim, dtype, device)
    check_update(state, fused_step(state, idx, values, 3, HP), idx, values, 3, HP, what=f"{dtype} dim {dim}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_change_below_half_an_ulp_leaves_16_bit_rows_as_they_were(device, dtype):
    # A zero gradient and lr * weight_decay = 1e-5: p * (1 - 1e-5) rounds back to p. The interpreter's bf16
    # cast truncated: every step moved each bf16 weight an ulp toward zero (0.5 of a weight in 1,500 steps).
    state = random_state(20, 24, dtype, device)
    state[1].zero_(), state[2].zero_()  # no moments: the step's only change is the decay
    idx = torch.arange(20, device=device)
    after = fused_step(state, idx, torch.zeros(20, 24, device=device, dtype=dtype), 3,
                       dict(HP, lr=1e-3, weight_decay=0.01))
    assert torch.equal(after[0], state[0]) and not after[1].any() and not after[2].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("betas,step", [((0.9, 0.999), 1), ((0.9, 0.99999), 1), ((0.9, 0.99999), 1000),
                                        ((0.0, 0.5), 7), ((0.5, 0.0), 2)])
def test_fused_update_hyperparameters(device, maximize, betas, step):
    # beta2 = 0.99999 at t = 1: 1 - beta2**t = 1e-5, where an fp32 bias correction was off by 7e-4.
    hp = dict(HP, betas=betas)
    idx = ids_with_repeats(30, 40, 70, device)
    values = torch.randn(len(idx), 24, device=device)
    state = random_state(30, 24, torch.float32, device)
    after = fused_step(state, idx, values, step, hp, maximize)
    check_update(state, after, idx, values, step, hp, maximize, what=f"betas {betas} step {step}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["strided int32 ids, transposed values", "int64 ids, row-strided values"])
def test_fused_update_input_layouts(device, layout):
    # What a direct caller of the functional update may pass.
    idx = ids_with_repeats(37, 53, 80, device)
    values = torch.randn(len(idx), 70, device=device)
    if layout.startswith("strided"):
        idx = torch.stack([idx, idx]).t().reshape(-1).to(torch.int32)[::2]
        values = values.t().contiguous().t()
    else:
        values = torch.randn(len(idx), 90, device=device)[:, 5:75]
    state = random_state(37, 70, torch.float32, device)
    check_update(state, fused_step(state, idx, values, 2, HP), idx, values, 2, HP, what=layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nnz", [1, 255, 257, 2049, 20_000])
def test_sort_ids_matches_torch_stable_sort(device, nnz):
    # sort_ids: one block, one merge pass, a merge pass that is not the last (both key buffers), a short last
    # group of runs; ids out of range clamped to -1 and rows, as the update's guard expects them.
    rows = 3000
    ids = torch.randint(0, rows, (nnz,), device=device)
    ids[::5] = ids[0].item()  # long runs of one id: equal ids keep lookup order (a tensor source overlaps: CUDA refuses)
    if nnz > 10:
        ids[3], ids[7] = -4, rows + 11
    sorted_ids, order = kernel_module.sort_ids(ids, rows, None)
    expected_ids, expected_order = torch.sort(ids.clamp(-1, rows), stable=True)
    assert sorted_ids.dtype == order.dtype == torch.int32
    assert torch.equal(sorted_ids.long(), expected_ids) and torch.equal(order.long(), expected_order)


@pytest.mark.parametrize("bad,words", [
    (dict(indices=torch.tensor([0, 1, 2, 3, 3, 3])), "values must be"),  # more ids than value rows
    (dict(values=torch.ones(5, 2)), "values must be"),  # fewer
    (dict(indices=torch.tensor([-0.5, 2.7])), "int32 or int64"),
    (dict(indices=torch.tensor([[0, 1]])), "1-D"),
    (dict(values=torch.ones(2, 3)), "values must be"),  # a row of another width
    (dict(exp_avg=torch.zeros(4, 3)), "one shape"),
])
def test_update_op_refuses_inputs_that_do_not_fit(bad, words):
    # Eagerly and while traced (the fake), before anything changes: a mismatch would drop lookups or read past them.
    args = dict(param=torch.ones(4, 2), exp_avg=torch.zeros(4, 2), exp_avg_sq=torch.zeros(4, 2),
                indices=torch.tensor([0, 3]), values=torch.ones(2, 2), step=torch.tensor(1.0))
    args.update(bad)
    before = args["param"].clone()
    with pytest.raises(ValueError, match=words):
        kernel_module.sparse_adamw_update_(*args.values(), 0.1, 0.9, 0.999, 1e-8, 0.0, False)
    assert torch.equal(args["param"], before)
    with pytest.raises(ValueError, match=words):
        kernel_module._update_fake(*args.values(), 0.1, 0.9, 0.999, 1e-8, 0.0, False)


def test_sort_ids_refuses_what_its_keys_cannot_hold(monkeypatch):
    with pytest.raises(ValueError, match="2\\*\\*31 - 2 rows"):
        kernel_module.sort_ids(torch.tensor([5, -3, 0]), 2**31 - 2, None)
    monkeypatch.setattr(kernel_module, "MERGE_TILE", 2 * kernel_module.SORT_BLOCK)
    with pytest.raises(ValueError, match="MERGE_TILE"):
        kernel_module.sort_ids(torch.tensor([5, -3, 0]), 10, None)


@pytest.mark.parametrize("device", DEVICES)
def test_update_is_the_same_past_the_triton_sort(device, monkeypatch):
    # Past TRITON_SORT_MAX lookups torch.sort serves the step: the same update, bit for bit.
    idx = torch.randint(0, 300, (3000,), device=device)
    values = torch.randn(3000, 24, device=device)
    state = random_state(300, 24, torch.float32, device)
    ours = fused_step(state, idx, values, 4, HP)
    monkeypatch.setattr(kernel_module, "TRITON_SORT_MAX", 100)
    for a, b in zip(ours, fused_step(state, idx, values, 4, HP)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_row_looked_up_thousands_of_times(device):
    # 4096 lookups of one row among a few others: 64 chunks summed in parallel, then in order by one
    # program (the lookup-order walk this replaced was quadratic in a row's repeats).
    idx = ids_with_repeats(100, 60, 4096, device)
    values = torch.randn(len(idx), 64, device=device)
    state = random_state(100, 64, torch.float32, device)
    check_update(state, fused_step(state, idx, values, 5, HP), idx, values, 5, HP, what="4096 repeats")


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_over_more_chunks_than_a_tile_of_heads(device):
    # crossing_kernel adds a crossing row's heads HEADS chunks at a time: a row over HEADS + 3 chunks (rows this
    # wide have the fewest HEADS) takes that loop twice, the second tile ending midway.
    dim = 2048
    heads, chunk = kernel_module._blocks(dim)[3], kernel_module.CHUNK
    idx = ids_with_repeats(50, 30, (heads + 3) * chunk + 5, device)
    values = torch.randn(len(idx), dim, device=device)
    state = random_state(50, dim, torch.float32, device)
    check_update(state, fused_step(state, idx, values, 3, HP), idx, values, 3, HP, what=f"{heads} heads a tile")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lookups", [1, 63, 64, 65, 128, 129, 200])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_chunk_edges(device, lookups, rows):
    # Lookup counts around the chunk size (CHUNK = 64), over 1-3 rows: segments that end exactly at,
    # just before and just after a chunk boundary, a last chunk with one position.
    idx = torch.randint(0, rows, (lookups,), device=device)
    values = torch.randn(lookups, 20, device=device)
    state = random_state(5, 20, torch.float32, device)
    check_update(state, fused_step(state, idx, values, 2, HP), idx, values, 2, HP, what=f"{lookups} lookups")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lookups", [40, 64, 128])
def test_a_chunk_of_one_row_is_summed_in_a_tree(device, lookups):
    # Every position of a chunk on one row (a short last chunk too): one large gradient then many just under
    # half an ulp of it, the order in which a sequential sum loses each of them: the reduction of such a
    # chunk stays within the depth sum_depth allows it.
    idx = torch.full((lookups,), 3, device=device)
    values = torch.full((lookups, 16), 0.49 * 2.0**-24, device=device)
    values[::kernel_module.CHUNK] = 1.0
    state = [torch.zeros(5, 16, device=device) for _ in range(3)]
    check_update(state, fused_step(state, idx, values, 1, HP), idx, values, 1, HP, what=f"{lookups} lookups")


def keep_each_rows_order(idx: torch.Tensor) -> torch.Tensor:
    """A random permutation of the lookups that keeps each row's lookups in their order."""
    perm = torch.randperm(len(idx), device=idx.device)
    for row in idx.unique():
        mine = (idx[perm] == row).nonzero().flatten()
        perm[mine] = perm[mine].sort().values
    return perm


@pytest.mark.parametrize("device", DEVICES)
def test_sums_depend_only_on_each_rows_lookup_order(device):
    # Bitwise determinism: the sums are a function of each row's lookups in lookup order alone: the
    # same run after run, and when the other rows' lookups are interleaved differently.
    idx = ids_with_repeats(20, 300, 500, device)
    values = torch.randn(len(idx), 32, device=device)
    state = random_state(20, 32, torch.float32, device)
    first, again = fused_step(state, idx, values, 4, HP), fused_step(state, idx, values, 4, HP)
    perm = keep_each_rows_order(idx)
    shuffled = fused_step(state, idx[perm], values[perm], 4, HP)
    for a, b, c in zip(first, again, shuffled):
        assert torch.equal(a, b) and torch.equal(a, c)


@triton.jit
def _bias_correction_kernel(step_ptr, out_ptr, beta_hi, beta_lo):
    i = tl.program_id(0)
    t = tl.load(step_ptr + i).to(tl.int64)
    tl.store(out_ptr + i, kernel_module._one_minus_pow(beta_hi, beta_lo, t).to(tl.float32))  # as _adamw uses it


def check_bias_correction(steps: torch.Tensor, beta: float) -> None:
    """The kernels' 1 - beta**t (in fp32, as used) against float64's -expm1(t log(beta))."""
    out = torch.empty(len(steps), dtype=torch.float32, device=steps.device)
    _bias_correction_kernel[(len(steps),)](steps, out, *kernel_module._halves(beta))
    exact = -torch.expm1(steps.double() * math.log(beta))
    worst = ((out.double() - exact) / exact).abs().max().item()
    assert worst < 1e-6, f"beta {beta}: relative error {worst:.2e} of 1 - beta**t"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [0.9, 0.999, 0.99999])
def test_bias_correction_accurate_up_to_a_million_steps(device, beta):
    # t = 1..200, then log-spaced up to 1e6 (every t: the GPU test).
    steps = torch.cat([torch.arange(1, 201), torch.logspace(math.log10(201), 6, 200).round()]).unique().float()
    check_bias_correction(steps.to(device), beta)


# ----------------------------------------------------------------------------------------------
# The optimizer on the Triton kernels (fp32/bf16/fp16 parameters) against the reference
# ----------------------------------------------------------------------------------------------


def bag_inputs(rows, device, padding_idx):
    idx = ids_with_repeats(rows, 70, 90, device)
    if padding_idx is not None:
        idx[::7] = padding_idx
    offsets = torch.tensor([0, 3, 3, 40, 41, 100], device=device)  # an empty bag too
    return idx, offsets


MODULES = ["Embedding", "Embedding padding_idx", "EmbeddingBag sum", "EmbeddingBag sum per_sample_weights",
           "EmbeddingBag mean", "EmbeddingBag mean padding_idx"]


def make_module(kind, rows, dim, dtype, device):
    """(module, a function that draws its inputs) for one of MODULES."""
    padding_idx = 3 if "padding_idx" in kind else None
    if kind.startswith("EmbeddingBag"):
        module = torch.nn.EmbeddingBag(rows, dim, mode=kind.split()[1], sparse=True, padding_idx=padding_idx,
                                       device=device, dtype=dtype)

        def inputs():
            idx, offsets = bag_inputs(rows, device, padding_idx)
            weights = torch.rand(len(idx), device=device).to(dtype) if "per_sample" in kind else None
            return idx, offsets, weights
    else:
        module = torch.nn.Embedding(rows, dim, sparse=True, padding_idx=padding_idx, device=device, dtype=dtype)

        def inputs():
            idx = ids_with_repeats(rows, 80, 100, device).view(12, 15)
            if padding_idx is not None:
                idx[:, -2:] = padding_idx
            return (idx,)
    torch.nn.init.normal_(module.weight)
    return module, inputs


def steps_match_reference(forward, params, opt, inputs, steps, hp_of=lambda p: HP, maximize_of=lambda p: False):
    """``steps`` optimizer steps, each checked against the reference from the state before it."""
    for _ in range(steps):
        opt.zero_grad()
        out = forward(*inputs()).float()
        # scaled so that fp16 moments stay finite: a row's summed gradient squared must fit in fp16
        (0.01 * (out * torch.linspace(-1, 1, out.shape[-1], device=out.device) + out**2)).sum().backward()
        checks = []
        for p in params:
            state = opt.state[p]
            before = [p.detach().clone()] + ([state["exp_avg"].clone(), state["exp_avg_sq"].clone()] if state
                                             else [torch.zeros_like(p), torch.zeros_like(p)])
            lookups = p.grad._indices()[0].clone(), p.grad._values().clone()  # one row per lookup, as summed
            checks.append((p, before, lookups, int(state["step"]) + 1 if state else 1))
        opt.step()
        for p, before, (idx, values), step in checks:
            state = opt.state[p]
            assert int(state["step"]) == step
            check_update(before, [p.detach(), state["exp_avg"], state["exp_avg_sq"]], idx, values, step, hp_of(p),
                         maximize_of(p), what=f"step {step}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("kind", MODULES)
def test_optimizer_on_embedding_layers(device, dtype, kind):
    # What users feed SparseAdamW, in their parameter dtypes; the padding row is never in the
    # gradient, so it must not move (check_update: untouched rows stay bitwise).
    module, inputs = make_module(kind, 50, 24, dtype, device)
    steps_match_reference(module, [module.weight], SparseAdamW(module.parameters(), **HP), inputs, steps=3)


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_param_groups_maximize_fp32(device):
    # Each group's own hyperparameters reach the kernels (lr, betas, eps, weight decay, maximize).
    a, inputs = make_module("Embedding", 40, 16, torch.float32, device)
    b = copy.deepcopy(a)
    hp_b = dict(lr=0.01, betas=(0.5, 0.99999), eps=1e-3, weight_decay=0.3)
    opt = SparseAdamW([{"params": a.parameters()}, {"params": b.parameters(), "maximize": True, **hp_b}], **HP)
    steps_match_reference(lambda idx: a(idx) + b(idx), [a.weight, b.weight], opt, inputs, steps=2,
                          hp_of=lambda p: HP if p is a.weight else hp_b, maximize_of=lambda p: p is b.weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_untouched_rows_unchanged_and_empty_batch(device, dtype):
    emb = embedding(30, 4, device, dtype)
    before = emb.weight.detach().clone()
    opt = SparseAdamW(emb.parameters(), **HP)
    train(emb, opt, [torch.tensor([3, 3, 7], device=device)])
    changed = (emb.weight != before).any(1)
    assert changed.nonzero().flatten().tolist() == [3, 7]
    snapshot = emb.weight.detach().clone()
    emb.weight.grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=device),
                                              torch.empty(0, 4, dtype=emb.weight.dtype, device=device), (30, 4))
    opt.step()  # no rows touched: nothing moves, the step count still advances
    assert torch.equal(emb.weight, snapshot)
    assert opt.state[emb.weight]["step"].item() == 2


# ----------------------------------------------------------------------------------------------
# Against torch.optim.AdamW and SparseAdam (float64: the PyTorch path, exact to rounding)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_all_rows_touched_equals_adamw(device):
    # Every row in every batch: the lazy update is exactly AdamW's.
    rows = 23
    batches = [torch.randperm(rows, device=device).repeat(2)[: rows + 5] for _ in range(12)]  # duplicates too
    sparse = embedding(rows, 7, device)
    dense = copy.deepcopy(sparse)
    dense.sparse = False
    train(sparse, SparseAdamW(sparse.parameters(), **HP), batches)
    train(dense, torch.optim.AdamW(dense.parameters(), **HP), batches)
    torch.testing.assert_close(sparse.weight, dense.weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_sparse_adam_without_decay(device, maximize):
    rows = 40
    batches = [torch.randint(0, rows, (17,), device=device) for _ in range(10)]  # some rows untouched
    ours = embedding(rows, 5, device)
    ref = copy.deepcopy(ours)
    # SparseAdam adds eps before the bias correction, AdamW after: the results differ by ~lr * eps /
    # sqrt(v), up to 1e-9 at eps=1e-12 where a gradient is small. A negligible eps leaves rounding.
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-30, maximize=maximize)
    train(ours, SparseAdamW(ours.parameters(), weight_decay=0.0, **kw), batches)
    train(ref, torch.optim.SparseAdam(ref.parameters(), **kw), batches)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_mixed_dense_and_sparse_and_state_dict_round_trip(device, dtype):
    # Resuming from a state dict continues bit for bit (the fused sums are deterministic).
    torch.manual_seed(0)
    emb = embedding(50, 6, device, dtype)
    head = torch.nn.Linear(6, 3, device=device, dtype=dtype)
    params = [{"params": emb.parameters()}, {"params": head.parameters(), "lr": 0.02}]
    opt = SparseAdamW(params, **HP)
    batches = [torch.randint(0, 50, (13,), device=device) for _ in range(8)]
    train(emb, opt, batches[:4], head)
    saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(emb.state_dict()), copy.deepcopy(head.state_dict())
    train(emb, opt, batches[4:], head)
    emb2 = embedding(50, 6, device, dtype)
    head2 = torch.nn.Linear(6, 3, device=device, dtype=dtype)
    emb2.load_state_dict(saved[1])
    head2.load_state_dict(saved[2])
    opt2 = SparseAdamW([{"params": emb2.parameters()}, {"params": head2.parameters(), "lr": 0.02}], **HP)
    opt2.load_state_dict(saved[0])
    train(emb2, opt2, batches[4:], head2)
    assert torch.equal(emb.weight, emb2.weight) and torch.equal(head.weight, head2.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pytorch_path_matches_reference(dtype):
    # The path CPU tensors take without the interpreter, and float64 parameters everywhere.
    idx = ids_with_repeats(30, 40, 70, "cpu")
    values = torch.randn(len(idx), 20).to(dtype)
    state = random_state(30, 20, dtype, "cpu")
    after = [t.clone() for t in state]
    sparse_adamw_torch(*after, idx, values, HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"],
                       torch.tensor(3.0), False)
    # coalesce() sums a row's duplicates in an order of its own: allow a sequential sum
    check_update(state, after, idx, values, 3, HP, what="pytorch path", depth=lambda lookups, dim: lookups - 1)


def test_lr_scheduler_and_closure():
    emb = embedding(10, 3, "cpu")
    opt = SparseAdamW(emb.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    idx = torch.tensor([1, 2])

    def closure():
        opt.zero_grad()
        loss = emb(idx).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


# ----------------------------------------------------------------------------------------------
# Hyperparameters, malformed gradients, complex parameters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    (dict(lr=-1.0), "learning rate"), (dict(eps=-1e-8), "eps"), (dict(betas=(1.0, 0.9)), "beta1"),
    (dict(betas=(0.9, -0.1)), "beta2"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(0.9,)), r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    (dict(betas=(0.9, 0.99, 0.999)), "betas must be a pair"), (dict(betas=0.9), "betas must be a pair"),
    (dict(betas="ab"), "betas must be a pair"), (dict(betas=(0.9, None)), "beta2 None"),
    (dict(betas=(0.9, float("nan"))), "beta2 nan"), (dict(betas=(True, 0.9)), "beta1 True"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(lr=torch.tensor(0.01), foreach=True), "a tensor lr needs fused=True or foreach=False"),  # was at step()
    (dict(lr=torch.tensor([0.01, 0.02])), "a tensor lr must have one element"),
    (dict(graphs=1), "graphs must be True or False"),
    (dict(lr="0.1"), "invalid lr '0.1'"), (dict(eps=None), "invalid eps None"),
    (dict(weight_decay=True), "invalid weight_decay True"),
    (dict(foreach=True, fused=True), "foreach=True and fused=True"),
])
def test_bad_hyperparameters(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SparseAdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_hyperparameters_as_torch_adamw_takes_them():
    # A probe found 0-d tensor weight_decay and eps refused by the check for non-numbers (torch.optim.AdamW takes them)
    for kwargs in (dict(weight_decay=torch.tensor(0.01)), dict(eps=torch.tensor(1e-8)), dict(lr=torch.tensor(0.1)),
                   dict(lr=np.float32(0.1))):
        p = torch.nn.Parameter(torch.ones(3, 2))
        p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (3, 2))
        SparseAdamW([p], **kwargs).step()
        assert not torch.equal(p[1], torch.ones(2)) and torch.equal(p[0], torch.ones(2)), kwargs


def test_bad_hyperparameters_of_a_param_group():
    # Raised when the group is added (at construction or later), not inside a later step().
    p, q = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="betas must be a pair"):
        SparseAdamW([{"params": [p]}, {"params": [q], "betas": (0.9,)}])
    opt = SparseAdamW([p], betas=(0.9, torch.tensor(0.99)))  # a 1-element tensor is a number
    with pytest.raises(ValueError, match="beta2"):
        opt.add_param_group({"params": [q], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": (x for x in [q]), "lr": 0.5})  # a generator is read once
    assert opt.param_groups[1]["params"] == [q]


def test_bad_sparse_gradients():
    p = torch.nn.Parameter(torch.randn(6, 4).t())  # rows are not contiguous
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.randn(1, 6), (4, 6))
    with pytest.raises(ValueError, match="rows are contiguous"):
        SparseAdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(4, 6))
    q.grad = torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.randn(1), (4, 6))  # element-sparse
    with pytest.raises(ValueError, match="sparse_dim 1"):
        SparseAdamW([q]).step()
    q.grad = torch.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.int64), torch.randn(1, 4, 6), (4, 6))
    with pytest.raises(ValueError, match="got sparse_dim 0"):  # was an IndexError of the id check
        SparseAdamW([q]).step()


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
def test_parameters_a_sparse_update_cannot_hold_are_refused(fused):
    # Found by a probe: integer parameters were updated and truncated (5 -> 4), an expanded parameter's rows
    # (one memory row) took whichever row's update was written last.
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([[1.0] * 4, [-1.0] * 4]), (5, 4))
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        p = torch.ones(5, 4, dtype=dtype)
        p.grad = grad.to(dtype)
        with pytest.raises(TypeError, match=f"floating-point or complex parameters, got a {dtype}"):
            SparseAdamW([p], fused=fused).step()
        assert torch.equal(p, torch.ones(5, 4, dtype=dtype))
    p = torch.nn.Parameter(torch.zeros(1, 4).expand(5, 4))
    p.grad = grad
    with pytest.raises(ValueError, match="rows do not overlap in memory"):
        SparseAdamW([p], fused=fused).step()
    assert not p.detach().any()


@pytest.mark.parametrize("bad", ["amsgrad", "layout", "ids", "state", "state layout", "partial state"])
def test_a_refused_sparse_gradient_leaves_the_whole_step_undone(bad):
    # The amsgrad and layout refusals came mid-step: the parameters before the refused one were updated
    first, second = embedding(10, 3, "cpu"), embedding(10, 3, "cpu")
    first(torch.tensor([1, 2])).sum().backward()
    second(torch.tensor([3])).sum().backward()
    groups = [{"params": first.parameters()}, {"params": second.parameters()}]
    if bad == "amsgrad":
        groups[1]["amsgrad"] = True
    elif bad == "layout":  # a parameter whose rows are not contiguous, its gradient row-sparse
        second.weight = torch.nn.Parameter(torch.randn(3, 10).t())
        second.weight.grad = torch.sparse_coo_tensor(torch.tensor([[3]]), torch.ones(1, 3), (10, 3))
        groups[1]["params"] = [second.weight]
    elif bad == "ids":
        second.weight.grad = torch.sparse_coo_tensor(torch.tensor([[10]]), torch.ones(1, 3).to(second.weight), (10, 3))
    opt = SparseAdamW(groups, lr=0.1)
    if bad == "state":  # state loaded from a model of another vocabulary size (it was refused mid-step)
        opt.state[second.weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(12, 3),
                                    "exp_avg_sq": torch.zeros(12, 3)}
    elif bad == "state layout":  # torch.optim.AdamW's state of a parameter stored transposed: named, before any update
        opt.state[second.weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 10).t(),
                                    "exp_avg_sq": torch.zeros(10, 3)}
    elif bad == "partial state":  # one moment only: a bare TypeError or KeyError came mid-step
        opt.state[second.weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(10, 3)}
    before = first.weight.detach().clone(), second.weight.detach().clone()
    expected = {"state": "exp_avg has shape", "state layout": "optimizer state 'exp_avg' whose rows are contiguous",
                "partial state": "not both exp_avg and exp_avg_sq"}
    with pytest.raises((ValueError, IndexError), match=expected.get(bad)):
        opt.step()
    assert torch.equal(first.weight, before[0]) and torch.equal(second.weight, before[1])
    stateful = "state" in bad
    assert list(opt.state) == ([second.weight] if stateful else []), "no state made, no step counted"
    assert not stateful or opt.state[second.weight]["step"] == 1


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_complex_dense_parameters_equal_adamw(foreach, amsgrad):
    # torch views complex tensors as (real, imag) pairs; its foreach code needs has_complex for that.
    p = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.complex64))
    q = copy.deepcopy(p)
    ours = SparseAdamW([p], foreach=foreach, amsgrad=amsgrad, **HP)
    ref = torch.optim.AdamW([q], foreach=foreach, amsgrad=amsgrad, **HP)
    for _ in range(4):
        grad = torch.randn(5, 3, dtype=torch.complex64)
        p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    assert torch.equal(p, q)


def test_complex_fused_rejected_at_construction():
    c = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64))
    for params in ([c], [("c", c)]):  # named parameters too
        with pytest.raises(ValueError, match="fused=True does not take complex parameters"):
            SparseAdamW(params, fused=True)


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("bad", [4, 6, -1, 2**33])
def test_row_ids_outside_the_parameter_raise_before_anything_changes(fused, bad):
    # torch.sparse_coo_tensor does not check its indices: an id past the rows (or -1, or one that an int32 key
    # would wrap into range) must neither write outside the parameter nor count a step, of any parameter of the
    # step. On a CPU (the kernels in the interpreter, or PyTorch's update); CUDA's device assert: the test below.
    storage = torch.zeros(8, 3)
    good, p = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(storage[:4])
    good.grad = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.ones(2, 3), (4, 3))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, bad, 2]]), torch.ones(3, 3), (4, 3), check_invariants=False)
    opt = SparseAdamW([good, p], lr=0.1)
    with pytest.raises(IndexError, match=f"row ids must lie in \\[0, 4\\).*got ids from {min(1, bad)} to {max(2, bad)}"):
        if fused:
            opt.step()
        else:
            state = [p.detach().clone(), torch.zeros(4, 3), torch.zeros(4, 3)]
            sparse_adamw_torch(*state, p.grad._indices()[0], p.grad._values(), 0.1, 0.9, 0.999, 1e-8, 0.0,
                               torch.tensor(1.0), False)
    assert torch.equal(storage, torch.zeros_like(storage))
    if fused:  # the optimizer's step: the good parameter before it is left as it was too
        assert torch.equal(good, torch.zeros_like(good)) and not opt.state  # no parameter's step was counted


_OUT_OF_RANGE_ON_CUDA = """
import torch
from fuselab.optim import SparseAdamW
p = torch.nn.Parameter(torch.zeros(4, 3, device="cuda"))
p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 6]], device="cuda"), torch.ones(2, 3, device="cuda"), (4, 3),
                                 check_invariants=False)
SparseAdamW([p]).step()
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.gpu
def test_row_ids_outside_the_parameter_stop_a_cuda_step_with_a_device_assert():
    # Checked without a host sync: the process's CUDA context ends, as at nn.Embedding's own out-of-range id.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_ON_CUDA], env=env, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert result.returncode != 0 and "device-side assert" in result.stderr, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernels_never_write_outside_the_parameter(device, monkeypatch):
    # Whatever reaches them (the check stops such a step first; a compiler could drop a check whose result is unused):
    # rows outside the parameter are skipped, the others updated as the rule says.
    # (Ids below 0 arrive clamped to -1, the kernels' own end marker: their `ids >= 0` mask matters only for
    # parameters of 2**31 rows or more, whose int64 ids are not clamped; no test reaches that size.)
    monkeypatch.setattr(kernel_module, "check_row_ids", lambda *args: None)
    for repeats in (3, 40):  # segments that end in their chunk, and ones that cross chunks
        storage = torch.zeros(12, 5, device=device)
        state = [storage[2:6], torch.zeros(4, 5, device=device), torch.zeros(4, 5, device=device)]
        idx = torch.tensor([1, -1, 6, 4, 2**33, 3, -7] * repeats, device=device)
        values = torch.randn(len(idx), 5, device=device)
        before = [t.clone() for t in state]
        sparse_adamw_triton(*state, idx, values, HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"],
                            torch.tensor(1.0, device=device), False)
        assert torch.equal(storage[:2], torch.zeros(2, 5, device=device)), repeats
        assert torch.equal(storage[6:], torch.zeros(6, 5, device=device)), repeats
        valid = (idx >= 0) & (idx < 4)
        check_update(before, state, idx[valid], values[valid], 1, HP, what=f"valid rows, {repeats} repeats")


def test_a_parameter_of_no_rows_takes_its_empty_gradient():
    emb = torch.nn.Embedding(0, 3, sparse=True)
    emb.weight.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 3), (0, 3))
    opt = SparseAdamW(emb.parameters())
    opt.step()
    assert opt.state[emb.weight]["step"].item() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_complex_sparse_gradient_equals_adamw(device):
    # All rows touched: the lazy rule is AdamW's, on (real, imag) pairs as torch.optim.AdamW does it.
    rows, dim = 9, 5
    p = torch.nn.Parameter(torch.randn(rows, dim, dtype=torch.complex128, device=device))
    q = torch.nn.Parameter(p.detach().clone())
    ours, ref = SparseAdamW([p], **HP), torch.optim.AdamW([q], **HP)
    for _ in range(3):
        idx = torch.cat([torch.randperm(rows, device=device), torch.randint(0, rows, (6,), device=device)])
        p.grad = torch.sparse_coo_tensor(idx[None], torch.randn(len(idx), dim, dtype=p.dtype, device=device),
                                         (rows, dim))
        q.grad = p.grad.to_dense()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_complex64_sparse_gradient_on_the_kernels(device):
    # complex64 takes the fused kernels as fp32 (real, imag) pairs: each step matches the reference.
    rows, dim = 9, 5
    p = torch.nn.Parameter(torch.randn(rows, dim, dtype=torch.complex64, device=device))
    opt = SparseAdamW([p], **HP)
    for step in range(1, 3):
        idx = ids_with_repeats(rows, 10, 70, device)
        values = torch.randn(len(idx), dim, dtype=p.dtype, device=device)
        p.grad = torch.sparse_coo_tensor(idx[None], values, (rows, dim))
        state = [p.detach()] + ([opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]] if opt.state[p]
                                else [torch.zeros_like(p)] * 2)
        before = [torch.view_as_real(t).reshape(rows, -1).clone() for t in state]
        opt.step()
        after = [torch.view_as_real(t).reshape(rows, -1) for t in (p.detach(), opt.state[p]["exp_avg"],
                                                                     opt.state[p]["exp_avg_sq"])]
        check_update(before, after, idx, torch.view_as_real(values).reshape(len(idx), -1), step, HP,
                     what=f"complex64 step {step}")


def test_amsgrad_dense_equals_adamw_and_sparse_rejected():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4, dtype=torch.float64)
    ref = copy.deepcopy(lin)
    ours_opt = SparseAdamW(lin.parameters(), amsgrad=True, **HP)
    ref_opt = torch.optim.AdamW(ref.parameters(), amsgrad=True, **HP)
    for _ in range(6):
        x = torch.randn(5, 6, dtype=torch.float64)
        for model, opt in ((lin, ours_opt), (ref, ref_opt)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    torch.testing.assert_close(lin.weight, ref.weight, rtol=1e-12, atol=1e-12)
    emb = embedding(10, 3, "cpu")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="amsgrad is not supported with sparse gradients"):
        SparseAdamW(emb.parameters(), amsgrad=True).step()


# ----------------------------------------------------------------------------------------------
# The registered op
# ----------------------------------------------------------------------------------------------


def test_update_op_opcheck():
    idx = torch.tensor([4, 1, 4, 0, 6])
    args = (torch.randn(7, 5), torch.randn(7, 5) * 0.1, torch.rand(7, 5), idx, torch.randn(5, 5),
            torch.tensor(2.0), 0.01, 0.9, 0.999, 1e-8, 0.05, False)
    torch.library.opcheck(torch.ops.fuselab.sparse_adamw_update_, args)


def test_update_takes_the_op_only_when_traced():
    # Eager calls run the body directly (no dispatcher); under a dispatch mode the op itself is recorded.
    from torch.utils._python_dispatch import TorchDispatchMode

    from fuselab.kernels.sparse_adamw import sparse_adamw_update_

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    args = (torch.randn(7, 5), torch.zeros(7, 5), torch.zeros(7, 5), torch.tensor([4, 1, 4]), torch.randn(3, 5),
            torch.tensor(1.0), 0.01, 0.9, 0.999, 1e-8, 0.0, False)
    before = args[0].clone()
    sparse_adamw_update_(*args)
    assert not torch.equal(args[0], before)
    with Record() as rec:
        sparse_adamw_update_(*args)
    assert any("fuselab.sparse_adamw_update_" in op for op in rec.ops), rec.ops


# ----------------------------------------------------------------------------------------------
# experiments/sparse_embedding.py on a CPU
# ----------------------------------------------------------------------------------------------


def tiny_ratings(n=240, users=30, items=40):
    return (torch.randint(0, users, (n,)), torch.randint(0, items, (n,)), torch.randint(1, 6, (n,)).float())


def test_movielens_accuracy_smoke():
    from experiments.sparse_embedding import OPTIMIZERS, movielens_accuracy

    ratings = tiny_ratings()
    rows = movielens_accuracy(ratings, epochs=2, dim=4, batch=64, device="cpu")
    # graphs=True is the plain update on a CPU: not run there as a provider of its own
    assert [r["optimizer"] for r in rows] == [n for n in OPTIMIZERS.fns if n != "SparseAdamW (graphs)"]
    assert all(math.isfinite(r["test RMSE"]) and r["ms/step"] > 0 and r["peak MiB"] is None for r in rows)
    # Each optimizer sees the same batches whatever ran before it
    rmse = {r["optimizer"]: r["test RMSE"] for r in rows}
    alone = movielens_accuracy(ratings, epochs=2, dim=4, batch=64, device="cpu", optimizers=["SparseAdamW"])
    assert rmse["SparseAdamW"] == alone[0]["test RMSE"]


def test_sparse_embedding_command_line(tmp_path):
    from experiments import sparse_embedding

    with pytest.raises(SystemExit, match="missing"):  # an explicit --data must exist: no fallback
        sparse_embedding.main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o.json")])
    corrupt = tmp_path / "corrupt.whl"
    corrupt.write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="not readable as MovieLens-100k"):
        sparse_embedding.main(["--data", str(corrupt), "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit):
        sparse_embedding.main(["--epochs", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="GPU"):  # at once, before reading any data
            sparse_embedding.main(["--throughput", "--data", str(tmp_path / "missing")])
    folder = tmp_path / "ml-100k"  # the GroupLens layout, tiny
    folder.mkdir()
    u, i, r = tiny_ratings()
    (folder / "u.data").write_text("".join(f"{a + 1}\t{b + 1}\t{int(c)}\t0\n" for a, b, c in zip(u, i, r)))
    results = sparse_embedding.main(["--data", str(folder), "--epochs", "1", "--dim", "3", "--batch", "100",
                                     "--device", "cpu", "--out", str(tmp_path / "o.json")])
    assert (tmp_path / "o.json").exists()
    rmse = results.select(op="movielens MF", metric="test RMSE")  # each optimizer; graphs=True is CUDA's only
    assert len(rmse) == 4 and "SparseAdamW (graphs)" not in {r["provider"] for r in rmse}
    assert "tokens" not in next(iter(results.runs.values()))  # no stream was read
    with pytest.raises(SystemExit):  # flags of the throughput measurement alone
        sparse_embedding.main(["--data", str(folder), "--quick", "--device", "cpu"])


def test_throughput_machinery_on_a_cpu(monkeypatch):
    # The --throughput code end to end on tiny tables (its timings need a GPU: faked here).
    from experiments import harness
    from experiments import sparse_embedding as se
    from experiments.harness import Results, Timing

    for name, value in dict(TABLE_ROWS=500, TABLE_DIM=16, LOOKUPS=200, GPT2_DIM=8).items():
        monkeypatch.setattr(se, name, value)
    timed, stepped = [], []
    providers = [se.NO_STEP, *se.OPTIMIZERS.fns]
    training_step = se.training_step

    def tagged_training_step(emb, opt):  # says which optimizer a timed function stepped
        train_step = training_step(emb, opt)
        return lambda ids: (stepped.append(opt), train_step(ids))

    def provider_of(opt):
        if opt is None:
            return se.NO_STEP
        if isinstance(opt, SparseAdamW):
            return "SparseAdamW (graphs)" if opt.param_groups[0]["graphs"] else "SparseAdamW"
        return next(p for p in providers if p.split(" ")[0] == type(opt).__name__)

    def fake_time_call(fn, mode, **kw):
        # each provider's own value (the step alone: + 100), so a timing filed under another provider fails
        opt = getattr(fn, "__self__", None)
        if opt is not None:  # the step alone applies the gradient its optimizer's training step left
            assert all(p.grad is not None for g in opt.param_groups for p in g["params"])
        stepped.clear()
        fn()
        timed.append(mode)
        value = providers.index(provider_of(opt if opt is not None else (stepped or [None])[-1]))
        return Timing(*(value + (100 if opt is not None else 0),) * 3)

    monkeypatch.setattr(se, "training_step", tagged_training_step)

    monkeypatch.setattr(harness, "time_call", fake_time_call)  # what time_alternating calls
    monkeypatch.setattr(se, "copy_bandwidth_gbs", lambda: 1000.0)
    results = Results(se.STUDY)
    streams = ["uniform", "zipf1.5", "identical", "gpt2", "movielens-items"]
    tables = []
    monkeypatch.setattr(se, "kernel_table", lambda step, steps: tables.append(step) or "a table")
    se.throughput(streams, 2, tiny_ratings(), torch.randint(0, se.GPT2_VOCAB, (450,)), results, 1, device="cpu",
                  profile=True, rounds=2)
    text = se.throughput_report(results)
    assert len(results.failed) == len(streams) * 2 * 2  # SparseAdam, Adagrad: no graph, either op
    # per stream and round: the shared fwd+bwd in every mode, 5 optimizers x 2 ops eager and host, 3 capturable graph
    assert timed.count("graph") == 2 * len(streams) * (1 + 3 * 2)
    assert timed.count("eager") == 2 * len(streams) * (1 + 5 * 2)
    assert timed.count("host") == timed.count("eager")
    for row in results.select(metric="ms", op=("fwd+bwd+step", "step"), mode=se.TIMED_MODES):
        expected = providers.index(row["provider"]) + (100 if row["op"] == "step" else 0)
        assert row["p50"] == expected and row["rounds"] == [expected] * 2, row
    assert len(results.select(metric="ms", op="step", mode="eager")) == 5 * len(streams)
    assert len(tables) == len(streams)  # --profile: SparseAdamW's kernels on each stream
    for shape in dict.fromkeys(r["shape"] for r in results.rows):
        assert results.value(op="step", provider="SparseAdamW", shape=shape, mode="graph", metric="x floor") > 0
        assert shape in text
    assert results.value(op="ids", shape="identical, 500 x 16", metric="max lookups of one row") == 200


# ----------------------------------------------------------------------------------------------
# GPU (pytest -m gpu on the device)
# ----------------------------------------------------------------------------------------------


def train_in_a_cuda_graph(emb, opt, batches, head=None):
    """A training step on ``batches[0]`` warmed up on a side stream (compilation, state allocation, the
    step moved to the GPU), captured, then replayed on each later batch copied into its ids."""
    static_idx = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        train(emb, opt, [static_idx], head)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train(emb, opt, [static_idx], head)
    for idx in batches[1:]:
        static_idx.copy_(idx)
        graph.replay()
    torch.cuda.synchronize()


def zipf_ids(s, rows, n, device="cuda"):
    ranks = torch.multinomial(torch.arange(1, rows + 1, device=device, dtype=torch.float64).pow(-s), n,
                              replacement=True)
    return torch.randperm(rows, device=device)[ranks]


@pytest.mark.gpu
def test_planned_launches_match_triton_launches_bit_for_bit(monkeypatch, python_eager_path, device="cuda"):
    # PLANNED_LAUNCHES (on by default since this passed on the H200): steps relaunch both kernels from plans, a new
    # lr each step (a scheduler) included, with the same bits as Triton's own launches. Python's plans: the C++
    # path, which would serve these steps, is off (its own: test_cpp_eager_steps_match_python_steps_bit_for_bit).
    sa = kernel_module
    runtime = importlib.import_module("fuselab.kernels._runtime")
    relaunched = []
    call = runtime._LaunchPlan.__call__
    monkeypatch.setattr(runtime._LaunchPlan, "__call__", lambda self, t: relaunched.append(1) or call(self, t))
    torch.manual_seed(0)
    rows, lookups = 5000, 4096
    ids = [zipf_ids(1.1, rows, lookups, device) for _ in range(4)]
    finals = []
    for planned in (False, True):
        monkeypatch.setattr(sa, "PLANNED_LAUNCHES", planned)
        emb = torch.nn.Embedding(rows, 72, sparse=True, device=device)
        torch.nn.init.normal_(emb.weight, generator=torch.Generator(device).manual_seed(1))
        opt = SparseAdamW(emb.parameters(), lr=1e-2, weight_decay=0.1)
        for k, i in enumerate(ids * 2):
            opt.param_groups[0]["lr"] = 1e-2 / (k + 1)
            opt.zero_grad(set_to_none=True)
            emb(i).square().sum().backward()
            opt.step()
        finals.append(emb.weight.detach().clone())
    assert torch.equal(finals[0], finals[1])
    assert len(relaunched) >= 2 * 7  # both kernels, every step after the first


@pytest.mark.gpu
def test_cpp_eager_steps_match_python_steps_bit_for_bit(monkeypatch, device="cuda"):
    # The C++ eager path (eager_path.sparse_adamw_step) serves every step after the first of each layout up to
    # TRITON_SORT_MAX lookups: the sort's one-block and merge-pass launches, both update kernels, a new lr each
    # step, maximize, bf16, a step count on the device; the same bits as the Python path's, the same counts and
    # versions. Longer steps (torch.sort's) take the Python path.
    from fuselab.kernels import eager_path

    python_steps = []
    python_step = kernel_module.sparse_adamw_triton
    monkeypatch.setattr(kernel_module, "sparse_adamw_triton",
                        lambda *a, **k: python_steps.append(1) or python_step(*a, **k))
    torch.manual_seed(0)
    sizes = (700, 20_000, 20_000, 700, 20_000, 9000, 9000, 70_000, 70_000)  # past TRITON_SORT_MAX: Python
    assert kernel_module.TRITON_SORT_MAX < 70_000
    batches = [zipf_ids(1.1, 3000, n, device) for n in sizes]
    finals = []
    for cpp in (False, True):
        python_steps.clear()
        eager_path.enable(cpp)
        emb = torch.nn.Embedding(3000, 72, sparse=True, device=device)
        emb16 = torch.nn.Embedding(3000, 40, sparse=True, device=device, dtype=torch.bfloat16)
        for e, seed in ((emb, 1), (emb16, 2)):
            torch.nn.init.normal_(e.weight, generator=torch.Generator(device).manual_seed(seed))
        opt = SparseAdamW([{"params": [emb.weight]}, {"params": [emb16.weight], "maximize": True}],
                          lr=1e-2, weight_decay=0.1)
        versions = []
        for k, i in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (k + 1)
            opt.zero_grad(set_to_none=True)
            (emb(i).square().sum() + emb16(i).float().square().sum()).backward()
            before = emb.weight._version
            opt.step()
            versions.append(emb.weight._version > before)
        finals.append((emb.weight.detach().clone(), emb16.weight.detach().clone(),
                       opt.state[emb.weight]["step"].item(), opt.state[emb16.weight]["exp_avg_sq"].clone()))
        assert all(versions)
        if cpp:  # for each parameter: the first step of each of three layouts, and the steps past the sort's max
            assert eager_path.extension is not None and len(python_steps) == 2 * (3 + 2)
        else:
            assert len(python_steps) == 2 * len(batches)
    eager_path.enable(True)
    for a, b in zip(*finals):
        assert a == b if isinstance(a, float) else torch.equal(a, b)
    assert finals[1][2] == len(batches)


@pytest.mark.gpu
@pytest.mark.parametrize("ids", ["zipf1.5", "identical"])
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.bfloat16, 300), (torch.float16, 64)], ids=str)
def test_long_skewed_runs_match_reference(ids, dtype, dim):
    # 65,536 lookups a step as a real id stream has them: a few rows take most of them.
    rows, n = 100_000, 65_536
    idx = zipf_ids(1.5, rows, n) if ids == "zipf1.5" else torch.full((n,), 12345, device="cuda")
    values = torch.randn(n, dim, device="cuda").to(dtype)
    state = random_state(rows, dim, dtype, "cuda")
    check_update(state, fused_step(state, idx, values, 7, HP), idx, values, 7, HP, what=f"{ids} {dtype}")


@pytest.mark.gpu
def test_fused_update_is_bitwise_deterministic():
    # Programs run in any order on the GPU; the sums' order depends on the ids alone.
    idx = zipf_ids(1.1, 5000, 65_536)
    values = torch.randn(len(idx), 96, device="cuda")
    state = random_state(5000, 96, torch.float32, "cuda")
    first, again = fused_step(state, idx, values, 3, HP), fused_step(state, idx, values, 3, HP)
    kept = keep_each_rows_order(idx[:8192])
    part = fused_step(state, idx[:8192], values[:8192], 3, HP)
    part_shuffled = fused_step(state, idx[:8192][kept], values[:8192][kept], 3, HP)
    for a, b, c, d in zip(first, again, part, part_shuffled):
        assert torch.equal(a, b) and torch.equal(c, d)
    check_update(state, first, idx, values, 3, HP, what="zipf1.1")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.9, 0.999, 0.99999])
def test_bias_correction_every_step_to_a_million(beta):
    check_bias_correction(torch.arange(1, 1_000_001, device="cuda", dtype=torch.float32), beta)


@pytest.mark.gpu
@pytest.mark.parametrize("ids", ["uniform", "zipf1.5", "identical"])
def test_training_step_captured_in_cuda_graph(ids):
    # No host sync anywhere in forward + sparse backward + step: the whole step replays from a graph,
    # and N replays (fresh lookups copied in each time) equal N eager steps, step counts included.
    emb = embedding(1000, 64, "cuda", dtype=torch.float32)
    ref = copy.deepcopy(emb)
    make = {"uniform": lambda: torch.randint(0, 1000, (4099,), device="cuda"),
            "zipf1.5": lambda: zipf_ids(1.5, 1000, 4099),
            "identical": lambda: torch.full((4099,), int(torch.randint(0, 1000, (1,))), device="cuda")}[ids]
    batches = [make() for _ in range(6)]
    train(ref, SparseAdamW(ref.parameters(), **HP), batches)
    opt = SparseAdamW(emb.parameters(), **HP)
    train_in_a_cuda_graph(emb, opt, batches)
    assert opt.state[emb.weight]["step"].item() == len(batches)
    assert torch.equal(emb.weight, ref.weight)  # deterministic: the graph runs the same kernels on the same ids


@pytest.mark.gpu
def test_sparse_and_fused_dense_step_captured_in_cuda_graph():
    # A model with an embedding (sparse) and a Linear (dense, fused=True): the whole step captures.
    emb = embedding(500, 32, "cuda", dtype=torch.float32)
    head = torch.nn.Linear(32, 4, device="cuda")
    ref_emb, ref_head = copy.deepcopy(emb), copy.deepcopy(head)
    batches = [zipf_ids(1.1, 500, 2050) for _ in range(5)]
    train(ref_emb, SparseAdamW([*ref_emb.parameters(), *ref_head.parameters()], fused=True, **HP), batches, ref_head)
    opt = SparseAdamW([*emb.parameters(), *head.parameters()], fused=True, **HP)
    train_in_a_cuda_graph(emb, opt, batches, head)
    # cuBLAS may pick another algorithm under capture: the head's GEMMs agree to rounding, not bitwise
    torch.testing.assert_close(head.weight, ref_head.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(emb.weight, ref_emb.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_through_a_weight_the_step_changed_raises(device):
    # The fused update writes the rows in place outside autograd's view: it bumps their version counters
    # as an in-place op would, so a backward that saved the old weight raises, as with SparseAdam.
    emb = torch.nn.Embedding(50, 8, sparse=True, device=device)
    opt = SparseAdamW(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2, 2, 7], device=device)).sum().backward()
    saved = emb.weight.pow(2).sum()  # saves the weight as it is before the step
    version = emb.weight._version
    opt.step()
    assert emb.weight._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.gpu
def test_the_update_op_compiles_and_matches_eager():
    # torch.compile traces the op's Triton kernels (triton_op) with fake tensors: no launch plan, no data
    # pointer read while tracing; the compiled update gives the eager bits.
    idx = zipf_ids(1.1, 5000, 4096)
    values = torch.randn(len(idx), 96, device="cuda")
    state = random_state(5000, 96, torch.float32, "cuda")
    step = torch.tensor(3.0, device="cuda")
    hp = (HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"], False)

    def update(p, m, v):
        kernel_module.sparse_adamw_update_(p, m, v, idx, values, step, *hp)

    eager, compiled = [t.clone() for t in state], [t.clone() for t in state]
    update(*eager)
    torch.compile(update, fullgraph=True)(*compiled)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_graphs_leave_cpu_parameters_to_the_eager_update_and_survive_pickling():
    batches = [torch.randint(0, 40, (64,)) for _ in range(4)]
    ref, emb = embedding(40, 8, "cpu", torch.float32), embedding(40, 8, "cpu", torch.float32)
    emb.load_state_dict(ref.state_dict())
    train(ref, SparseAdamW(ref.parameters(), **HP), batches)
    opt = SparseAdamW(emb.parameters(), graphs=True, **HP)
    train(emb, opt, batches[:2])
    opt = pickle.loads(pickle.dumps(opt))  # what it keeps about graphs is not pickled, and rebuilt
    opt.param_groups[0]["params"] = [emb.weight]
    opt.state = {emb.weight: opt.state[next(iter(opt.state))]}
    train(emb, opt, batches[2:])
    assert not any(opt._graphs.values()) and torch.equal(emb.weight, ref.weight)


@pytest.fixture
def graph_calls(monkeypatch):
    """The graphed updates' captures and replays, in order."""
    from fuselab.optim import sparse_adamw as optim_module

    calls, graphed = [], optim_module._GraphedUpdate
    capture, replay = graphed.capture.__func__, graphed.replay
    monkeypatch.setattr(graphed, "capture", classmethod(lambda cls, *a: calls.append("capture") or capture(cls, *a)))
    monkeypatch.setattr(graphed, "replay", lambda self, *a: calls.append("replay") or replay(self, *a))
    return calls


def test_a_state_dict_saved_before_graphs_existed_loads_and_steps():
    emb = embedding(10, 4, "cpu", torch.float32)
    opt = SparseAdamW(emb.parameters(), **HP)
    train(emb, opt, [torch.tensor([1, 2])])
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["graphs"]
    opt = SparseAdamW(emb.parameters(), **HP)
    opt.load_state_dict(saved)
    train(emb, opt, [torch.tensor([1, 3])])
    assert opt.param_groups[0]["graphs"] is False


def graphed_and_eager(batches, change=lambda step, opt: None, dim=64, rows=3000, dtype=torch.float32):
    """(graphed embedding, its optimizer) after training it and an eagerly updated twin on ``batches``,
    ``change(step, opt)`` applied to both optimizers before each step; the twins agree after every step."""
    ref, emb = embedding(rows, dim, "cuda", dtype), embedding(rows, dim, "cuda", dtype)
    emb.load_state_dict(ref.state_dict())
    ref_opt, opt = SparseAdamW(ref.parameters(), **HP), SparseAdamW(emb.parameters(), graphs=True, **HP)
    for i, idx in enumerate(batches):
        change(i, ref_opt)
        change(i, opt)
        train(ref, ref_opt, [idx])
        train(emb, opt, [idx])
        torch.cuda.synchronize()
        assert torch.equal(emb.weight, ref.weight), f"step {i + 1}"
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[emb.weight][name], ref_opt.state[ref.weight][name]), (i, name)
    return emb, opt


REPLAYS_AFTER_A_NEW_KEY_AT_STEP_5 = ["capture"] + ["replay"] * 3 + ["capture"] + ["replay"] * 3  # 8 steps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graphed_updates_equal_eager_updates_bit_for_bit(graph_calls, dtype):
    # Step 1 is eager, step 2 captures, later ones replay; a new lr at step 5 runs eagerly and step 6 captures
    # again: every step's parameters and state are the eager optimizer's, bit for bit.
    def new_lr(step, opt):
        if step == 4:
            opt.param_groups[0]["lr"] = 0.01

    graphed_and_eager([zipf_ids(1.1, 3000, 4096) for _ in range(8)], new_lr, dtype=dtype)
    assert graph_calls == REPLAYS_AFTER_A_NEW_KEY_AT_STEP_5


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["state reloaded", "exp_avg replaced", "int64 step"])
def test_a_graphed_update_never_writes_through_stale_state(graph_calls, what):
    # New state tensors (a reload, a replaced moment kept alive elsewhere, a step count of another dtype at
    # perhaps the same address): the captured graph's addresses or dtypes are stale, the step runs eagerly.
    kept = []

    def replace(step, opt):
        if step != 4:
            return
        state = opt.state[opt.param_groups[0]["params"][0]]
        if what == "state reloaded":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        elif what == "exp_avg replaced":
            kept.append(state["exp_avg"])  # alive: its address is not reused
            state["exp_avg"] = state["exp_avg"].clone()
        else:
            count = int(state["step"].item())
            del state["step"]
            state["step"] = torch.tensor(count, dtype=torch.int64, device="cuda")

    graphed_and_eager([zipf_ids(1.1, 3000, 4096) for _ in range(8)], replace)
    assert graph_calls == REPLAYS_AFTER_A_NEW_KEY_AT_STEP_5


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_graphs_of_alternating_lookup_counts_are_kept(graph_calls, side_stream):
    # Lookup counts A A B B A A (an epoch's short last batch): the graph of A is replayed again after B's.
    sizes = [4096, 4096, 2048, 2048, 4096, 4096]
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed_and_eager([zipf_ids(1.1, 3000, n) for n in sizes])
        assert torch.cuda.current_stream() == stream
    assert graph_calls == ["capture", "replay", "capture", "replay", "replay", "replay"]


@pytest.mark.gpu
def test_graphs_leave_float64_parameters_to_the_eager_update(graph_calls):
    # PyTorch's float64 update syncs with the host: it is never captured, and the caller's stream stays current.
    graphed_and_eager([zipf_ids(1.1, 300, 512) for _ in range(3)], dtype=torch.float64)
    assert graph_calls == [] and torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu
def test_a_graphed_update_bumps_the_weights_version(graph_calls):
    emb = embedding(100, 16, "cuda", torch.float32)
    opt = SparseAdamW(emb.parameters(), graphs=True, lr=0.1)
    idx = torch.tensor([1, 2, 2, 7], device="cuda")
    for _ in range(3):
        train(emb, opt, [idx])
    emb(idx).sum().backward()
    saved = emb.weight.pow(2).sum()
    version = emb.weight._version
    opt.step()
    assert graph_calls[-1] == "replay" and emb.weight._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.gpu
def test_graphs_inside_a_callers_capture_take_the_plain_path():
    # The caller captures whole training steps: the optimizer captures nothing of its own inside.
    batches = [zipf_ids(1.1, 500, 2050) for _ in range(4)]
    ref, emb = embedding(500, 32, "cuda", torch.float32), embedding(500, 32, "cuda", torch.float32)
    emb.load_state_dict(ref.state_dict())
    train(ref, SparseAdamW(ref.parameters(), **HP), batches)
    opt = SparseAdamW(emb.parameters(), graphs=True, **HP)
    train_in_a_cuda_graph(emb, opt, batches)
    assert not any(opt._graphs.values()) and torch.equal(emb.weight, ref.weight)


def test_a_sparse_adam_state_dict_loads_and_steps():
    # torch.optim.SparseAdam's groups lack SparseAdamW's options (taken from this optimizer's own defaults)
    # and count steps in a Python int.
    emb = embedding(10, 4, "cpu", torch.float32)
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    train(emb, sparse_adam, [torch.tensor([1, 2, 2])])
    opt = SparseAdamW([{"params": emb.parameters(), "weight_decay": 0.1}], lr=0.01, weight_decay=0.0)
    opt.load_state_dict(sparse_adam.state_dict())  # options it lacks: the replaced group's, not the defaults
    train(emb, opt, [torch.tensor([1, 3])])
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["amsgrad"] is False
    assert torch.equal(opt.state[emb.weight]["step"], torch.tensor(2.0))


def test_rows_of_a_parameter_subclass_are_a_plain_tensor():
    # The C++ eager step takes plain tensors and Parameters only: a subclass's table (its view, a plain tensor) must
    # not reach it as the subclass, or every eager CUDA step would take the Python path.
    class TaggedParameter(torch.nn.Parameter):
        pass

    plain, tagged = torch.nn.Parameter(torch.zeros(4, 3)), TaggedParameter(torch.zeros(4, 3))
    assert SparseAdamW._rows(plain) is plain  # no view made: host time a step
    assert type(SparseAdamW._rows(tagged)) is torch.Tensor
