"""An MLP classifier trained stock and with ``fuse_linear_relu``: equal accuracy, time per step.

Data: Fashion-MNIST from ``--data`` (the idx files, as Debian's ``dataset-fashion-mnist`` installs
them under /usr/share/datasets/fashion-mnist, or a torchvision ``FashionMNIST`` root); when it
cannot be had, scikit-learn's bundled 8x8 digits, and the output says so.

    python experiments/train_mlp.py --epochs 3
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.nn import fuse_linear_relu  # noqa: E402
from fuselab.report import RESULTS, markdown_table, save_json  # noqa: E402

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def load_fashion_mnist(root: Path):
    """Train/test tensors through torchvision's own FashionMNIST loader.

    A folder holding the four ``*-ubyte.gz`` files (Debian's layout) is unpacked once into
    ``~/.cache/fuselab/FashionMNIST/raw``, the layout torchvision reads.
    """
    from torchvision.datasets import FashionMNIST
    from torchvision.datasets.utils import extract_archive

    if (root / "train-images-idx3-ubyte.gz").exists():
        cache = Path.home() / ".cache" / "fuselab"
        raw = cache / "FashionMNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for gz in root.glob("*-ubyte.gz"):
            if not (raw / gz.stem).exists():
                extract_archive(str(gz), str(raw))
        root = cache
    splits = [FashionMNIST(str(root), train=train, download=False) for train in (True, False)]
    return [(ds.data.float().div(255).flatten(1), ds.targets) for ds in splits], "Fashion-MNIST"


def load_digits():
    from sklearn.datasets import load_digits as sk_digits

    x, y = sk_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
    return [(x[:1500], y[:1500]), (x[1500:], y[1500:])], "sklearn digits (Fashion-MNIST not found)"


def train(model, data, epochs, batch, device, desc):
    (x, y), (xt, yt) = [(a.to(device), b.to(device)) for a, b in data]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    step_times = []  # of the last epoch only: earlier ones include autotuning and warm-up
    for _ in tqdm(range(epochs), desc=desc):
        step_times.clear()
        for idx in torch.randperm(len(x), generator=gen).to(device).split(batch):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t0)
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    return acc, sum(step_times) / len(step_times) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEBIAN_FASHION_MNIST)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    try:
        data, name = load_fashion_mnist(args.data)
    except (RuntimeError, OSError) as e:
        print(f"Fashion-MNIST not available at {args.data} ({e}); using scikit-learn's digits instead.")
        data, name = load_digits()
    torch.manual_seed(0)
    d_in, h = data[0][0].shape[1], args.hidden
    stock = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)).to(device)
    patched, report = fuse_linear_relu(copy.deepcopy(stock))
    print(report)
    rows = []
    for label, model in [("stock nn.Linear + ReLU", stock), ("fuse_linear_relu", patched)]:
        acc, ms = train(model, data, args.epochs, args.batch, device, label)
        rows.append({"model": label, "data": name, "epochs": args.epochs, "test accuracy": acc, "ms/step (last epoch)": ms})
    header = list(rows[0])
    print(markdown_table(header, [[r[k] for k in header] for r in rows]))
    print(f"saved {save_json(f'mlp_{device.type}', rows, {'fusion': str(report)}, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
