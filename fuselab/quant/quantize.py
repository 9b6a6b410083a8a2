"""``quantize_(model, config)``: swap Linear (and Conv2d) layers for quantized ones in place, and say what was done.

torchao's calling convention: a frozen dataclass config (``config.py``) and a handler registered
per config type (``register_quantize_module_handler``). Exactly ``nn.Linear``, transformers'
``Conv1D`` (GPT-2's projections, a Linear with its weight stored transposed) and their fused
``FusedLinearReLU`` / ``FusedConv1DReLU`` layers are replaced (the fused ones with the ReLU in the
quantized GEMM's epilogue), and ``nn.Conv2d`` layers where the dynamic int8 config says
``conv2d=True``; other Linear subclasses, other convolutions, layers already quantized, and layers
whose swap could change what the model computes (hooks, parametrizations, a parent that reads the
float weight itself, unsupported dtypes or devices), are left alone, with the reason in the report.
Every decision is made before anything changes. ``calibrate`` runs a few batches through the float
model to record each layer's input range (static activation scales) and a sample of its inputs, on
which the report measures each quantized layer's error against its float layer.
"""
import ast
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils import parametrize

from fuselab.kernels._runtime import SUPPORTED_DTYPES
from fuselab.nn.fuse import (
    _single_assignments,
    ancestor_paths,
    attribute_chain,
    class_methods,
    is_conv1d,
    training_mode,
    why_not_swapped,
)
from fuselab.nn.linear_relu import FusedConv1DReLU, FusedLinearReLU
from fuselab.quant.config import (
    SCALE_RANGE,
    Float8RowwiseConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8StaticActivationInt8WeightConfig,
    positive_scale,
)
from fuselab.quant.fp8_gemm import check_fp8_device
from fuselab.quant.int8_gemm import MAX_K as INT8_MAX_K
from fuselab.quant.modules import QUANTIZED_LAYERS, Float8Linear, Int8Conv2d, Int8Linear, why_not_int8_conv2d
from fuselab.quant.norm_quant import MAX_STATIC_READERS, QuantizedLayerNorm, why_not_fused_norm
from fuselab.quant.rowwise import INT8_QMAX

# ----------------------------------------------------------------------------------------------
# Handlers: one per config type
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Handler:
    convert: Callable[[nn.Module, bool, str, Any], nn.Module]  # (layer, relu, name, config) -> quantized layer
    why_not: Callable[[nn.Module, str, Any], Optional[str]]  # (layer, name, config) -> reason to leave it, or None


_HANDLERS: Dict[type, _Handler] = {}


def _no_objection(layer, name, config) -> Optional[str]:
    return None


def register_quantize_module_handler(config_type: type, why_not: Callable = _no_objection):
    """Decorator: ``convert(layer, relu, name, config)`` quantizes Linear (and, where the config asks,
    Conv2d) layers for ``config_type``;
    ``why_not(layer, name, config)`` may refuse a layer with a reason (the report shows it)."""

    def decorate(convert):
        _HANDLERS[config_type] = _Handler(convert, why_not)
        return convert

    return decorate


def _as_linear(layer: nn.Module) -> nn.Module:
    """``layer`` as the nn.Linear it computes: itself, or for a (fused) Conv1D, whose weight is stored
    (in, out), a Linear holding the transposed weight and the same bias (only read: to be quantized)."""
    if isinstance(layer, nn.Linear):
        return layer
    weight = layer.weight.detach()
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
    linear.bias = layer.bias
    return linear


def _int8_k_limit(layer, name, config) -> Optional[str]:
    if isinstance(layer, nn.Conv2d):  # its K is C*kh*kw: why_not_int8_conv2d
        return None
    k = layer.in_features if isinstance(layer, nn.Linear) else layer.weight.shape[0]  # a Conv1D's is (in, out)
    if k > INT8_MAX_K:
        return f"in_features = {k} is above the int8 GEMM's K limit {INT8_MAX_K} (its int32 sums could overflow)"
    return None


@register_quantize_module_handler(Int8DynamicActivationInt8WeightConfig, why_not=_int8_k_limit)
def _int8_dynamic(layer, relu, name, config):
    if isinstance(layer, nn.Conv2d):  # only offered with conv2d=True (_replaced_types)
        return Int8Conv2d.from_float(layer)
    return Int8Linear.from_float(_as_linear(layer), relu=relu)


