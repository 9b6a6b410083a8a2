"""Distillation and quantization on Fashion-MNIST: a ResNet-50-class teacher, ResNet-18-class and small-CNN
students trained from scratch and distilled, then the distilled students quantized (INT8 on the CPU and the
GPU, FP8 on Hopper): accuracy, state_dict size and latency.

Models (``experiments/models.py``): the teacher is torchvision's ResNet-50 and the ResNet student
torchvision's ResNet-18, both with a 1-channel 3x3 stride-1 stem and no max-pool (``resnet_28x28``);
the edge student is ``small_cnn`` (two conv stages, then Linear -> ReLU -> Linear). ``--tiny`` shrinks
the three (width 8, one block per stage) and the data (1,024 training and 512 test images) for CI.

Training: SGD (momentum 0.9, Nesterov, weight decay 5e-4), the LR warmed up linearly over 15% of the
steps then decayed on a cosine, batch ``--batch``, bf16 autocast on CUDA. The teacher sees random
horizontal flips and shifts of up to 2 pixels; the students see random horizontal flips only, so the
teacher's logits for both orientations of every training image are computed once before the
students train. For each seed the scratch and the distilled student start from the same weights and
see the same batches in the same order with the same flips, for the same epochs under the same
optimizer and schedule; only the loss differs: cross-entropy, or
``fuselab.quant.DistillationLoss(--temperature, --alpha)`` against the teacher's logits (defaults
T = 2, alpha = 0.25: the PyTorch knowledge-distillation tutorial's weights).

Quantization, of the distilled students only:
  CPU   ``fuselab.quant.quantize_pt2e_x86`` (torchao's pt2e route: static INT8 of convolutions and
        Linear layers through X86InductorQuantizer on ``torch.export``, calibrated on training
        images; accuracy from the converted graph as it is, latency through ``torch.compile`` with
        inductor's freezing, fp32's compiled alike) where torchao imports; without torchao,
        ``fuselab.quant.quantize_`` with dynamic INT8 on the Linear layers alone. The provider name
        says which ran.
  GPU   ``fuselab.quant.quantize_`` (fuselab's Triton GEMMs; Linear layers only, convolutions stay
        fp32): INT8 with dynamic per-token activations, INT8 with static activation scales from
        ``calibrate``, and FP8 e4m3 rowwise on Hopper.

Study ``distill_quantize`` (long format, ``experiments/harness.py``), rows:
  op ``accuracy``          metric ``test accuracy``; shape ``seed k`` per seed and ``seeds 0,1,2``
                           (p20/p50/p80 the quantiles of the seeds' accuracies; ``mean`` and ``std``
                           beside them)
  op ``size``              metric ``MB`` (10^6 bytes of the serialized state_dict, see ``state_bytes``;
                           ``bytes`` and the tensor bytes per dtype beside it)
  op ``cpu latency: <m>``  metric ``ms``; shape ``batch 1`` / ``batch 64``; mode ``wall``; the
                           fp32 eager student is the baseline, beside it the student under
                           ``torch.compile`` and the INT8 student
  op ``gpu latency: <m>``  metric ``ms``; mode ``eager`` (do_bench) and ``graph`` (CUDA graph replay)
Providers: ``teacher``, ``scratch resnet18``, ``distilled resnet18``, ``distilled resnet18 int8 (cpu, pt2e)``,
``distilled resnet18 int8 dynamic (gpu)`` (Linear layers), ``... int8 dynamic+conv (gpu)`` (convolutions
too: Int8Conv2d), ``... int8 static (gpu)``, ``... fp8 (gpu)``, and the same
for ``cnn``. Every row of a model variant carries ``model``: the provider whose accuracy it has.

Besides the JSON: ``<out>.md`` (one table: accuracy mean and spread, size, latencies, and whether the
distilled student beats the scratch one beyond the seeds' spread) and ``<out>.png`` (accuracy against
size and against latency).

    python -m experiments.distill_quantize --tiny                          # CPU smoke run (CI)
    python -m experiments.distill_quantize --device cuda --data data/fashion-mnist \\
        --teacher-ckpt runs/distill_teacher.pt --save-students runs/students   # train, GPU quantization
                                 # (--data: a copy of Debian's idx files, e.g. carried to a GPU machine)
    python -m experiments.distill_quantize --load-students runs/students --merge   # CPU INT8 and latency
"""
import argparse
import copy
import io
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from experiments import data as datasets
from experiments.harness import (
    Results,
    add_output_args,
    in_results,
    markdown_table,
    non_negative_int,
    output_path,
    parse_device,
    positive_float,
    positive_int,
    require_cuda,
    time_call,
)
from experiments.training import warmup_cosine_schedule

STUDY = "distill_quantize"
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's training pixels
CKPT_FORMAT = "fuselab-distill-ckpt/1"
SHARD_BYTES = 15 * 2**20  # a saved student's files stay under 16 MiB each
STUDENTS = ("resnet18", "cnn")
BATCHES = (1, 64)  # latency batch sizes


# ----------------------------------------------------------------------------------------------
# Models and data
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """How a model is built: ``kind`` resnet50 / resnet18 / cnn, and its size."""
    kind: str
    width: int
    blocks: Optional[Tuple[int, ...]] = None
    hidden: int = 128

    def build(self) -> nn.Module:
        from experiments.models import resnet_28x28, small_cnn

        if self.kind == "cnn":
            return small_cnn(self.width, self.hidden)
        return resnet_28x28(self.kind, self.width, self.blocks)

    @classmethod
    def of(cls, d: dict) -> "Arch":
        return cls(d["kind"], d["width"], tuple(d["blocks"]) if d.get("blocks") else None, d.get("hidden", 128))


ARCHS = {"teacher": Arch("resnet50", 64), "resnet18": Arch("resnet18", 64), "cnn": Arch("cnn", 32, None, 128)}
TINY_ARCHS = {"teacher": Arch("resnet50", 8, (1, 1, 1, 1)), "resnet18": Arch("resnet18", 8, (1, 1, 1, 1)),
              "cnn": Arch("cnn", 8, None, 32)}
