"""Patch existing models: every Linear followed by ReLU becomes one fused op.

Three mechanisms, tried in this order, each recorded in the returned report:
1. Hugging Face feed-forward blocks, through small per-architecture adapters (no source edits);
2. ``nn.Sequential`` pairs (torchvision classifier heads, plain MLPs);
3. a ``torch.fx`` rewrite of models that ``symbolic_trace`` can trace.
``fuse_relu_matmul`` is the graph rewrite behind (3) and behind ``fused_backend``, which does the
same for any model ``torch.compile`` captures.
"""
import ast
import functools
import inspect
import operator
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch import nn

from fuselab.kernels import linear_relu, matmul_relu
from fuselab.nn.linear_relu import FusedConv1DReLU, FusedLinearReLU

# class name -> (Linear attribute, activation attribute): the block computes act(linear(x)) and uses
# linear's output nowhere else. Names of several transformers versions; a block is patched only if
# its forward's source still has that shape (``_adapter_matches``).
HF_ADAPTERS: Dict[str, Tuple[str, str]] = {
    "OPTDecoderLayer": ("fc1", "activation_fn"),
    **{f"{arch}{side}Layer": ("fc1", "activation_fn")
       for arch in ("Bart", "MBart", "Marian", "Pegasus", "Whisper") for side in ("Encoder", "Decoder")},
    **{f"{arch}DenseActDense": ("wi", "act") for arch in ("T5", "MT5", "UMT5")},
    **{f"{arch}DenseGatedActDense": ("wi_0", "act") for arch in ("T5", "MT5", "UMT5")},  # act(wi_0 x) * wi_1 x
    **{f"{arch}MLP": ("gate_proj", "act_fn") for arch in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma")},
    "GPTNeoXMLP": ("dense_h_to_4h", "act"),
    "GPT2MLP": ("c_fc", "act"),  # a transformers Conv1D: x @ weight + bias
    "BertIntermediate": ("dense", "intermediate_act_fn"),
    "RobertaIntermediate": ("dense", "intermediate_act_fn"),
    "ViTIntermediate": ("dense", "intermediate_act_fn"),
    "ViTMLP": ("fc1", "activation_fn"),
}


@functools.lru_cache(maxsize=None)
def _adapter_matches(cls: type, lin: str, act: str) -> bool:
    """Whether ``cls.forward`` calls ``self.<lin>`` and ``self.<act>`` once each, as ``act(lin(x))``
    or as ``h = self.<lin>(...)`` directly followed by ``h = self.<act>(h)``: a transformers
    release that reshapes the block is then left alone instead of being patched wrongly."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False

    def call_of(node, attr):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")

    calls = [n for n in ast.walk(tree) if call_of(n, lin) or call_of(n, act)]
    if sorted(n.func.attr for n in calls) != sorted([lin, act]):
        return False
    act_call = next(n for n in calls if n.func.attr == act)
    if len(act_call.args) == 1 and call_of(act_call.args[0], lin):
        return True
    for body in (n.body for n in ast.walk(tree) if isinstance(getattr(n, "body", None), list)):
        for first, second in zip(body, body[1:]):
            if (isinstance(first, ast.Assign) and isinstance(second, ast.Assign) and call_of(first.value, lin)
                    and second.value is act_call and len(first.targets) == len(second.targets) == 1
                    and isinstance(first.targets[0], ast.Name) and act_call.args
                    and isinstance(act_call.args[0], ast.Name)
                    and first.targets[0].id == second.targets[0].id == act_call.args[0].id):
                return True
    return False


@dataclass
class FusionReport:
    fused: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)  # Linear name -> why it was left alone
    method: str = "none"

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} Linear+ReLU ({self.method}); left {len(self.skipped)} Linear alone"]
        lines += [f"  fused    {name}" for name in self.fused]
        lines += [f"  skipped  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _fused_layer(layer):
    """The converter to a fused layer for ``layer`` (an exact nn.Linear or transformers' Conv1D), else None."""
    if type(layer) is nn.Linear:
        return FusedLinearReLU.from_linear
    if type(layer).__name__ == "Conv1D" and type(layer).__module__ == "transformers.pytorch_utils":
        return FusedConv1DReLU.from_conv1d
    return None


def _fuse_hf_blocks(model, filter_fn, report) -> None:
    for name, module in model.named_modules():
        adapter = HF_ADAPTERS.get(type(module).__name__)
        if adapter is None:
            continue
        lin_attr, act_attr = adapter
        lin, act = getattr(module, lin_attr), getattr(module, act_attr)
        full = f"{name}.{lin_attr}" if name else lin_attr
        convert = _fused_layer(lin)
        if type(act) is not nn.ReLU:
            report.skipped[full] = f"activation is {type(act).__name__}, not ReLU"
        elif not _adapter_matches(type(module), lin_attr, act_attr):
            report.skipped[full] = (f"{type(module).__name__}.forward no longer computes "
                                    f"{act_attr}({lin_attr}(x)) alone (another transformers version?)")
        elif convert is not None and filter_fn(full, lin):
            setattr(module, lin_attr, convert(lin))
            setattr(module, act_attr, nn.Identity())
            report.fused.append(full)


def _fuse_sequentials(model, filter_fn, report) -> None:
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        for i, mod in enumerate(seq):
            if type(mod) is not nn.Linear:
                continue
            full = f"{name}.{i}" if name else str(i)
            nxt = seq[i + 1] if i + 1 < len(seq) else None
            if type(nxt) is nn.ReLU and filter_fn(full, mod):
                seq[i], seq[i + 1] = FusedLinearReLU.from_linear(mod), nn.Identity()
                report.fused.append(full)
            elif full not in report.skipped:
                report.skipped[full] = f"followed by {type(nxt).__name__ if nxt is not None else 'nothing'}, not ReLU"


def fuse_linear_relu(model: nn.Module, filter_fn: Optional[Callable[[str, nn.Linear], bool]] = None
                     ) -> Tuple[nn.Module, FusionReport]:
    """Replace every Linear followed by ReLU with the fused op; returns ``(model, report)``.

    Modules are patched in place (HF blocks, Sequential pairs); other models are traced with
    torch.fx and a rewritten GraphModule is returned. ``filter_fn(name, layer) -> bool`` can
    veto a layer (an nn.Linear, or GPT-2's Conv1D). A Linear whose output is also used elsewhere,
    or with anything (Dropout, say) between it and the ReLU, is left alone; a model with nothing to
    fuse is returned unchanged.
    """
    filter_fn = filter_fn or (lambda name, linear: True)
    report = FusionReport()
    _fuse_hf_blocks(model, filter_fn, report)
    _fuse_sequentials(model, filter_fn, report)
    remaining = [n for n, m in model.named_modules() if type(m) is nn.Linear and n not in report.skipped
                 and n not in report.fused]
    result, reason = model, "not followed by ReLU in a known block or Sequential"
    if report.fused:
        report.method = "module patching"
    elif remaining and not type(model).__module__.startswith("transformers."):  # HF models: adapters only
        try:
            gm = torch.fx.symbolic_trace(model)
        except Exception as e:  # noqa: BLE001  dynamic control flow etc.: say so, change nothing
            reason = f"model not traceable by torch.fx ({type(e).__name__})"
        else:
            report.fused = fuse_relu_matmul(gm, filter_fn)
            reason = "not followed by ReLU, or its output is used elsewhere (fx graph)"
            if report.fused:
                result, report.method = gm, "torch.fx rewrite"
    for name in remaining:
        if name not in report.fused:
            report.skipped[name] = reason
    return result, report


# ----------------------------------------------------------------------------------------------
# The graph rewrite, shared by the fx path and the torch.compile backend
# ----------------------------------------------------------------------------------------------

_RELU_FUNCTIONS = {torch.relu, torch.nn.functional.relu, torch.relu_, torch.ops.aten.relu.default}
_LINEAR_FUNCTIONS = {torch.nn.functional.linear, torch._C._nn.linear}
_MATMUL_FUNCTIONS = {torch.matmul, torch.mm, operator.matmul}


def _is_relu(gm, node) -> bool:
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    if node.op == "call_method":
        return node.target in ("relu", "relu_")
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)) is nn.ReLU
    return False