def _int8_static_why_not(layer, name, config) -> Optional[str]:
    if name not in config.act_scales:
        return ("no calibrated activation scale in the config (not called while calibrating, or it saw only "
                "zeros there?)")
    return _int8_k_limit(layer, name, config)


@register_quantize_module_handler(Int8StaticActivationInt8WeightConfig, why_not=_int8_static_why_not)
def _int8_static(layer, relu, name, config):
    return Int8Linear.from_float(_as_linear(layer), relu=relu, act_scale=config.act_scales[name])


def _no_fp8_hardware(layer, name, config) -> Optional[str]:
    return check_fp8_device(layer.weight.device)


@register_quantize_module_handler(Float8RowwiseConfig, why_not=_no_fp8_hardware)
def _float8_rowwise(layer, relu, name, config):
    return Float8Linear.from_float(_as_linear(layer), relu=relu, fast_accum=config.fast_accum)


# ----------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` saw at each Linear (or Conv1D) layer's input: the largest |value| (``absmax``) and the
    first inputs, as (rows, in_features) (``samples``; a Conv2d's: its first input images, (N, C, H, W)), over
    ``n_batches`` batches."""

    absmax: Mapping[str, float]
    samples: Mapping[str, torch.Tensor]
    n_batches: int

    def act_scales(self, qmax: int = INT8_QMAX) -> Dict[str, float]:
        """Symmetric per-tensor scales, ``absmax / qmax`` (int8: 127), for
        ``Int8StaticActivationInt8WeightConfig``. A layer that only saw zeros (or values so small that the scale
        would fall below SCALE_RANGE) has no range to scale by and is left out (any scale would turn its later
        nonzero inputs into about nothing):
        quantize_ then leaves it alone and says so. ``qmax``: the int8 step the calibrated absmax maps to,
        in (0, 127]; below 127 leaves headroom above the calibrated range (past 127 it would be clipped)."""
        qmax = positive_scale("act_scales(qmax)", qmax)
        if qmax > INT8_QMAX:
            raise ValueError(f"act_scales(qmax={qmax:g}): the static layers' inputs are int8, whose steps end at "
                             f"{INT8_QMAX}; a larger qmax would clip the calibrated range itself")
        return {name: value / qmax for name, value in self.absmax.items() if value / qmax >= SCALE_RANGE[0]}


def _model_input(batch):
    """A loader's batch as the model's arguments: ``(x, y, ...)`` -> x, a mapping (or ``(mapping, labels)``, as
    transformers' collators make) -> keyword arguments."""
    if isinstance(batch, (tuple, list)):
        return ((), dict(batch[0])) if batch and isinstance(batch[0], Mapping) else ((batch[0],), {})
    if isinstance(batch, Mapping):  # a dict, or transformers' BatchEncoding (a UserDict)
        return (), dict(batch)
    return (batch,), {}


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) and device is not None else value


def _progress(iterable: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    """``tqdm(iterable)`` when asked for and installed (an optional dependency), else ``iterable``."""
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc)


def calibration_batches(loader: Iterable, n_batches: int, device, desc: str, progress: bool):
    """``n_batches`` batches of ``loader`` as (args, kwargs) on ``device``, with a progress bar;
    ValueError if the loader runs out first."""
    batches = iter(loader)
    for i in _progress(range(n_batches), n_batches, desc, progress):
        try:
            batch = next(batches)
        except StopIteration:
            raise ValueError(f"the loader ran out after {i} batches; n_batches={n_batches}") from None
        args, kwargs = _model_input(batch)
        yield tuple(_to(a, device) for a in args), {k: _to(v, device) for k, v in kwargs.items()}


def calibrate(model: nn.Module, loader: Iterable, n_batches: int, *, sample_rows: int = 256,
              progress: bool = True) -> Calibration:
    """Run ``n_batches`` batches of ``loader`` through ``model`` (eval mode, no grad; the mode is
    restored) and record, for every ``nn.Linear`` and transformers ``Conv1D`` (by module name), its
    input's absmax and its first ``sample_rows`` input rows, and for every ``nn.Conv2d`` its first input
    images, enough for ``sample_rows`` positions (at least one: ``quantize_``'s error of an Int8Conv2d).
    A batch is a tensor, a ``(x, target, ...)`` tuple or list (x is passed), or a mapping of keyword
    arguments (a dict, transformers' BatchEncoding; also as a tuple's first element); tensors are moved to the
    model's device. A progress bar is shown if tqdm is installed and ``progress``. Raises ValueError if
    ``n_batches < 1``, the loader runs out first, or the model has no such layer (a model quantized already,
    say)."""
    if isinstance(n_batches, bool) or not (isinstance(n_batches, int) and n_batches >= 1):
        raise ValueError(f"n_batches must be a positive int, got {n_batches!r}")
    absmax: Dict[str, float] = {}
    samples: Dict[str, List[torch.Tensor]] = {}

    def record(name):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()), None)  # fc(x) or fc(input=x)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"calibrate: {name!r} was called without a tensor input (a batch is passed to the "
                                 "model as model(x) for a tensor x or a tuple (x, target, ...), as model(**batch) "
                                 "for a mapping or a tuple (mapping, target, ...): a model of several inputs takes "
                                 "them from a mapping)")
            x = x.detach()
            if isinstance(module, nn.Conv2d):  # images for the error of an Int8Conv2d; no scale
                have = sum(s.shape[0] for s in samples.get(name, []))
                want = max(1, math.ceil(sample_rows / max(1, x.shape[-2] * x.shape[-1])))
                if x.dim() == 4 and have < want:
                    samples.setdefault(name, []).append(x[:want - have].clone())
                return
            largest = x.abs().max().item() if x.numel() else 0.0
            if not math.isfinite(largest):  # NaN: max() drops it (the scale would shrink); inf: no scale
                value = "NaN" if largest != largest else largest
                raise ValueError(f"calibrate: the input of {name!r} holds {value} in batch {seen}: "
                                 "its range cannot be measured")
            absmax[name] = max(absmax.get(name, 0.0), largest)
            have = sum(s.shape[0] for s in samples.get(name, []))
            if have < sample_rows:
                samples.setdefault(name, []).append(x.reshape(-1, x.shape[-1])[:sample_rows - have].clone())
        return hook

    device = next((p.device for p in model.parameters()), None)
    layers = [(name, m) for name, m in model.named_modules() if _linear_like(m) or isinstance(m, nn.Conv2d)]
    if not layers:
        quantized = sum(isinstance(m, QUANTIZED_LAYERS) for m in model.modules())
        raise ValueError("calibrate: the model has no nn.Linear, Conv1D or nn.Conv2d layer to observe"
                         + (f"; its {quantized} quantized layer(s) say it was quantized already: calibrate the "
                            "float model" if quantized else ""))
    handles = [m.register_forward_pre_hook(record(name), with_kwargs=True) for name, m in layers]
    seen = 0
    try:
        with training_mode(model, False), torch.no_grad():
            for seen, (args, kwargs) in enumerate(calibration_batches(loader, n_batches, device, "calibrating",
                                                                      progress)):
                model(*args, **kwargs)
        seen += 1
    finally:
        for handle in handles:
            handle.remove()
    return Calibration(absmax=absmax, samples={n: torch.cat(s) for n, s in samples.items()}, n_batches=seen)


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