TINY_TRAIN, TINY_TEST = 1024, 512


@dataclass
class Data:
    x: torch.Tensor  # uint8 (N, 28, 28), on the training device
    y: torch.Tensor
    xt: torch.Tensor
    yt: torch.Tensor
    name: str


def load_data(path: Optional[str], tiny: bool, device: torch.device) -> Data:
    """Fashion-MNIST (``path`` None: the default Debian folder); ``--tiny`` takes fixed random subsets."""
    root = datasets.FASHION_MNIST if path is None else Path(path)
    (x, y), (xt, yt) = datasets.fashion_mnist(root)
    name = "Fashion-MNIST"
    if tiny:
        gen = torch.Generator().manual_seed(0)
        tr = torch.randperm(len(x), generator=gen)[:TINY_TRAIN]
        te = torch.randperm(len(xt), generator=gen)[:TINY_TEST]
        x, y, xt, yt = x[tr], y[tr], xt[te], yt[te]
        name += f" (tiny: {len(x)} train, {len(xt)} test images)"
    return Data(*(t.contiguous().to(device) for t in (x, y, xt, yt)), name=name)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 28, 28) -> float32 (B, 1, 28, 28), standardized."""
    return ((x.float() / 255 - MEAN) / STD).unsqueeze(1)


def augment(x: torch.Tensor, gen: torch.Generator, shift: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random horizontal flips and (``shift`` > 0) random shifts of up to ``shift`` pixels (zero
    padded), drawn from ``gen`` on the host; (images, flipped mask on x's device)."""
    b, h, w = x.shape
    flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
    x = torch.where(flip[:, None, None], x.flip(-1), x)
    if shift:
        padded = F.pad(x, (shift,) * 4)
        oy, ox = (torch.randint(0, 2 * shift + 1, (b,), generator=gen).to(x.device) for _ in range(2))
        rows = (oy[:, None] + torch.arange(h, device=x.device))[:, :, None]
        cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, :]
        x = padded[torch.arange(b, device=x.device)[:, None, None], rows, cols]
    return x, flip


def progress(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in a log file (the per-model lines say what finished)
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0, leave=False, disable=None)


# ----------------------------------------------------------------------------------------------
# Training and evaluation
# ----------------------------------------------------------------------------------------------


