"""An MLP classifier trained stock and with ``fuse_linear_relu``: equal accuracy, time per step.

Data: Fashion-MNIST through ``experiments.data.fashion_mnist``. ``--data`` names a folder of Debian's
four idx ``*-ubyte.gz`` files or a torchvision ``FashionMNIST`` root; a ``--data`` that is missing or
corrupt is an error. Without ``--data`` the default (/usr/share/datasets/fashion-mnist, installed by
``make data``) is read, and where it is absent scikit-learn's bundled 8x8 digits are used instead:
the output says so and the rows name the data.

Study ``train_mlp`` (long format, ``experiments/harness.py``): op ``train on <device>``; providers
``stock`` (nn.Linear + nn.ReLU, the baseline) and ``fuse_linear_relu`` (the same initial weights,
patched); shape ``<data>, <layer widths>, batch <b>``; metrics ``test accuracy`` after ``--epochs``
and ``ms/step`` (wall mode: one AdamW step on a training batch, synchronized, timed after training).

    python -m experiments.train_mlp --epochs 3             # writes runs/train_mlp.json
    python -m experiments.train_mlp --epochs 3 --results   # results/train_mlp.json (the docs' source)
"""
import argparse
import copy

import torch
from torch import nn
from tqdm import tqdm

from experiments import data as datasets
from experiments.harness import (
    Providers,
    Results,
    add_output_args,
    cycle,
    output_path,
    parse_device,
    pivot,
    positive_float,
    positive_int,
    time_call,
)

STUDY = "train_mlp"
PROVIDERS = Providers()


@PROVIDERS.register("stock", baseline=True)
def stock(model: nn.Module) -> nn.Module:
    return model


@PROVIDERS.register("fuse_linear_relu")
def fused(model: nn.Module) -> nn.Module:
    from fuselab.nn import fuse_linear_relu

    patched, report = fuse_linear_relu(copy.deepcopy(model))
    print(report)
    return patched


def load(path):
    """((train x, y), (test x, y)) as float features in [0, 1], and the data's name. ``path`` None:
    the default Fashion-MNIST, else scikit-learn's digits (said on the output)."""
    try:
        splits = datasets.fashion_mnist(datasets.FASHION_MNIST if path is None else path)
    except datasets.DataNotFound as e:
        if path is not None:
            raise
        print(f"Fashion-MNIST not found ({e}).\nUsing scikit-learn's 8x8 digits instead; pass --data or run "
              "`make data` for Fashion-MNIST.")
        return datasets.digits(), "sklearn digits"
    return [(x.float().div(255).flatten(1), y) for x, y in splits], "Fashion-MNIST"


def train(model, splits, epochs, batch, lr, device, desc=""):
    """Train ``epochs`` epochs with AdamW (a progress bar named ``desc``); (test accuracy, the training step,
    batches to time it on)."""
    (x, y), (xt, yt) = [(a.to(device), b.to(device)) for a, b in splits]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    for _ in tqdm(range(epochs), desc=desc, unit="epoch"):
        for idx in torch.randperm(len(x), generator=gen).to(device).split(batch):
            step(x[idx], y[idx])
    model.eval()
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    model.train()
    batches = [(x[idx], y[idx]) for idx in torch.randperm(len(x), generator=gen).to(device).split(batch)[:16]
               if len(idx) == batch] or [(x[:batch], y[:batch])]
    return acc, step, batches


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=str, default=None,
                   help="Fashion-MNIST folder (Debian idx .gz files or a torchvision root); an error if missing "
                        f"or corrupt. Default: {datasets.FASHION_MNIST}, else scikit-learn's digits")
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch", type=positive_int, default=256)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--timed-steps", type=positive_int, default=20, help="training steps timed after training")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_output_args(p)
    args = p.parse_args(argv)
    device = parse_device(p, args.device, STUDY)
    out = output_path(args, STUDY)
    try:
        splits, name = load(args.data)
    except datasets.DataNotFound as e:
        p.error(f"--data {args.data}: {e}")

    torch.manual_seed(0)
    d_in, h = splits[0][0].shape[1], args.hidden
    base = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)).to(device)
    initial = copy.deepcopy(base)  # every provider starts from the same weights
    results = Results(STUDY, device=device)
    results.annotate(data=name if args.data is None else f"{name} ({args.data})", lr=args.lr, hidden=args.hidden)
    results.set_baseline(f"train on {device.type}", PROVIDERS)
    op, shape = f"train on {device.type}", f"{name}, {d_in}-{h}-{h}-10, batch {args.batch}"
    for provider, make in PROVIDERS.select(None).items():
        model = make(copy.deepcopy(initial))
        acc, step, batches = train(model, splits, args.epochs, args.batch, args.lr, device, desc=f"train {provider}")
        keys = dict(op=op, provider=provider, shape=shape, dtype="fp32", mode="wall", epochs=args.epochs)
        results.record(metric="test accuracy", value=acc, **keys)
        timing = time_call(cycle(step, batches), "wall", iters=args.timed_steps, warmup_iters=2)
        results.record(metric="ms/step", value=timing, **keys)
    for metric in ("test accuracy", "ms/step"):
        print(f"\n{metric}:\n" + pivot(results.select(metric=metric), ["op", "shape"], baseline=None))
    if device.type == "cpu":
        print("On a CPU both models run PyTorch's ops (the fused layers fall back): the rows show that patching "
              "keeps the accuracy; the patched model's ms/step adds the fused layers' Python dispatch to PyTorch's "
              "kernels, and says nothing about a GPU.")
    print(f"saved {results.save(out, merge=args.merge)}")
    return results


if __name__ == "__main__":
    main()