@dataclass
class QuantizationReport:
    """What ``quantize_`` did: layers ``replaced`` (name -> what it became), layers ``skipped`` (name
    -> why it was left alone) and, with calibration data, each replaced layer's relative error
    against its float layer on that data, ``||y_q - y|| / ||y||`` over the sample (``errors``; calibration
    samples lie inside the calibrated range: a static scale's clipping of larger inputs does not show there).
    With ``fuse_norms``: the norms fused (``norms``) and left (``norms_skipped``), by name; with ``fuse_outputs``: the
    layers whose outputs leave quantized (``outputs``) and those left (``outputs_skipped``)."""

    config: Any
    replaced: Dict[str, str] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    errors: Dict[str, float] = field(default_factory=dict)
    unused_scales: List[str] = field(default_factory=list)  # a static config's scales named after no layer here
    norms: Dict[str, str] = field(default_factory=dict)
    norms_skipped: Dict[str, str] = field(default_factory=dict)
    outputs: Dict[str, str] = field(default_factory=dict)
    outputs_skipped: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"quantized {len(self.replaced)} layer(s) with {type(self.config).__name__}; "
                 f"left {len(self.skipped)} alone"
                 + (f"; fused {len(self.norms)} norm(s), left {len(self.norms_skipped)}"
                    if self.norms or self.norms_skipped else "")
                 + (f"; {len(self.outputs)} output(s) quantized in the epilogue, left {len(self.outputs_skipped)}"
                    if self.outputs or self.outputs_skipped else "")]
        for name, what in self.replaced.items():
            error = f"  relative error {self.errors[name]:.2e}" if name in self.errors else ""
            lines.append(f"  replaced {name!r}: {what}{error}")  # quoted, as FusionReport's names
        lines += [f"  skipped  {name!r}: {why}" for name, why in self.skipped.items()]
        lines += [f"  fused norm {name!r}: {what}" for name, what in self.norms.items()]
        lines += [f"  norm left  {name!r}: {why}" for name, why in self.norms_skipped.items()]
        lines += [f"  output quantized {name!r}: {what}" for name, what in self.outputs.items()]
        lines += [f"  output left {name!r}: {why}" for name, why in self.outputs_skipped.items()]
        if self.unused_scales:
            lines.append(f"  unused act_scales (no layer of these names): {self.unused_scales}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def relative_error(float_layer: nn.Module, quantized_layer: nn.Module, x: torch.Tensor) -> float:
    """``||q(x) - f(x)|| / ||f(x)||`` (Frobenius norms, in float64) of two layers on the inputs ``x``."""
    with torch.no_grad():
        ref = float_layer(x).to(torch.float64)
        out = quantized_layer(x).to(torch.float64)
    norm = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


# ----------------------------------------------------------------------------------------------
# quantize_
# ----------------------------------------------------------------------------------------------

FAR_ERROR = 0.5  # a replaced layer's relative error on calibration data past which quantize_ warns
_REPLACED = (nn.Linear, FusedLinearReLU)  # exactly these types: a subclass's forward may compute something else
_RELU_FUSED = (FusedLinearReLU, FusedConv1DReLU)


def _linear_like(module: nn.Module) -> bool:
    """A layer that computes ``x @ W^T + b`` (then a ReLU, fused) that quantize_ accounts for: any
    nn.Linear (subclasses too, to say why they are left), transformers' Conv1D, FusedConv1DReLU."""
    return isinstance(module, (nn.Linear, FusedConv1DReLU)) or is_conv1d(module)


def _replaced_types(config: Any) -> Tuple[type, ...]:
    """The layer types ``config`` replaces (besides transformers' Conv1D): Linear (and FusedLinearReLU,
    FusedConv1DReLU), and Conv2d where it asks for them."""
    convs = isinstance(config, Int8DynamicActivationInt8WeightConfig) and config.conv2d
    return _REPLACED + (FusedConv1DReLU,) + ((nn.Conv2d,) if convs else ())


@functools.lru_cache(maxsize=None)
def _weight_reads(cls: type) -> Dict[Tuple[str, ...], str]:
    """The paths below ``self`` whose float weight or bias a method of ``cls`` (torch.nn.Module's aside) reads
    itself, not through the layer's forward (``self.key.weight.dtype``, a fast path passing ``self.block.out.weight``
    to a kernel, ``self.layers[0].fc.weight``, ``block = self.block; block.out.weight``): path -> why (a quantized
    layer there holds int8/fp8 buffers)."""
    reads: Dict[Tuple[str, ...], str] = {}
    for name, method in class_methods(cls, skip_modules=("torch.nn.modules.module",)):
        me = method.args.args[0].arg if method is not None and method.args.args else None
        if me is None:
            continue
        bases = {me: ()}  # names for self and for modules below it (local aliases assigned once), by their path
        aliases = _single_assignments(method)
        for node in ast.walk(method):
            if isinstance(node, ast.Assign) and id(node) in aliases and node.targets[0].id != me:
                base, path = attribute_chain(node.value)
                if base == me and path:
                    bases[node.targets[0].id] = path
        for node in ast.walk(method):
            base, path = attribute_chain(node)
            if base in bases and path and path[-1] in ("weight", "bias") and bases[base] + path[:-1]:
                full = bases[base] + path[:-1]
                reads.setdefault(full, f"{cls.__name__}.{name} reads {me}.{'.'.join(full)}.{path[-1]} itself (a "
                                 "quantized layer's weight is an int8/fp8 buffer: what it does with it would change)")
    return reads


def _why_not_quantized(layer: nn.Module, replaced: Tuple[type, ...] = _REPLACED,
                       ancestors: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...] = ()) -> Optional[str]:
    """Why a swap of ``layer`` (reached from each of ``ancestors`` by its attribute path) would not compute what
    the config specifies (None: it would)."""
    if isinstance(layer, QUANTIZED_LAYERS):
        return f"already quantized ({type(layer).__name__})"
    if parametrize.is_parametrized(layer):  # before the type test: a parametrized layer's type is made for it
        return why_not_swapped(layer)
    if isinstance(layer, _ConvNd) and type(layer) not in replaced:
        if type(layer) is nn.Conv2d:
            return "an nn.Conv2d: replaced with Int8DynamicActivationInt8WeightConfig(conv2d=True) only"
        return (f"a {type(layer).__name__}: of convolutions quantize_ replaces exactly nn.Conv2d, with "
                "Int8DynamicActivationInt8WeightConfig(conv2d=True)")
    if type(layer) not in replaced and not is_conv1d(layer):
        cls = type(layer)
        names = " or ".join(("nn." if t.__module__.startswith("torch.nn") else "") + t.__name__ for t in replaced)
        return f"a {cls.__module__}.{cls.__qualname__}, not exactly {names} (its forward may differ)"
    for ancestor, path in ancestors:
        why = _weight_reads(type(ancestor)).get(path)
        if why is not None:
            return why
    why = why_not_swapped(layer)
    if why is not None:
        return why
    weight = layer.weight
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"{weight.dtype}: the quantized layers take float32, float16 and bfloat16 models"
    if weight.device.type not in ("cpu", "cuda"):
        return f"on the {weight.device.type} device: the quantized GEMMs run on cpu and cuda"
    if isinstance(layer, nn.Conv2d):
        return why_not_int8_conv2d(layer)
    if weight.numel() == 0:
        return "has no input or no output features"
    return None