def train(model: nn.Module, data: Data, *, epochs: int, batch: int, lr: float, seed: int, shift: int,
          desc: str, teacher_logits: Optional[torch.Tensor] = None, distill: Optional[nn.Module] = None) -> float:
    """Train in place; returns the seconds it took. ``teacher_logits`` (2, N, classes): the teacher on
    every training image and on its mirror image, for ``distill``; else cross-entropy."""
    device = data.x.device
    n = len(data.x)
    batch = min(batch, n)
    steps = n // batch
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = warmup_cosine_schedule(opt, max(1, int(0.15 * epochs * steps)), epochs * steps)  # 15% warm-up
    cuda = device.type == "cuda"
    model.train()
    bar = progress(epochs * steps, desc)
    t0 = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        for i in range(steps):
            idx = perm[i * batch:(i + 1) * batch]
            xb, flipped = augment(data.x[idx], gen, shift)
            xb = normalize(xb)
            if cuda:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                out = model(xb)
            if teacher_logits is None:
                loss = F.cross_entropy(out.float(), data.y[idx])
            else:
                t = torch.where(flipped[:, None], teacher_logits[1][idx], teacher_logits[0][idx])
                loss = distill(out, t, data.y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if i % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update()
    if cuda:
        torch.cuda.synchronize()
    bar.close()
    model.eval()
    return time.perf_counter() - t0


@torch.inference_mode()
def predict(model: Callable, x: torch.Tensor, batch: int = 500, autocast: bool = False) -> torch.Tensor:
    """Logits of ``model`` on uint8 images ``x`` (the model already in eval mode), in batches."""
    outs = []
    for i in range(0, len(x), batch):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            outs.append(model(normalize(x[i:i + batch])).float())
    return torch.cat(outs)


def accuracy(model: Callable, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    x, y = x.to(device), y.to(device)
    return (predict(model, x).argmax(1) == y).float().mean().item()


def teacher_logits(teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(2, N, classes): the teacher's logits on every image and on its horizontal mirror."""
    cuda = x.device.type == "cuda"
    return torch.stack([predict(teacher, x, autocast=cuda), predict(teacher, x.flip(-1), autocast=cuda)])


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def _cpu_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", memory_format=torch.contiguous_format).clone()
            for k, v in model.state_dict().items()}


def load_teacher(path: Path, arch: Arch, epochs: int, train_size: int) -> Optional[Tuple[nn.Module, dict]]:
    """The teacher cached at ``path`` (None when there is none); an error when it was trained otherwise."""
    if not path.exists():
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise SystemExit(f"--teacher-ckpt {path}: cannot read it ({type(e).__name__}: {e}); delete it to retrain")
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT or ck.get("role") != "teacher":
        raise SystemExit(f"--teacher-ckpt {path} is not a teacher checkpoint of this script; delete it to retrain")
    want = {"arch": asdict(arch), "epochs": epochs, "train_size": train_size}
    have = {"arch": ck["arch"], "epochs": ck["epochs"], "train_size": ck["train_size"]}
    have["arch"]["blocks"] = tuple(have["arch"]["blocks"]) if have["arch"].get("blocks") else None
    if have != want:
        raise SystemExit(f"--teacher-ckpt {path} holds a teacher trained with {have}, not {want} "
                         "(--teacher-epochs, --tiny): pass another path, or delete it to retrain")
    model = arch.build()
    model.load_state_dict(ck["state_dict"])
    return model.eval(), ck


def save_teacher(path: Path, model: nn.Module, arch: Arch, epochs: int, train_size: int, acc: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"format": CKPT_FORMAT, "role": "teacher", "arch": asdict(arch), "epochs": epochs,
                "train_size": train_size, "accuracy": acc, "state_dict": _cpu_state(model)}, tmp)
    tmp.replace(path)


def save_student(folder: Path, name: str, model: nn.Module, meta: dict) -> List[Path]:
    """``model``'s fp32 state_dict as ``<name>.<i>.pt`` files of at most SHARD_BYTES of tensors each
    (small enough to come back from a lent GPU machine), each with ``meta``."""
    folder.mkdir(parents=True, exist_ok=True)
    state = _cpu_state(model)
    shards: List[Dict[str, torch.Tensor]] = []
    sizes: List[int] = []
    for k, v in sorted(state.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):  # first fit, decreasing
        nbytes = v.numel() * v.element_size()
        i = next((i for i, size in enumerate(sizes) if size + nbytes <= SHARD_BYTES), None)
        if i is None:
            shards.append({})
            sizes.append(0)
            i = len(shards) - 1
        shards[i][k] = v
        sizes[i] += nbytes
    for old in folder.glob(f"{name}.*.pt"):
        old.unlink()
    paths = []
    for i, shard in enumerate(shards):
        path = folder / f"{name}.{i}.pt"
        torch.save({"format": CKPT_FORMAT, "role": "student", "shard": i, "of": len(shards), **meta,
                    "state_dict": shard}, path)
        paths.append(path)
    return paths


def load_students(folder: Path) -> List[Tuple[dict, nn.Module]]:
    """Every student saved in ``folder`` by ``save_student``: [(meta, model in eval mode)]."""
    groups: Dict[str, List[Path]] = {}
    for path in sorted(folder.glob("*.pt")):
        groups.setdefault(path.name.rsplit(".", 2)[0], []).append(path)
    out = []
    for name, paths in sorted(groups.items()):
        parts = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
        if any(p.get("format") != CKPT_FORMAT or p.get("role") != "student" for p in parts):
            raise SystemExit(f"--load-students {folder}: {name}.*.pt are not students saved by this script")
        if sorted(p["shard"] for p in parts) != list(range(parts[0]["of"])):
            raise SystemExit(f"--load-students {folder}: {name} has shards {sorted(p['shard'] for p in parts)} "
                             f"of {parts[0]['of']}: copy all of them")
        meta = {k: v for k, v in parts[0].items() if k not in ("state_dict", "shard", "of")}
        model = Arch.of(meta["arch"]).build()
        model.load_state_dict({k: v for p in parts for k, v in p["state_dict"].items()})
        out.append((meta, model.eval()))
    if not out:
        raise SystemExit(f"--load-students {folder}: no students there (written by --save-students)")
    return out


# ----------------------------------------------------------------------------------------------
# Quantization (fuselab.quant) and measurements
# ----------------------------------------------------------------------------------------------


def has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def fuselab_quantize(model: nn.Module, kind: str, calib: List[torch.Tensor]) -> nn.Module:
    """A copy of ``model`` through ``fuselab.quant.quantize_`` (``kind`` int8 dynamic, int8 dynamic+conv
    (convolutions too), int8 static or fp8), its Linear -> ReLU pairs first fused by ``fuse_linear_relu``
    (the ReLU then runs in the GEMM's epilogue); the report, with each layer's error on the calibration
    batches, is printed."""
    from fuselab import quant
    from fuselab.nn import fuse_linear_relu

    model = copy.deepcopy(model).eval()
    calibration = quant.calibrate(model, calib, len(calib), progress=False)
    model, fused = fuse_linear_relu(model)
    if kind == "int8 static":
        config = quant.Int8StaticActivationInt8WeightConfig(act_scales=calibration.act_scales())
    elif kind == "int8 dynamic+conv":  # the convolutions too (Int8Conv2d): a conv net's weights are mostly theirs
        config = quant.Int8DynamicActivationInt8WeightConfig(conv2d=True)
    else:
        config = {"int8 dynamic": quant.Int8DynamicActivationInt8WeightConfig,
                  "fp8": quant.Float8RowwiseConfig}[kind]()
    report = quant.quantize_(model, config, calibration=calibration)
    print(f"fuse_linear_relu: {fused}\nquantize_ ({kind}): {report}")
    return model.eval()


def pt2e_quantize(model: nn.Module, calib: List[torch.Tensor]) -> nn.Module:
    """A copy of ``model`` through ``fuselab.quant.quantize_pt2e_x86``: static INT8 calibrated on ``calib``
    (the converted graph, to be run through ``torch.compile`` for the int8 kernels)."""
    from fuselab.quant import quantize_pt2e_x86

    return quantize_pt2e_x86(copy.deepcopy(model).eval(), (calib[0],), calib, len(calib), progress=False)


def state_bytes(model: nn.Module) -> Tuple[int, Dict[str, int]]:
    """Bytes of the serialized state_dict, and its tensor bytes per dtype. For a GraphModule (pt2e's
    converted model) the tensors its graph reads: ``convert_pt2e`` folds the int8 weights into new
    constants and leaves the unused fp32 weights in the state_dict, which a deployed graph does not carry."""
    if isinstance(model, torch.fx.GraphModule):
        tensors = {}
        for node in model.graph.nodes:
            if node.op == "get_attr":
                obj = model
                for part in node.target.split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, torch.Tensor):
                    tensors[node.target] = obj
    else:
        tensors = dict(model.state_dict())
    by_dtype: Dict[str, int] = {}
    for t in tensors.values():
        key = str(t.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, buf)
    return buf.tell(), by_dtype


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