def _is_matrix(node) -> bool:
    """Whether the graph recorded ``node`` as a 2-D tensor (matmul_relu's ``b`` must be)."""
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2


def fuse_relu_matmul(gm: torch.fx.GraphModule, filter_fn=None) -> List[str]:
    """Rewrite ``relu(linear(x))``, ``relu(a @ b)`` and ``relu(addmm(bias, a, b))`` into fuselab ops,
    in place, where the product has no other user. Returns the names of what was fused."""
    filter_fn = filter_fn or (lambda name, linear: True)
    graph, fused = gm.graph, []
    for relu in list(graph.nodes):
        if not _is_relu(gm, relu) or not relu.args or not isinstance(relu.args[0], torch.fx.Node):
            continue
        prod = relu.args[0]
        if len(prod.users) != 1:
            continue
        args = None
        if prod.op == "call_module" and type(gm.get_submodule(prod.target)) is nn.Linear:
            linear = gm.get_submodule(prod.target)
            if not filter_fn(prod.target, linear):
                continue
            with graph.inserting_before(relu):
                w = graph.get_attr(f"{prod.target}.weight")
                b = graph.get_attr(f"{prod.target}.bias") if linear.bias is not None else None
            fn, args, name = linear_relu, (prod.args[0], w, b), prod.target
        elif prod.op == "call_function" and prod.target in _LINEAR_FUNCTIONS:
            x, w, *rest = list(prod.args) + [prod.kwargs.get("bias")]
            fn, args, name = linear_relu, (x, w, rest[0] if rest else None), prod.name
        elif prod.op == "call_function" and prod.target in _MATMUL_FUNCTIONS and _is_matrix(prod.args[1]):
            fn, args, name = matmul_relu, (prod.args[0], prod.args[1], None), prod.name
        elif prod.op == "call_function" and prod.target is torch.addmm and not prod.kwargs and _is_matrix(prod.args[2]):
            fn, args, name = matmul_relu, (prod.args[1], prod.args[2], prod.args[0]), prod.name
        if args is None:
            continue
        with graph.inserting_before(relu):
            new = graph.call_function(fn, args)
        relu.replace_all_uses_with(new)
        graph.erase_node(relu)
        graph.erase_node(prod)
        fused.append(name)
    if fused:
        graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return fused


def fused_backend(inner: str = "inductor"):
    """A ``torch.compile`` backend: ``fuse_relu_matmul`` on the captured graph, then ``inner``.

    ``torch.compile(model, backend=fuselab.nn.fused_backend())``
    """

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fuse_relu_matmul(gm)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    return backend