_Site = Tuple[str, nn.Module, List[Tuple[nn.Module, str]], List[Tuple[nn.Module, Tuple[str, ...]]]]


def _layer_sites(model: nn.Module, accounted: Callable[[nn.Module], bool]) -> Dict[int, _Site]:
    """Every module under ``model`` (not ``model`` itself) that ``accounted(module)`` holds for:
    id -> (name, layer, [(parent, key)], [(ancestor, path)]), named as ``model.named_modules()`` first names it
    (as ``calibrate`` names the layers it observes: a layer held under two names is one layer, under one name);
    the ancestors are every module above it by every name, each with its attribute path down to it."""
    names = {id(m): name for name, m in model.named_modules()}
    sites = {}
    for parent in model.modules():  # each parent once: its (parent, key) pairs once
        for key, child in parent._modules.items():
            if child is not None and child is not model and accounted(child):
                sites.setdefault(id(child), (names[id(child)], child, [], []))[2].append((parent, key))
    every_name = dict(model.named_modules(remove_duplicate=False))
    for name, module in every_name.items():
        if id(module) in sites:
            sites[id(module)][3].extend(ancestor_paths(every_name, name))
    return sites


def _accounted(module: nn.Module) -> bool:
    """What the report accounts for: every Linear-like layer, every convolution, every quantized layer."""
    return _linear_like(module) or isinstance(module, (_ConvNd, *QUANTIZED_LAYERS))