class Study:
    """Rows of one run, with the helpers that name them consistently."""

    def __init__(self, results: Results):
        self.res = results

    def accuracy(self, provider: str, seed: int, value: float, dtype: str = "fp32", fp32: Optional[str] = None):
        """``fp32``: the provider of the float model that this one was quantized from."""
        extra = {"fp32": fp32} if fp32 else {}
        self.res.record(op="accuracy", provider=provider, shape=f"seed {seed}", dtype=dtype, mode="eval",
                        metric="test accuracy", value=value, model=provider, seed=seed, **extra)

    def accuracy_summary(self, provider: str, accs: Dict[int, float], dtype: str = "fp32", **extra):
        from experiments.harness import Timing

        vals = [accs[s] for s in sorted(accs)]
        self.res.record(op="accuracy", provider=provider, shape="seeds " + ",".join(map(str, sorted(accs))),
                        dtype=dtype, mode="eval", metric="test accuracy", value=Timing.of(vals),
                        model=provider, mean=statistics.fmean(vals),
                        std=statistics.stdev(vals) if len(vals) > 1 else 0.0, n=len(vals), **extra)

    def refresh_summaries(self) -> None:
        """Recompute every accuracy summary from the per-seed rows present: after a ``--merge`` with a
        run of other seeds (or the same seed again), the summaries written earlier are stale."""
        rows = self.res.rows
        summarized = {(r["provider"], r["dtype"]) for r in rows if r["op"] == "accuracy"
                      and r["shape"].startswith("seeds ")}
        self.res.rows = [r for r in rows if not (r["op"] == "accuracy" and r["shape"].startswith("seeds "))]
        by_seed: Dict[Tuple[str, str], Dict[int, dict]] = {}
        for r in self.res.rows:
            if r["op"] == "accuracy" and (r["provider"], r["dtype"]) in summarized and r["shape"].startswith("seed "):
                by_seed.setdefault((r["provider"], r["dtype"]), {})[int(r["shape"].split()[1])] = r
        for (provider, dtype), seeds in by_seed.items():  # the runs that measured the seeds, for the reader
            self.accuracy_summary(provider, {s: r["p50"] for s, r in seeds.items()}, dtype=dtype,
                                  seed_runs=sorted({r["run"] for r in seeds.values()}))

    def size(self, provider: str, model: nn.Module, dtype: str = "fp32", fp32: Optional[str] = None):
        """``fp32``: the provider of the float model that ``model`` was quantized from."""
        if self.res.select(op="size", provider=provider, dtype=dtype):
            return  # measured already in this run (a size does not depend on the seed)
        nbytes, by_dtype = state_bytes(model)
        extra = {"fp32": fp32} if fp32 else {}
        self.res.record(op="size", provider=provider, shape="state_dict", dtype=dtype, mode="serialized",
                        metric="MB", value=nbytes / 1e6, model=provider, bytes=nbytes, tensor_bytes=by_dtype,
                        **extra)

    def latency(self, where: str, arch: str, provider: str, fn: Callable, batch: int, mode: str, dtype: str,
                model: str, timing: dict, **extra):
        op = f"{where} latency: {arch}"
        keys = dict(op=op, provider=provider, shape=f"batch {batch}", dtype=dtype, mode=mode)
        try:
            t = time_call(fn, mode, **timing)
        except Exception as e:  # a compiler error, a graph that will not capture: listed, not fatal
            print(f"  {op}, {provider}, batch {batch}, {mode}: failed ({type(e).__name__}: {e})")
            self.res.fail(error=e, **keys)
            return None
        if where == "cpu":
            extra.update(threads=torch.get_num_threads(), cpu=cpu_name())
        self.res.record(metric="ms", value=t, model=model, **keys, **extra)
        print(f"  {op}, {provider}, batch {batch}, {mode}: {t.p50:.3f} ms")
        return t


def parse_seeds(text: str) -> List[int]:
    try:
        seeds = [non_negative_int(s.strip()) for s in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"comma-separated integers >= 0, got {text!r} ({e})") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed repeats in {text!r}")
    return seeds


def parse_students(text: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STUDENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"a comma-separated subset of {list(STUDENTS)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=str, default=None,
                   help="Fashion-MNIST folder (Debian's four idx .gz files, or a torchvision root); an error if "
                        f"missing or corrupt (default: {datasets.FASHION_MNIST})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the models train and are evaluated (default: cuda when there is one)")
    p.add_argument("--tiny", action="store_true",
                   help=f"tiny models and {TINY_TRAIN}/{TINY_TEST} images, a few epochs, seeds 0,1 (CI smoke run)")
    p.add_argument("--epochs", type=positive_int, default=None, help="student epochs (default 10; --tiny 2)")
    p.add_argument("--teacher-epochs", type=positive_int, default=None, help="teacher epochs (default 15; --tiny 3)")
    p.add_argument("--seeds", type=parse_seeds, default=None, help="student seeds (default 0,1,2; --tiny 0,1)")
    p.add_argument("--students", type=parse_students, default=list(STUDENTS), help="resnet18, cnn or both")
    p.add_argument("--batch", type=positive_int, default=None, help="training batch (default 256; --tiny 64)")
    p.add_argument("--lr", type=positive_float, default=0.1, help="SGD's peak learning rate")
    p.add_argument("--temperature", type=positive_float, default=2.0,
                   help="DistillationLoss's temperature (default 2, the PyTorch distillation tutorial's)")
    p.add_argument("--alpha", type=float, default=0.25,
                   help="DistillationLoss's weight of the soft (KL) term, in [0, 1] (default 0.25, the tutorial's)")
    p.add_argument("--teacher-ckpt", type=Path, default=None,
                   help="reuse the teacher saved here (an error if it was trained with other settings); "
                        "without one there, train it and save it here")
    p.add_argument("--save-students", type=Path, default=None,
                   help="save the distilled students of every seed here (files under 16 MiB)")
    p.add_argument("--load-students", type=Path, default=None,
                   help="skip training: quantize and time the students saved by --save-students")
    p.add_argument("--skip-quant", action="store_true", help="no quantization (accuracy, sizes, fp32 latency)")
    p.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU part: INT8 on the CPU and CPU latency (default: with --device cpu)")
    p.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU part: fuselab's INT8/FP8 on the GPU and GPU latency (default: with --device cuda)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 rowwise in the GPU part (default: on a GPU of compute capability >= 8.9)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU latency of torch.compile'd models too (fp32, and the pt2e INT8 model)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads for CPU latency (default: the cores this process may use, "
                        f"{default_threads()} here)")
    p.add_argument("--calib-batches", type=positive_int, default=None,
                   help="training batches that calibrate static INT8 (default 16; --tiny 2)")
    p.add_argument("--rep-ms", type=positive_float, default=None,
                   help="milliseconds of samples per latency measurement (default 1000; --tiny 20)")
    add_output_args(p)
    args = p.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        p.error(f"--alpha must be in [0, 1], got {args.alpha}")
    tiny = args.tiny
    args.epochs = args.epochs or (2 if tiny else 10)
    args.teacher_epochs = args.teacher_epochs or (3 if tiny else 15)
    args.seeds = args.seeds or ([0, 1] if tiny else [0, 1, 2])
    args.batch = args.batch or (64 if tiny else 256)
    args.calib_batches = args.calib_batches or (2 if tiny else 16)
    args.rep_ms = args.rep_ms or (20.0 if tiny else 1000.0)
    args.threads = args.threads or default_threads()
    if args.load_students is not None and not args.load_students.is_dir():
        p.error(f"--load-students {args.load_students}: no such folder")
    if args.load_students is not None and args.save_students is not None:
        p.error("--load-students and --save-students are exclusive")
    return p, args


