"""fuselab.optim.SparseAdamW against torch.optim.AdamW / SparseAdam, and its Triton kernel."""
import copy

import pytest
import torch

from fuselab.optim import SparseAdamW
from reference import DEVICES

HP = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


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
def test_untouched_rows_unchanged_and_empty_batch(device):
    emb = embedding(30, 4, device)
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


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dense_and_sparse_and_state_dict_round_trip(device):
    torch.manual_seed(0)
    emb = embedding(50, 6, device)
    head = torch.nn.Linear(6, 3, device=device, dtype=torch.float64)
    params = [{"params": emb.parameters()}, {"params": head.parameters(), "lr": 0.02}]
    opt = SparseAdamW(params, **HP)
    batches = [torch.randint(0, 50, (13,), device=device) for _ in range(8)]
    train(emb, opt, batches[:4], head)
    saved = copy.deepcopy(opt.state_dict()), copy.deepcopy(emb.state_dict()), copy.deepcopy(head.state_dict())
    # Reference dense params: AdamW on the head alone agrees with ours.
    train(emb, opt, batches[4:], head)
    emb2 = embedding(50, 6, device)
    head2 = torch.nn.Linear(6, 3, device=device, dtype=torch.float64)
    emb2.load_state_dict(saved[1])
    head2.load_state_dict(saved[2])
    opt2 = SparseAdamW([{"params": emb2.parameters()}, {"params": head2.parameters(), "lr": 0.02}], **HP)
    opt2.load_state_dict(saved[0])
    train(emb2, opt2, batches[4:], head2)
    assert torch.equal(emb.weight, emb2.weight) and torch.equal(head.weight, head2.weight)


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


@pytest.mark.parametrize("kwargs,words", [
    (dict(lr=-1.0), "learning rate"), (dict(eps=-1e-8), "eps"), (dict(betas=(1.0, 0.9)), "beta1"),
    (dict(betas=(0.9, -0.1)), "beta2"), (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SparseAdamW([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_bad_sparse_gradients():
    p = torch.nn.Parameter(torch.randn(6, 4).t())  # rows are not contiguous
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.randn(1, 6), (4, 6))
    with pytest.raises(ValueError, match="rows are contiguous"):
        SparseAdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(4, 6))
    q.grad = torch.sparse_coo_tensor(torch.tensor([[1], [2]]), torch.randn(1), (4, 6))  # element-sparse
    with pytest.raises(ValueError, match="sparse_dim 1"):
        SparseAdamW([q]).step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided int32 ids, transposed values"])
def test_triton_kernel_matches_pytorch_path(device, dtype, layout):
    from fuselab.kernels.sparse_adamw import sparse_adamw_torch, sparse_adamw_triton

    rows, dim = 37, 70  # dim not a power of two; many duplicate rows among 53 lookups
    idx = torch.randint(0, rows, (53,), device=device)
    vals = torch.randn(53, dim, device=device, dtype=dtype)
    if layout != "contiguous":  # what a direct caller of the functional update may pass
        idx = torch.stack([idx, idx]).t().reshape(-1).to(torch.int32)[::2]
        vals = vals.t().contiguous().t()
    state = [torch.randn(rows, dim, device=device, dtype=dtype), torch.randn(rows, dim, device=device, dtype=dtype) * 0.1,
             torch.rand(rows, dim, device=device, dtype=dtype)]
    ref = [t.clone() for t in state]
    args = (idx, vals, 0.01, 0.9, 0.999, 1e-8, 0.05, torch.tensor(3.0, device=device), False)
    sparse_adamw_triton(*state, *args)
    sparse_adamw_torch(*ref, *args)
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # one rounding of the stored 16-bit values
    for got, want in zip(state, ref):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not torch.equal(state[0], torch.zeros_like(state[0]))


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


def test_update_op_opcheck():
    idx = torch.tensor([4, 1, 4, 0, 6])
    args = (torch.randn(7, 5), torch.randn(7, 5) * 0.1, torch.rand(7, 5), idx, torch.randn(5, 5),
            torch.tensor(2.0), 0.01, 0.9, 0.999, 1e-8, 0.05, False)
    torch.library.opcheck(torch.ops.fuselab.sparse_adamw_update_, args)


@pytest.mark.gpu
def test_fused_update_is_bitwise_deterministic():
    # The row lists are linked by atomics in whatever order the GPU runs; the sum over a row's
    # lookups is taken in lookup order, so two runs from the same state agree bit for bit.
    from fuselab.kernels.sparse_adamw import sparse_adamw_triton

    torch.manual_seed(0)
    idx = torch.randint(0, 40, (8191,), device="cuda")  # ~200 lookups a row
    values = torch.randn(8191, 96, device="cuda")
    start = [torch.randn(40, 96, device="cuda"), torch.randn(40, 96, device="cuda") * 0.1,
             torch.rand(40, 96, device="cuda")]
    results = []
    for _ in range(2):
        state = [t.clone() for t in start]
        sparse_adamw_triton(*state, idx, values, 0.01, 0.9, 0.999, 1e-8, 0.05, torch.tensor(3.0, device="cuda"), False)
        results.append(state)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], start[0])


@pytest.mark.gpu
def test_training_step_captured_in_cuda_graph():
    # No host sync anywhere in forward + sparse backward + step: the whole step replays from a graph,
    # and N replays (fresh lookups copied in each time) equal N eager steps, step counts included.
    torch.manual_seed(0)
    emb = embedding(1000, 64, "cuda", dtype=torch.float32)
    ref = copy.deepcopy(emb)
    batches = [torch.randint(0, 1000, (257,), device="cuda") for _ in range(6)]
    train(ref, SparseAdamW(ref.parameters(), **HP), batches)
    opt = SparseAdamW(emb.parameters(), **HP)
    static_idx = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: autotune, state allocation, the step moved to the GPU
        train(emb, opt, [static_idx])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train(emb, opt, [static_idx])
    for idx in batches[1:]:
        static_idx.copy_(idx)
        graph.replay()
    torch.cuda.synchronize()
    assert opt.state[emb.weight]["step"].item() == len(batches)
    torch.testing.assert_close(emb.weight, ref.weight, rtol=1e-5, atol=1e-6)


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