def quantize_(model: nn.Module, config: Any, *, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
              calibration: Optional[Calibration] = None) -> QuantizationReport:
    """Replace ``model``'s ``nn.Linear``, transformers ``Conv1D``, ``FusedLinearReLU`` and ``FusedConv1DReLU``
    layers (and ``nn.Conv2d`` where the config says ``conv2d=True``) with quantized ones, in place.

    ``config``: an ``Int8DynamicActivationInt8WeightConfig``, ``Int8StaticActivationInt8WeightConfig``
    or ``Float8RowwiseConfig`` (or a type registered with ``register_quantize_module_handler``).
    ``filter_fn(layer, name) -> bool`` may veto a layer (torchao's order: the module, then its fully
    qualified name; ``fuse_linear_relu``'s is the other). With ``calibration`` (from ``calibrate`` on the
    float model) the report holds each replaced layer's relative error on its sampled inputs.
    A Linear followed by a separate ReLU keeps the ReLU outside the GEMM: ``fuse_linear_relu`` first
    makes such pairs FusedLinearReLU, which this fuses into the epilogue. A config's ``fuse_norms=True``
    also makes the norms of known decoder layers whose readers are all quantized ``QuantizedLayerNorm``
    (``_plan_norms``; ``filter_fn`` sees those norms too, and may veto them); the static config's
    ``fuse_outputs=True`` has a known decoder layer's fc1 quantize its output for fc2 (``_plan_outputs``).
    A layer shared by several parents is replaced everywhere by one quantized layer. Returns the report (layers already
    quantized are listed as left alone); raises TypeError for an unknown config type, a config class
    passed for an instance and a ``calibration`` that is not a Calibration, ValueError for a calibration
    sample that the layer of its name cannot take and for static scales none of which names a layer here
    (calibrated on another model); then, or if ``filter_fn``
    or a conversion raises, nothing is changed. A replaced layer whose weight another module shares gets
    its own copy (the report says so). Quantized layers are for inference: a backward through one raises.
    """
    if isinstance(config, type) and config in _HANDLERS:
        raise TypeError(f"quantize_ takes a config instance, e.g. {config.__name__}(), not the class")
    handler = _HANDLERS.get(type(config))
    if handler is None:
        known = ", ".join(sorted(t.__name__ for t in _HANDLERS))
        raise TypeError(f"no quantize_ handler for {type(config).__name__}; known configs: {known}")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be what calibrate() returns (a Calibration), got "
                        f"{type(calibration).__name__}")
    report = QuantizationReport(config=config)
    planned = []
    replaced = _replaced_types(config)
    sites = _layer_sites(model, _accounted).values()
    if isinstance(config, Int8StaticActivationInt8WeightConfig) and not config.act_scales:
        raise ValueError("quantize_: the Int8StaticActivationInt8WeightConfig has no act_scales, so every layer would "
                         "stay float: pass calibrate(model, loader, n_batches).act_scales() (empty where calibration "
                         "saw only empty or all-zero inputs); nothing was changed")
    if isinstance(config, Int8StaticActivationInt8WeightConfig):
        names = {name for name, _, _, _ in sites}
        if not names & set(config.act_scales):  # calibrated on another model, or on a parent of this one
            raise ValueError(f"quantize_: none of the config's {len(config.act_scales)} act_scales names a layer of "
                             f"this model (it has e.g. {next(iter(config.act_scales))!r}; this model's layers: "
                             f"{sorted(names)[:5]}): calibrate the model you quantize; nothing was changed")
        report.unused_scales = sorted(set(config.act_scales) - names)
    for name, layer, parents, ancestors in sites:
        why = (_why_not_quantized(layer, replaced, tuple(ancestors))
               or handler.why_not(layer, name, config))
        if why is None and filter_fn is not None and not filter_fn(layer, name):
            why = "vetoed by filter_fn"
        if why is not None:
            report.skipped[name] = why
        else:
            planned.append((name, layer, parents))
    vetoed = sum(why == "vetoed by filter_fn" for why in report.skipped.values())
    if vetoed and not planned:  # a filter written in fuse_linear_relu's order, (name, layer), vetoes this way
        warnings.warn(f"quantize_: filter_fn vetoed all {vetoed} layers it was asked about; it is called as "
                      "filter_fn(module, fqn), torchao's order", UserWarning, stacklevel=2)
    if _accounted(model):
        report.skipped[""] = "the model itself: quantize_ replaces submodules in place"
    # Every decision is made: conversions (and the errors on calibration data) next, all before any
    # assignment, so that a conversion or a calibration sample that fails leaves the model as it was.
    holders = _holders(model)
    converted = []
    for name, layer, parents in planned:
        relu = type(layer) in _RELU_FUSED
        quantized = handler.convert(layer, relu, name, config)
        what = f"{type(quantized).__name__}" + (" (ReLU fused into the epilogue)" if relu else "")
        others = sorted(n for m, n in holders.get(id(layer.weight), {}).items() if m != id(layer))
        if others:
            what += f"; its weight was shared with {', '.join(others)}: the quantized layer holds its own copy"
        sample = calibration.samples.get(name) if calibration is not None else None
        error = None if sample is None else _calibration_error(name, layer, quantized, sample)
        converted.append((name, parents, quantized, what, error))
    norms, outputs = [], []
    becomes = {id(layer): quantized for (_, layer, _), (_, _, quantized, _, _) in zip(planned, converted)}
    if getattr(config, "fuse_norms", False):  # planned too before anything changes: filter_fn may raise there
        norms = _plan_norms(model, config, becomes, filter_fn, report)
    if getattr(config, "fuse_outputs", False):
        outputs = _plan_outputs(model, becomes, report)
    for name, parents, quantized, what, error in converted:
        for parent, key in parents:
            setattr(parent, key, quantized)
        report.replaced[name] = what
        if error is not None:
            report.errors[name] = error
    for layer, key, name, fused, paths in norms:
        setattr(layer, key, fused)
        static = " with their static scale" if fused._static_readers else ""
        report.norms[name] = (f"QuantizedLayerNorm (its rows quantized to {'fp8' if fused.fp8 else 'int8'} once"
                              f"{static}, for {', '.join(paths)})")
    for quantized, name, reader_name, reader in outputs:
        quantized.quantize_output(reader)
        report.outputs[name] = f"int8 in the GEMM's epilogue, with the act_scale of {reader_name}, which reads it"
    far = {name: error for name, error in report.errors.items() if error > FAR_ERROR}
    if far:  # scales of another model or metric (absmax for act_scales()), a layer int8 cannot hold
        worst = ", ".join(f"{name} {error:.2f}" for name, error in sorted(far.items(), key=lambda kv: -kv[1])[:5])
        warnings.warn(f"quantize_: {len(far)} quantized layer(s) miss their float layer's outputs on the calibration "
                      f"data by more than {FAR_ERROR:.0%} (relative error: {worst}): check the static scales (from "
                      "calibrate(...).act_scales() of this model) or leave those layers float (filter_fn)",
                      UserWarning, stacklevel=2)
    return report