def recipe(args) -> str:
    """How the students (and teacher) are trained: the runs whose seeds a summary may pool share it."""
    return (f"SGD nesterov momentum 0.9 wd 5e-4, warm-up + cosine lr {args.lr}, batch {args.batch}; students "
            f"{args.epochs} epochs (flips), teacher {args.teacher_epochs} epochs (flips, 2-pixel shifts); "
            f"DistillationLoss(T={args.temperature}, alpha={args.alpha})" + ("; --tiny" if args.tiny else ""))


def main(argv=None):
    p, args = parse_args(argv)
    out = output_path(args, STUDY)
    if args.merge and out.exists() and args.load_students is None:  # the summaries pool the file's seeds with these
        others = sorted({r.get("recipe") for r in Results.load(out).runs.values()} - {None, recipe(args)})
        if others:
            p.error(f"--merge {out}: its students were trained another way ({'; '.join(others)}), this run's "
                    f"({recipe(args)}): their seeds would be pooled; write another file")
    device = parse_device(p, args.device, STUDY)
    if args.gpu:  # asked for explicitly
        require_cuda("distill_quantize --gpu")
    gpu_part = args.gpu if args.gpu is not None else device.type == "cuda"
    cpu_part = args.cpu if args.cpu is not None else device.type == "cpu"
    fp8 = False
    if gpu_part and not args.skip_quant:
        hopper = torch.cuda.get_device_capability() >= (8, 9)
        if args.fp8 and not hopper:
            raise SystemExit(f"--fp8 needs a GPU of compute capability >= 8.9 (Hopper or Ada); this one is "
                             f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_capability()})")
        fp8 = hopper if args.fp8 is None else args.fp8
    elif args.fp8:
        require_cuda("distill_quantize --fp8")
        raise SystemExit("--fp8 runs in the GPU part: drop --skip-quant / --no-gpu")
    try:
        data = load_data(args.data, args.tiny, device)
    except datasets.DataNotFound as e:
        p.error(f"--data {args.data or datasets.FASHION_MNIST}: {e}")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    archs = TINY_ARCHS if args.tiny else ARCHS

    results = Results(STUDY, device=device)
    study = Study(results)
    results.annotate(data=data.name if args.data is None else f"{data.name} ({args.data})", train_device=str(device),
                     cudnn_allow_tf32=torch.backends.cudnn.allow_tf32 if device.type == "cuda" else None)
    students: Dict[str, Dict[int, nn.Module]] = {}  # "distilled resnet18" -> {seed: model}
    teacher = None
    t_start = time.perf_counter()

    if args.load_students is not None:
        for meta, model in load_students(args.load_students):
            if meta["arch"]["kind"] in args.students or meta["name"] in args.students:
                if meta.get("data", data.name) != data.name:  # its accuracy when trained: other test images
                    raise SystemExit(f"--load-students {args.load_students}: {meta['provider']} seed {meta['seed']} "
                                     f"was trained and scored on {meta['data']}, this run's data is {data.name}: "
                                     "give the --data / --tiny it was trained with")
                students.setdefault(meta["provider"], {})[meta["seed"]] = model.to(device)
                print(f"loaded {meta['provider']} seed {meta['seed']} (test accuracy {meta['accuracy']:.4f} "
                      f"when trained, {meta['data']})")
        if args.teacher_ckpt is not None:
            found = load_teacher(args.teacher_ckpt, archs["teacher"], args.teacher_epochs, len(data.x))
            teacher = found[0].to(device) if found else None
        results.annotate(students_from=str(args.load_students))
    else:
        teacher = get_teacher(args, archs["teacher"], data, study)
        soft = teacher_logits(teacher, data.x)
        from fuselab.quant import DistillationLoss

        distill = DistillationLoss(args.temperature, args.alpha)
        results.annotate(recipe=recipe(args))
        for name in args.students:
            accs: Dict[str, Dict[int, float]] = {"scratch": {}, "distilled": {}}
            for seed in args.seeds:
                for method in ("scratch", "distilled"):
                    provider = f"{method} {name}"
                    torch.manual_seed(seed)
                    model = archs[name].build().to(device)
                    if device.type == "cuda":
                        model = model.to(memory_format=torch.channels_last)
                    secs = train(model, data, epochs=args.epochs, batch=args.batch, lr=args.lr, seed=seed, shift=0,
                                 desc=f"{provider} seed {seed}",
                                 teacher_logits=soft if method == "distilled" else None,
                                 distill=distill if method == "distilled" else None)
                    acc = accuracy(model, data.xt, data.yt, device)
                    accs[method][seed] = acc
                    study.accuracy(provider, seed, acc)
                    print(f"{provider} seed {seed}: test accuracy {acc:.4f} ({secs:.1f} s)")
                    if method == "distilled":
                        students.setdefault(provider, {})[seed] = model
                    if seed == args.seeds[0]:
                        study.size(provider, model)
                    if method == "distilled" and args.save_students is not None:  # every seed: the CPU stage's
                        meta = {"name": name, "provider": provider, "seed": seed, "arch": asdict(archs[name]),
                                "accuracy": acc, "data": data.name, "epochs": args.epochs}
                        save_student(args.save_students, f"{method}-{name}-seed{seed}", model, meta)
            for method in ("scratch", "distilled"):
                study.accuracy_summary(f"{method} {name}", accs[method])
        print(f"training done in {time.perf_counter() - t_start:.0f} s")

    calib = [normalize(data.x[i * args.batch:(i + 1) * args.batch]) for i in range(args.calib_batches)]
    calib = [c for c in calib if len(c)]
    if gpu_part:
        gpu_stage(args, study, students, teacher, data, calib, fp8)
    if cpu_part:
        cpu_stage(args, study, students, teacher, archs, data, calib)

    results.save(out, merge=args.merge)
    saved = Results.load(out)  # with --merge: the rows of earlier runs too
    if args.merge:
        saved.run_id = results.run_id  # the summaries are this run's computation
        Study(saved).refresh_summaries()
        saved.save(out)
    text = summary(saved)
    if args.tiny:  # a chance-level student here is a smoke run's, not distillation failing
        text = (f"--tiny: a smoke run of the machinery (tiny models, {len(data.x):,} training images, {args.epochs} "
                f"epoch(s)); its accuracies mean nothing.\n\n" + text)
    print("\n" + text)
    if in_results(out):  # its page and plot are docs/results', made by `python -m experiments.report`
        print(f"saved {out} ({time.perf_counter() - t_start:.0f} s)")
        return results
    out.with_suffix(".md").write_text(f"# {STUDY}\n\n{text}\n")
    png = plot(saved, out.with_suffix(".png"))
    print(f"saved {out}, {out.with_suffix('.md')}" + (f", {png}" if png else "")
          + f" ({time.perf_counter() - t_start:.0f} s)")
    return results