# Decoder layers (transformers' classes, by name) whose norms' outputs only the listed linears read, and when: OPT
# also adds its norms' outputs to the residual where the norm comes after the attention (OPT-350m).
_NORM_READERS: Dict[str, Tuple[Callable[[nn.Module], bool], Dict[str, Tuple[str, ...]]]] = {
    "OPTDecoderLayer": (lambda layer: layer.do_layer_norm_before,
                        {"self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                         "final_layer_norm": ("fc1",)}),
    "GPT2Block": (lambda block: True, {"ln_1": ("attn.c_attn",), "ln_2": ("mlp.c_fc",)}),
}


def _known_layers(model: nn.Module, table: Dict[str, Any]) -> List[Tuple[str, nn.Module, Any]]:
    """(name, layer, entry) of each transformers layer of ``model`` whose class name ``table`` knows."""
    return [(name, layer, table[type(layer).__name__]) for name, layer in model.named_modules()
            if type(layer).__name__ in table and type(layer).__module__.startswith("transformers.")]


def _paths_to(model: nn.Module) -> Dict[int, int]:
    """id(module) -> by how many paths ``model`` reaches it."""
    paths_to: Dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        paths_to[id(m)] = paths_to.get(id(m), 0) + 1
    return paths_to


def _plan_norms(model: nn.Module, config: Any, becomes: Dict[int, nn.Module], filter_fn,
                report: QuantizationReport) -> list:
    """``fuse_norms``: the (layer, key, name, QuantizedLayerNorm, reader paths) of each known decoder layer's norm
    whose readers will all be quantized linears of this config that read its rows (``becomes``: id of a layer ->
    what this call replaces it with): dynamic ones, or up to MAX_STATIC_READERS static ones, for each of which the
    norm writes a copy quantized with its act_scale; the report's ``norms_skipped`` says why any other is left."""
    fp8 = isinstance(config, Float8RowwiseConfig)
    static = isinstance(config, Int8StaticActivationInt8WeightConfig)
    reader_type = Float8Linear if fp8 else Int8Linear
    kind = "static" if static else "dynamic"
    paths_to = _paths_to(model)
    planned = []
    known = _known_layers(model, _NORM_READERS)
    for layer_name, layer, (applies, norms) in known:
        for key, paths in norms.items():
            name = f"{layer_name}.{key}" if layer_name else key
            norm = getattr(layer, key, None)
            if isinstance(norm, QuantizedLayerNorm):
                why = "already a QuantizedLayerNorm"
            elif not applies(layer):
                why = f"{type(layer).__name__} adds this norm's output to the residual too (the norm comes after)"
            else:
                why = why_not_fused_norm(norm) or why_not_swapped(norm)
            if why is None and paths_to.get(id(norm), 0) > 1:
                why = "reached by several paths in the model (a shared norm, or a shared layer holding it)"
            after = [becomes.get(id(m), m) for m in (_submodule(layer, p) for p in paths)]
            if why is None:
                others = [p for p, m in zip(paths, after)
                          if not (type(m) is reader_type and (getattr(m, "act_scale", None) is not None) == static)]
                if others:
                    why = (f"{', '.join(others)} not a {kind} {reader_type.__name__} (left float, or quantized "
                           "otherwise): only those read these quantized rows")
            if why is None:
                why = _hooked_on_the_way(layer, paths)
            if why is None and static and len(paths) > MAX_STATIC_READERS:
                why = f"{len(paths)} static readers: one pass quantizes for at most {MAX_STATIC_READERS}"
            if why is None and filter_fn is not None and not filter_fn(norm, name):
                why = "vetoed by filter_fn"
            if why is not None:
                report.norms_skipped[name] = why
            else:
                planned.append((layer, key, name, QuantizedLayerNorm(norm, fp8, readers=tuple(after) if static else ()),
                                paths))
    if not known:
        report.notes.append("fuse_norms: no decoder layer it knows (it fuses the norms of transformers' "
                            f"{' and '.join(_NORM_READERS)}; OPT's where the norm comes first)")
    return planned


# Decoder layers (transformers' classes, by name) whose first linear's output reaches only the second, through an
# activation that fuse_linear_relu fused into the first (an nn.Identity left in its place).
_OUTPUT_READERS: Dict[str, Tuple[str, str, str]] = {"OPTDecoderLayer": ("fc1", "activation_fn", "fc2")}


def _hooked_on_the_way(layer: nn.Module, paths: Iterable[str]) -> Optional[str]:
    """Why a module between ``layer`` and the readers at ``paths`` (``self_attn`` for ``self_attn.q_proj``) would
    see quantized rows: its forward hooks, which read what it is called with."""
    for path in paths:
        parts = path.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            module = _submodule(layer, ".".join(parts[:depth]))
            if module is not None and _forward_hooked(module):
                return f"{'.'.join(parts[:depth])} has forward hooks, which would see quantized rows"
    return None


def _forward_hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def _plan_outputs(model: nn.Module, becomes: Dict[int, nn.Module], report: QuantizationReport) -> list:
    """``fuse_outputs``: the (quantized layer, name, reader name, reader) of each known decoder layer's first linear,
    quantized by this call, whose output only a static Int8Linear reads (``becomes`` as in ``_plan_norms``); the
    report's ``outputs_skipped`` says why any other is left."""
    paths_to = _paths_to(model)
    planned = []
    known = _known_layers(model, _OUTPUT_READERS)
    for layer_name, layer, chain in known:
        first, act, second = chain
        name, reader = (f"{layer_name}.{key}" if layer_name else key for key in (first, second))
        producer, activation, consumer = (getattr(layer, key, None) for key in chain)
        after, read_by = becomes.get(id(producer)), becomes.get(id(consumer), consumer)
        if type(after) is not Int8Linear:
            why = "not quantized to an Int8Linear by this call"
        elif type(activation) is not nn.Identity:
            fix = ("run fuse_linear_relu before quantize_" if isinstance(activation, nn.ReLU)
                   else "only a ReLU, fused into it, leaves nothing between the two")
            why = f"{act} is a {type(activation).__name__}, not the nn.Identity fuse_linear_relu leaves: {fix}"
        elif _forward_hooked(activation):
            why = f"{act} has forward hooks, which would see quantized rows"
        elif type(read_by) is not Int8Linear or read_by.act_scale is None:
            why = f"its reader {reader} is not a static Int8Linear"
        elif any(paths_to.get(id(m), 0) > 1 for m in (producer, activation, consumer)):
            why = "reached by several paths in the model (a shared layer)"
        else:
            planned.append((after, name, reader, read_by))
            continue
        report.outputs_skipped[name] = why
    if not known:
        report.notes.append("fuse_outputs: no decoder layer it knows (it fuses the outputs of transformers' "
                            f"{' and '.join(_OUTPUT_READERS)})")
    return planned


def _submodule(module: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _holders(model: nn.Module) -> Dict[int, Dict[int, str]]:
    """id(parameter) -> {id(module): its first name ("the model" for the root)} of the modules holding it."""
    holders: Dict[int, Dict[int, str]] = {}
    for module_name, module in model.named_modules():  # each module once, under its first name
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), {})[id(module)] = module_name or "the model"
    return holders


def _calibration_error(name: str, layer: nn.Module, quantized: nn.Module, sample: torch.Tensor) -> float:
    """``relative_error`` on a calibration sample moved to the layer's device and dtype (a model calibrated
    in fp32 and cast to bf16 after), or a ValueError if the sample is not an input this layer takes."""
    x = sample.to(device=layer.weight.device, dtype=layer.weight.dtype)
    try:
        return relative_error(layer, quantized, x)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise ValueError(f"quantize_: the calibration sample of {name!r} (shape {tuple(sample.shape)}) is not an "
                         f"input {type(layer).__name__} {name!r} takes (was it calibrated on another model?): {e}; "
                         "nothing was changed") from e