def get_teacher(args, arch: Arch, data: Data, study: Study) -> nn.Module:
    device = data.x.device
    found = load_teacher(args.teacher_ckpt, arch, args.teacher_epochs, len(data.x)) if args.teacher_ckpt else None
    if found is not None:
        model = found[0].to(device)
        print(f"teacher from {args.teacher_ckpt} (trained {found[1]['epochs']} epochs)")
        study.res.annotate(teacher_ckpt=str(args.teacher_ckpt))
    else:
        torch.manual_seed(0)
        model = arch.build().to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        secs = train(model, data, epochs=args.teacher_epochs, batch=args.batch, lr=args.lr, seed=0, shift=2,
                     desc="teacher")
        print(f"teacher trained in {secs:.0f} s")
    acc = accuracy(model, data.xt, data.yt, device)
    print(f"teacher: test accuracy {acc:.4f}")
    study.accuracy("teacher", 0, acc)
    study.size("teacher", model)
    if found is None and args.teacher_ckpt is not None:
        save_teacher(args.teacher_ckpt, model, arch, args.teacher_epochs, len(data.x), acc)
    return model


def gpu_stage(args, study: Study, students, teacher, data: Data, calib, fp8: bool,
              dev: torch.device = torch.device("cuda"), modes: Tuple[str, ...] = ("eager", "graph")) -> None:
    """fuselab's INT8 (and FP8) students on the GPU: accuracy per seed, size, latency eager and graph.
    (``dev`` and ``modes`` let a test run the same steps on a CPU.)"""
    timing = dict(rep_ms=min(args.rep_ms, 200.0))
    kinds = [] if args.skip_quant else ["int8 dynamic", "int8 dynamic+conv", "int8 static"] + (["fp8"] if fp8 else [])
    calib = [c.to(dev) for c in calib]
    for provider, by_seed in students.items():
        arch = provider.split()[-1]
        base = {s: m.to(dev).to(memory_format=torch.contiguous_format).eval() for s, m in by_seed.items()}
        variants = [(provider, "fp32", base, provider)]
        for kind in kinds:
            name = f"{provider} {kind} (gpu)"
            quantized = {}
            for seed, model in base.items():
                try:
                    quantized[seed] = fuselab_quantize(model, kind, calib)
                    acc = accuracy(quantized[seed], data.xt, data.yt, dev)
                except Exception as e:
                    print(f"{name} seed {seed}: failed ({type(e).__name__}: {e})")
                    study.res.fail(op="accuracy", provider=name, shape=f"seed {seed}", dtype=kind.split()[0],
                                   mode="eval", error=e)
                    quantized.pop(seed, None)
                    continue
                study.accuracy(name, seed, acc, dtype=kind.split()[0], fp32=provider)
                print(f"{name} seed {seed}: test accuracy {acc:.4f}")
            if quantized:
                study.accuracy_summary(name, {s: study.res.value(op="accuracy", provider=name, shape=f"seed {s}")
                                              for s in quantized}, dtype=kind.split()[0])
                study.size(name, quantized[min(quantized)], dtype=kind.split()[0], fp32=provider)
                variants.append((name, kind.split()[0], quantized, name))
        for name, dtype, models, acc_of in variants:
            model = models[min(models)]
            for b in BATCHES:
                x = normalize(data.xt[:b]).to(dev)
                for mode in modes:
                    with torch.inference_mode():
                        study.latency("gpu", arch, name, lambda: model(x), b, mode, dtype, acc_of, timing)
        study.res.set_baseline(f"gpu latency: {arch}", provider)
    if teacher is not None:
        teacher = teacher.to(dev).to(memory_format=torch.contiguous_format).eval()
        for b in BATCHES:
            x = normalize(data.xt[:b]).to(dev)
            for mode in modes:
                with torch.inference_mode():
                    study.latency("gpu", "teacher", "teacher", lambda: teacher(x), b, mode, "fp32", "teacher",
                                  timing)
        study.res.set_baseline("gpu latency: teacher", "teacher")


def cpu_stage(args, study: Study, students, teacher, archs, data: Data, calib) -> None:
    """INT8 students on the CPU (torchao's pt2e route, else fuselab's quantize_ on the Linear layers):
    accuracy per seed and size; CPU latency of fp32 eager, fp32 torch.compile and INT8."""
    cpu = torch.device("cpu")
    torch.set_num_threads(args.threads)
    study.res.annotate(cpu=cpu_name(), cpu_threads=args.threads)
    timing = dict(rep_ms=args.rep_ms, warmup_iters=2, iters=5 if args.tiny else None)
    calib = [c.to(cpu) for c in calib]
    xt, yt = data.xt.to(cpu), data.yt.to(cpu)
    pt2e = has_torchao()
    path = "pt2e" if pt2e else "fuselab linear int8 dynamic"
    if not args.skip_quant and not pt2e:
        print("torchao is not installed: CPU INT8 is fuselab's quantize_ on the Linear layers (dynamic activations); "
              "convolutions stay fp32")
    compiled_ctx = _inductor_freezing
    for provider, by_seed in students.items():
        arch = provider.split()[-1]
        base = {s: copy.deepcopy(m).to(cpu).to(memory_format=torch.contiguous_format).eval()
                for s, m in by_seed.items()}
        first = min(base)
        name = f"{provider} int8 (cpu, {path})"
        quantized = {}
        if not args.skip_quant:
            for seed, model in base.items():
                try:
                    quantized[seed] = (pt2e_quantize(model, calib) if pt2e
                                       else fuselab_quantize(model, "int8 dynamic", calib))
                    acc = accuracy(quantized[seed], xt, yt, cpu)
                except Exception as e:
                    print(f"{name} seed {seed}: failed ({type(e).__name__}: {e})")
                    study.res.fail(op="accuracy", provider=name, shape=f"seed {seed}", dtype="int8", mode="eval",
                                   error=e)
                    quantized.pop(seed, None)
                    continue
                study.accuracy(name, seed, acc, dtype="int8", fp32=provider)
                print(f"{name} seed {seed}: test accuracy {acc:.4f}")
            if quantized:
                study.accuracy_summary(name, {s: study.res.value(op="accuracy", provider=name, shape=f"seed {s}")
                                              for s in quantized}, dtype="int8")
                study.size(name, quantized[min(quantized)], dtype="int8", fp32=provider)
        study.size(provider, base[first])
        model = base[first]
        with torch.no_grad():
            for b in BATCHES:
                x = normalize(xt[:b])
                study.latency("cpu", arch, provider, lambda: model(x), b, "wall", "fp32", provider, timing)
                if args.compile:
                    with compiled_ctx():
                        fn = torch.compile(model, dynamic=False)
                        study.latency("cpu", arch, f"{provider} (torch.compile)", lambda: fn(x), b, "wall",
                                      "fp32", provider, timing)
                if quantized:
                    q = quantized[min(quantized)]
                    if pt2e:
                        if not args.compile:
                            print(f"  {name}: not timed without --compile (uncompiled, a pt2e graph runs "
                                  "reference quantize/dequantize ops around fp32 kernels)")
                            continue
                        with compiled_ctx():
                            fq = torch.compile(q, dynamic=False)
                            study.latency("cpu", arch, f"{name} (torch.compile)", lambda: fq(x), b, "wall",
                                          "int8", name, timing)
                    else:
                        study.latency("cpu", arch, name, lambda: q(x), b, "wall", "int8", name, timing)
        study.res.set_baseline(f"cpu latency: {arch}", provider)
    if teacher is None:  # latency does not depend on the weights' values: the architecture, untrained
        torch.manual_seed(0)
        teacher, weights = archs["teacher"].build().eval(), "untrained (latency only)"
    else:
        weights = "trained"
    teacher = copy.deepcopy(teacher).to(cpu).to(memory_format=torch.contiguous_format).eval()
    with torch.no_grad():
        for b in BATCHES:
            x = normalize(xt[:b])
            study.latency("cpu", "teacher", "teacher", lambda: teacher(x), b, "wall", "fp32", "teacher", timing,
                          weights=weights)
    study.res.set_baseline("cpu latency: teacher", "teacher")


class _inductor_freezing:
    """Inductor's freezing on (weights folded and prepacked: the CPU deployment setting of the
    pt2e route), for fp32 and INT8 alike."""

    def __enter__(self):
        import torch._inductor.config as cfg

        self._patch = cfg.patch(freezing=True)
        self._patch.__enter__()

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


# ----------------------------------------------------------------------------------------------
# The table and the plot
# ----------------------------------------------------------------------------------------------


def _acc_stats(res: Results, provider: str) -> Optional[Tuple[float, float, float, float, int]]:
    """(mean, std, min, max, n) over the seeds' accuracy rows of ``provider``."""
    vals = list(_seed_accs(res, provider).values())  # a seed measured by two runs (two devices) counts once
    if not vals:
        return None
    return (statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, min(vals), max(vals),
            len(vals))


def _seed_accs(res: Results, provider: str) -> Dict[int, float]:
    return {int(r["shape"].split()[1]): r["p50"] for r in res.select(op="accuracy", provider=provider)
            if r["shape"].startswith("seed ")}


def _latency(res: Results, where: str, provider: str, batch: int, mode: str) -> Optional[float]:
    rows = [r for r in res.select(metric="ms", provider=provider, shape=f"batch {batch}", mode=mode)
            if r["op"].startswith(f"{where} latency")]
    return rows[-1]["p50"] if rows else None


def providers_of(res: Results) -> List[str]:
    names = list(dict.fromkeys(r["provider"] for r in res.rows))
    order = ["teacher"] + [f"{m} {a}" for a in STUDENTS for m in ("scratch", "distilled")]

    def key(n):
        base = next((i for i, o in enumerate(order) if n == o), None)
        if base is not None:
            return (base, 0, n)
        stem = next((i for i, o in enumerate(order) if n.startswith(o + " ")), len(order))
        return (stem, 1, names.index(n))

    return sorted(names, key=key)


def summary(res: Results) -> str:
    """One table (a line per model variant) and the distillation verdicts, from the rows alone."""
    header = ["model", "test accuracy: mean ± std [min, max] (seeds)", "MB", "CPU ms b1", "CPU ms b64",
              "GPU ms b1 eager", "GPU ms b1 graph", "GPU ms b64 eager", "GPU ms b64 graph"]
    lines = []
    for prov in providers_of(res):
        rows = res.select(provider=prov)
        model = rows[0].get("model", prov)
        st = _acc_stats(res, model)
        acc = f"{st[0]:.4f} ± {st[1]:.4f} [{st[2]:.4f}, {st[3]:.4f}] ({st[4]})" if st else ""
        if model != prov and st:
            acc += f" (= {model})"
        size = res.select(op="size", provider=prov)
        lines.append([prov, acc, size[-1]["p50"] if size else None,
                      _latency(res, "cpu", prov, 1, "wall"), _latency(res, "cpu", prov, 64, "wall"),
                      *(_latency(res, "gpu", prov, b, mode) for b in BATCHES for mode in ("eager", "graph"))])
    out = [markdown_table(header, lines), ""]
    for arch in STUDENTS:
        d, s = _seed_accs(res, f"distilled {arch}"), _seed_accs(res, f"scratch {arch}")
        if not d or not s:
            continue
        paired = {k: d[k] - s[k] for k in sorted(d) if k in s}
        gain = statistics.fmean(d.values()) - statistics.fmean(s.values())
        beyond = min(d.values()) > max(s.values())
        worse = max(d.values()) < min(s.values())
        verdict = ("n/a: one seed has no spread" if min(len(d), len(s)) < 2 else
                   "yes: every distilled seed is above every scratch seed" if beyond else
                   "no: the distilled student is below the scratch one on every seed" if worse else
                   "no: the seeds' ranges overlap")
        out.append(f"- {arch}: distilled - scratch = {100 * gain:+.2f} points (mean of {len(d)} vs {len(s)} seeds; "
                   f"per seed, same initial weights and batches: "
                   + ", ".join(f"{100 * v:+.2f}" for v in paired.values())
                   + f"). Beats scratch beyond the seeds' spread: **{verdict}**.")
    for prov in providers_of(res):
        mine = {r["seed"]: r for r in res.select(op="accuracy", provider=prov) if "fp32" in r and "seed" in r}
        if mine:
            base = _seed_accs(res, next(iter(mine.values()))["fp32"])
            diffs = [100 * (r["p50"] - base[s]) for s, r in sorted(mine.items()) if s in base]
            if diffs:
                out.append(f"- {prov}: accuracy - fp32 = {statistics.fmean(diffs):+.2f} points (per seed: "
                           + ", ".join(f"{d:+.2f}" for d in diffs) + ")")
    for prov in providers_of(res):
        for r in res.select(op="size", provider=prov)[-1:]:
            base = res.select(op="size", provider=r.get("fp32"), dtype="fp32") if r.get("fp32") else []
            if base and r["p50"]:
                out.append(f"- {prov}: state_dict {base[-1]['p50'] / r['p50']:.2f}x smaller than fp32 "
                           f"({r['bytes']:,} vs {base[-1]['bytes']:,} bytes)")
    if res.failed:
        out.append("")
        out.append(markdown_table(["op", "provider", "shape", "mode", "error"],
                                  [[f["op"], f["provider"], f["shape"], f["mode"], f["error"]] for f in res.failed]))
    return "\n".join(out).rstrip()


def plot(res: Results, path: Path) -> Optional[Path]:
    """Accuracy against size, CPU latency (batch 64) and GPU latency (batch 64, graph): a point per variant."""
    panels = [("size", lambda p: next((r["p50"] for r in res.select(op="size", provider=p)), None),
               "state_dict MB (log)"),
              ("CPU latency", lambda p: _latency(res, "cpu", p, 64, "wall"), "CPU ms, batch 64 (log)"),
              ("GPU latency", lambda p: _latency(res, "gpu", p, 64, "graph"), "GPU ms, batch 64, graph (log)")]
    points = []
    for title, get, label in panels:
        pts = []
        for prov in providers_of(res):
            rows = res.select(provider=prov)
            st = _acc_stats(res, rows[0].get("model", prov))
            v = get(prov)
            if st and v:
                pts.append((prov, v, st))
        if pts:
            points.append((title, label, pts))
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = providers_of(res)
    fig, axes = plt.subplots(1, len(points), figsize=(6.0 * len(points), 5.6), squeeze=False)
    handles = {}
    for ax, (title, label, pts) in zip(axes[0], points):
        for prov, v, (mean, _, lo, hi, _) in pts:
            marker = "s" if " int8" in prov else "^" if " fp8" in prov else "D" if "compile" in prov else "o"
            h = ax.errorbar([v], [100 * mean], yerr=[[100 * (mean - lo)], [100 * (hi - mean)]], fmt=marker,
                            capsize=3, color=f"C{names.index(prov) % 10}", label=prov)
            handles.setdefault(prov, h)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy, % (mean; bars: min-max over seeds)")
        ax.set_title(f"accuracy vs {title}", fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=7, frameon=False)
    envs = sorted({str(e.get("gpu")) for e in res.runs.values()})
    fig.suptitle(f"Fashion-MNIST distillation and quantization ({'; '.join(envs)})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.025 * math.ceil(len(handles) / 3), 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
