"""Patch existing models: every Linear followed by ReLU becomes one fused op.

Three mechanisms, tried in this order, each recorded in the returned report:
1. Hugging Face feed-forward blocks, through small per-architecture adapters (no source edits);
2. ``nn.Sequential`` pairs (torchvision classifier heads, plain MLPs);
3. a ``torch.fx`` rewrite of models that ``symbolic_trace`` can trace faithfully (not a forward that
   reads train/eval mode, switches grad mode, autocast or saved-tensor hooks, tests an argument
   (``mask is None``), reads a global number, tensor or object, or assigns to the model's state: the graph
   would freeze or drop those).
``fuse_relu_matmul`` is the graph rewrite behind (3) and behind ``fused_backend``, which does the
same for any model ``torch.compile`` captures.

Patching never changes what a model computes: a layer whose swap could (hooks, pruning, a
parametrization, a Sequential subclass's own forward, a dtype or device the op does not run) is
left alone, with the reason in the report. Every decision is made before anything changes, so an
error (from ``filter_fn``, say) leaves the model as it was.
"""
import ast
import collections
import contextlib
import dis
import enum
import functools
import inspect
import operator
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from fuselab.nn.linear_relu import FusedConv1DReLU, FusedLinearReLU, fused_linear_relu, fused_matmul_relu, why_not_fused

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


def _source_tree(fn) -> Optional[ast.AST]:
    """The syntax tree of function ``fn``'s source; None where there is none (made by exec, a builtin) or it
    does not parse alone."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


@functools.lru_cache(maxsize=None)
def _adapter_matches(cls: type, lin: str, act: str) -> bool:
    """Whether ``cls.forward`` calls ``self.<lin>`` and ``self.<act>`` once each, as ``act(lin(x))``
    or as ``h = self.<lin>(...)`` directly followed by ``h = self.<act>(h)``: a transformers
    release that reshapes the block is then left alone instead of being patched wrongly."""
    tree = _source_tree(cls.forward)
    if tree is None:
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
        # names quoted: a Sequential's children are named "0", "1", ..., which would read as counts
        lines += [f"  fused    {name!r}" for name in self.fused]
        lines += [f"  skipped  {name!r}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Which layers may be swapped for a fused one
# ----------------------------------------------------------------------------------------------

_FUSED_LAYERS = (FusedLinearReLU, FusedConv1DReLU)


def is_conv1d(layer) -> bool:
    """Whether ``layer`` is transformers' ``Conv1D`` (GPT-2's projections: ``x @ weight + bias``, weight
    (in, out)), recognised without importing transformers."""
    return type(layer).__name__ == "Conv1D" and type(layer).__module__ == "transformers.pytorch_utils"


def _is_linear_layer(module) -> bool:
    """What the report accounts for: every nn.Linear (subclasses too) and transformers' Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensors (FSDP's fully_shard, say): FSDP gathers them into
    this module object before each forward, so a fused layer must be this object."""
    return any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False))


def _converted_in_place(layer: nn.Module, cls: type) -> nn.Module:
    layer.__class__ = cls  # same attributes, parameters and FSDP bookkeeping; only the forward changes
    return layer


def _fused_layer(layer):
    """The converter to a fused layer for ``layer`` (an exact nn.Linear or transformers' Conv1D), else
    None: a new layer sharing its parameters, or for a sharded layer the same object, converted."""
    cls = FusedLinearReLU if type(layer) is nn.Linear else FusedConv1DReLU if is_conv1d(layer) else None
    if cls is None:
        return None
    if _sharded(layer):
        return functools.partial(_converted_in_place, cls=cls)
    return cls.from_linear if cls is FusedLinearReLU else cls.from_conv1d


def why_not_swapped(module: nn.Module) -> Optional[str]:
    """Why replacing ``module`` (a layer, or its ReLU) by a fused or quantized one could change the model;
    None where it cannot."""
    if _sharded(module):  # converted in place: its state-dict hooks (FSDP's) stay, and run as before
        hooks = [name.strip("_") for name, value in vars(module).items()
                 if name.endswith("_hooks") and value and "state_dict" not in name]
        return f"has hooks ({', '.join(hooks)}) that would see the ReLU's output" if hooks else None
    if parametrize.is_parametrized(module):
        return "its weight is parametrized (torch.nn.utils.parametrize), which a fused layer would bypass"
    if any(isinstance(hook, prune.BasePruningMethod) for hook in module._forward_pre_hooks.values()):
        return "pruned (torch.nn.utils.prune): a pre-hook recomputes its weight, which a fused layer would not run"
    hooks = [name.strip("_") for name, value in vars(module).items() if name.endswith("_hooks") and value]
    if hooks:
        return f"has hooks ({', '.join(hooks)}) that would no longer run"
    if "forward" in vars(module):
        return "its forward is replaced on the instance (accelerate's hooks, say)"
    extra = sorted(k for k, v in module._parameters.items() if v is not None and k not in ("weight", "bias"))
    extra += sorted(k for k, v in module._buffers.items() if v is not None)
    if extra:  # the new layer holds the weight and bias only: these would vanish from the model and its state
        return f"holds {', '.join(extra)} besides its weight and bias, which the new layer would drop"
    return None


def _why_not_fusable(layer: nn.Module, act: Optional[nn.Module]) -> Optional[str]:
    """Why ``layer`` followed by the ReLU module ``act`` (None: a functional relu) may not become one
    fused layer; None where it may."""
    if isinstance(layer, _FUSED_LAYERS):
        return "already fused"
    why = why_not_swapped(layer)
    if why is None and _fused_layer(layer) is None:
        cls = type(layer)
        why = f"a {cls.__module__}.{cls.__qualname__}, not exactly an nn.Linear (its forward may differ)"
    if why is None and act is not None and (act_why := why_not_swapped(act)) is not None:
        why = f"its ReLU {act_why}"
    return why or why_not_fused(None, layer.weight, layer.bias, linear=type(layer) is nn.Linear)


def _accept_all(name, layer) -> bool:
    return True


def _decide(name: str, layer, why: Optional[str], filter_fn, skipped: Dict[str, str]) -> bool:
    """Whether to fuse ``layer``: no reason against it and ``filter_fn`` agrees; else the reason goes to ``skipped``."""
    if why is None and not filter_fn(name, layer):
        why = "vetoed by filter_fn"
    if why is not None:
        skipped.setdefault(name, why)
    return why is None


# ----------------------------------------------------------------------------------------------
# Module patching: Hugging Face blocks and Sequential pairs, planned first, then applied
# ----------------------------------------------------------------------------------------------

# One planned swap: (report name, parent module, the layer's key, what makes its fused layer, the ReLU's key).
_Swap = Tuple[str, nn.Module, str, Callable[[], nn.Module], str]


def _plan_hf_blocks(model, filter_fn, report) -> List[_Swap]:
    swaps = []
    for name, block in model.named_modules():
        # the class itself, or the one FSDP2's fully_shard derived FSDP<Name> from (it wraps the forward);
        # a subclass that defines its own forward is not that block: not the forward the adapter checked
        cls = next((c for c in type(block).__mro__ if c.__name__ in HF_ADAPTERS), None)
        if cls is None or inspect.unwrap(type(block).forward) is not inspect.unwrap(cls.forward):
            continue
        lin_attr, act_attr = HF_ADAPTERS[cls.__name__]
        layer, act = getattr(block, lin_attr), getattr(block, act_attr)
        full = f"{name}.{lin_attr}" if name else lin_attr
        if isinstance(layer, _FUSED_LAYERS):
            why = "already fused"
        elif type(act) is not nn.ReLU:
            why = f"activation is {type(act).__name__}, not ReLU"
        elif "forward" in vars(block):
            why = f"its {type(block).__name__}'s forward is replaced on the instance"
        elif not _adapter_matches(cls, lin_attr, act_attr):
            why = (f"{cls.__name__}.forward no longer computes "
                   f"{act_attr}({lin_attr}(x)) alone (another transformers version?)")
        else:
            why = _why_not_fusable(layer, act)
        if _decide(full, layer, why, filter_fn, report.skipped):
            swaps.append((full, block, lin_attr, functools.partial(_fused_layer(layer), layer), act_attr))
    return swaps


# What a parent may do with its Sequential besides calling it: what holds for a fused layer as for the Linear it
# replaced (its parameters, moves, modes; apply(init): a fused layer is an nn.Linear).
_WHOLE_MODULE_USES = frozenset({"parameters", "named_parameters", "buffers", "named_buffers", "apply", "to", "cuda",
                                "cpu", "train", "eval", "training", "requires_grad_", "zero_grad", "state_dict",
                                "load_state_dict", "float", "half", "double", "bfloat16", "type"})


def _attribute_step(node: ast.AST) -> Optional[Tuple[str, ast.AST]]:
    """(attribute name, the node it is taken of) where ``node`` takes one: x.name, getattr(x, "name"),
    x._modules["name"]; None elsewhere."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return node.attr, node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
        return node.args[1].value, node.args[0]
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "_modules"
            and isinstance(node.slice, ast.Constant)):
        return node.slice.value, node.value.value
    return None


def attribute_chain(node: ast.AST) -> Tuple[Optional[str], Tuple[str, ...]]:
    """``x.a.b[0]`` as ("x", ("a", "b", "0")): the name it starts at and its steps (``_attribute_step``'s, and an
    index by a constant: a ModuleList's child "0"); (None, ()) where it does not start at a name."""
    path = []
    while True:
        taken = _attribute_step(node)
        if taken is None and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            taken = str(node.slice.value), node.value
        if taken is None:
            break
        path.append(taken[0])
        node = taken[1]
    return (node.id if isinstance(node, ast.Name) else None), tuple(reversed(path))


def reads_path(node: ast.AST, me: str, path: Tuple[str, ...]) -> bool:
    """Whether ``node`` is ``me.<path>`` (``self.block.mlp``, ``self.layers[0].mlp``, through attributes, getattr,
    ``_modules`` or constant indices)."""
    return attribute_chain(node) == (me, tuple(path))


def _reaching_use(method: ast.AST, me: str, path: Tuple[str, ...]) -> bool:
    """Whether ``method`` uses ``me.<path>`` (its Sequential, ``path`` the attribute names down to it) other than by
    calling it or by a whole-module use: an index, an iteration, an alias, an argument (``len`` aside); reached as
    ``reads_path`` reads it or as ``me.get_submodule("dotted.path")``."""
    parents = {id(child): node for node in ast.walk(method) for child in ast.iter_child_nodes(node)}
    dotted = ".".join(path)
    aliases = _single_assignments(method)
    for node in ast.walk(method):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_submodule"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == me and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and (node.args[0].value + ".").startswith(dotted + ".")):
            if node.args[0].value != dotted:  # a module inside the Sequential
                return True
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == me
              and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant)):
            if _indexed_or_iterated(node, parents, method, aliases):
                return True  # getattr(self, name)[0]: which module it indexes is not in the source
            continue
        elif (isinstance(node, ast.Assign) and id(node) in aliases and node.targets[0].id != me
              and any(reads_path(node.value, me, path[:i]) and _reaching_use(method, node.targets[0].id, path[i:])
                      for i in range(1, len(path)))):
            return True  # a module above the Sequential under another name: inner = self.inner; inner.mlp[0](x)
        elif not reads_path(node, me, path):
            continue
        up = parents.get(id(node))
        if isinstance(up, ast.Call) and up.func is node:  # self.key(x)
            continue
        if isinstance(up, ast.Attribute) and up.attr in _WHOLE_MODULE_USES:  # self.key.parameters()
            continue
        if (isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("len", "isinstance")
                and node in up.args):
            continue
        return True
    return False


def _single_assignments(method: ast.AST) -> set:
    """ids of the ``name = value`` statements whose name ``method`` assigns nowhere else (a local alias the source
    pins down; a name reused for other modules is not taken for any of them)."""
    assigns = [n for n in ast.walk(method) if isinstance(n, ast.Assign) and len(n.targets) == 1
               and isinstance(n.targets[0], ast.Name)]
    stores = collections.Counter(n.id for n in ast.walk(method) if isinstance(n, ast.Name)
                                 and isinstance(n.ctx, ast.Store))
    return {id(n) for n in assigns if stores[n.targets[0].id] == 1}


def _indexed_or_iterated(node: ast.AST, parents: Dict[int, ast.AST], method: ast.AST, aliases: set) -> bool:
    """Whether the module ``node`` evaluates to is indexed or iterated there, or through the local name it is
    assigned to (``seq = getattr(self, name); seq[0](x)``)."""
    up = parents.get(id(node))
    if isinstance(up, ast.Assign) and id(up) in aliases:
        name = up.targets[0].id
        return any(_indexed_or_iterated(n, parents, method, set()) for n in ast.walk(method)
                   if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load))
    return (isinstance(up, ast.Subscript) and up.value is node) or (
        isinstance(up, (ast.For, ast.comprehension)) and up.iter is node)


def _init_closures(cls: type) -> Iterator[Tuple[str, ast.AST, str]]:
    """(where, function, ``self``'s name) of each lambda or function that ``cls.__init__`` defines: it runs after
    patching (``self.pre = lambda x: self.body[0](x)``), with ``__init__``'s ``self``."""
    init = vars(cls).get("__init__")
    tree = _source_tree(init) if init is not None else None
    outer = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None) if tree else None
    if outer is None or not outer.args.args:
        return
    for node in ast.walk(outer):
        if node is not outer and isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "__init__", node, outer.args.args[0].arg


_LIBRARIES = ("torch.", "transformers.")  # modules whose classes' sources are not read (they do not reach inside)


def _parent_reaches_inside(parent: nn.Module, path: Tuple[str, ...]) -> Optional[str]:
    """Why ``parent`` may use the Sequential at attribute ``path`` below it other than by calling it whole
    (``self.key[0](x)``, ``for layer in self.key``, ``self.block.mlp[0](x)`` from a module above: it would meet the
    fused layer, ReLU included, and an Identity for the ReLU); None where every use in its class's own methods is a
    call or a whole-module use. A Sequential or a module list holding it is taken as calling it whole; torch's and
    transformers' methods are not read."""
    if isinstance(parent, (nn.ModuleList, nn.ModuleDict)) or (
            type(parent).forward is nn.Sequential.forward and "forward" not in vars(parent)):
        return None
    cls, dotted = type(parent), ".".join(path)
    methods = [(name, method, method.args.args[0].arg if method is not None and method.args.args else None)
               for name, method in class_methods(cls, skip_modules=_LIBRARIES)]
    if not cls.__module__.startswith(_LIBRARIES):
        methods += list(_init_closures(cls))
    for name, method, me in methods:  # me: "self", by convention only
        if method is None:
            return f"{cls.__name__}.{name} has no readable source to check how it uses its Sequential {dotted}"
        if me is not None and _reaching_use(method, me, path):
            return (f"{cls.__name__}.{name} uses {me}.{dotted} other than by calling it (indexed or iterated, it "
                    "would meet the fused layer, ReLU included)")
    return None


def ancestor_paths(modules: Dict[str, nn.Module], name: str) -> Iterator[Tuple[nn.Module, Tuple[str, ...]]]:
    """(module above ``name``, the attribute path from it down to ``name``) for every module above it, its parent
    first; ``modules``: a model's ``named_modules()`` as a dict."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        yield modules[".".join(parts[:i])], tuple(parts[i:])


def _ancestors_reach_inside(modules: Dict[str, nn.Module], name: str) -> Optional[str]:
    """``_parent_reaches_inside`` for every module above the Sequential ``name``, its parent first."""
    for ancestor, path in ancestor_paths(modules, name):
        why = _parent_reaches_inside(ancestor, path)
        if why is not None:
            return why
    return None


def class_methods(cls: type, skip_modules: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Optional[ast.AST]]]:
    """(name, syntax tree of the function) for each method of ``cls`` (inherited too) and its properties'
    functions, None where there is no readable source; ``__init__`` (it ran before any patch), static methods
    and functions of modules starting with ``skip_modules`` left out."""
    members = inspect.getmembers(cls, inspect.isfunction)
    for klass in cls.__mro__:
        for name, attr in vars(klass).items():
            if isinstance(attr, property):
                members += [(name, f) for f in (attr.fget, attr.fset, attr.fdel) if f is not None]
            elif isinstance(attr, functools.cached_property):
                members.append((name, attr.func))
    for name, fn in members:
        module = getattr(fn, "__module__", None) or ""
        if (name == "__init__" or (skip_modules and module.startswith(skip_modules))
                or isinstance(inspect.getattr_static(cls, name, None), staticmethod)):
            continue
        tree = _source_tree(fn)  # a lambda in the class body: its assignment's line
        yield name, next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.Lambda))), None) if tree else None


def _plan_sequentials(model, filter_fn, report) -> List[_Swap]:
    swaps = []
    modules, every = dict(model.named_modules()), dict(model.named_modules(remove_duplicate=False))
    names: Dict[int, List[str]] = {}
    for name, module in every.items():  # a Sequential held under several names is reached from each
        names.setdefault(id(module), []).append(name)
    for name, seq in modules.items():
        if not isinstance(seq, nn.Sequential):
            continue
        # read the sources above only for a Sequential with something to fuse
        reaches = functools.cache(lambda: next(filter(None, (_ancestors_reach_inside(every, n)
                                                             for n in names[id(seq)] if n)), None))
        children = list(seq._modules.items())  # not named_children(): it skips a module's repeats
        for (key, layer), (act_key, act) in zip(children, children[1:] + [(None, None)]):
            if not _is_linear_layer(layer):
                continue
            full = f"{name}.{key}" if name else key
            if type(seq).forward is not nn.Sequential.forward or "forward" in vars(seq):
                why = f"inside {type(seq).__name__}, an nn.Sequential with its own forward"
            elif type(act) is nn.ReLU and reaches() is not None:
                why = reaches()
            elif isinstance(layer, _FUSED_LAYERS):
                why = "already fused"
            elif type(act) is not nn.ReLU:
                why = f"followed by {type(act).__name__ if act is not None else 'nothing'}, not ReLU"
            else:
                why = _why_not_fusable(layer, act)
            if _decide(full, layer, why, filter_fn, report.skipped):
                swaps.append((full, seq, key, functools.partial(_fused_layer(layer), layer), act_key))
    return swaps


def fuse_linear_relu(model: nn.Module, filter_fn: Optional[Callable[[str, Optional[nn.Module]], bool]] = None
                     ) -> Tuple[nn.Module, FusionReport]:
    """Replace every Linear followed by ReLU with the fused op; returns ``(model, report)``.

    Modules are patched in place (HF blocks, Sequential pairs); other models are traced with
    torch.fx and a rewritten GraphModule is returned (it saves and loads, and patching it again
    finds nothing more to fuse). ``filter_fn(name, layer) -> bool`` can veto a layer (an
    nn.Linear, GPT-2's Conv1D, or None for a functional ``F.linear`` in a traced forward). A Linear
    whose output is also used elsewhere, with anything (Dropout, say) between it and the ReLU, or
    whose swap could change what the model computes, is left alone and the report says why; a
    model with nothing to fuse is returned unchanged. If ``filter_fn`` raises, nothing is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_linear_relu patches an nn.Module, got {type(model).__name__}")
    filter_fn = filter_fn or _accept_all
    report = FusionReport()
    swaps = _plan_hf_blocks(model, filter_fn, report) + _plan_sequentials(model, filter_fn, report)
    result, others = model, ("not followed by a ReLU module in a known block or Sequential (the torch.fx path, "
                             "which also sees functional ReLUs, runs only where module patching fused nothing)")
    if swaps:  # every decision is made: only assignments from here on
        for name, parent, layer_key, make_fused, act_key in swaps:
            training = getattr(parent, layer_key).training
            setattr(parent, layer_key, make_fused().train(training))  # the model's mode, not a new module's
            setattr(parent, act_key, nn.Identity().train(training))
            report.fused.append(name)
        report.method = "module patching"
    elif _plain_sequential(model):  # a GraphModule would lose its indexing and methods: each child is traced
        others = _fuse_children_traced(model, filter_fn, report)
    elif not any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__):  # HF: adapters only
        result, others = _fuse_traced(model, filter_fn, report)
    for name in report.fused:  # a Sequential's last Linear may be fused where the fx graph applies a ReLU
        report.skipped.pop(name, None)
    for name, layer in model.named_modules():
        if _is_linear_layer(layer) and name not in report.fused:
            report.skipped.setdefault(name, "already fused" if isinstance(layer, _FUSED_LAYERS) else others)
        elif getattr(layer, "fusion_note", None):  # fuselab.quant's quantized Linear layers
            report.skipped.setdefault(name, layer.fusion_note)
    return result, report


# ----------------------------------------------------------------------------------------------
# The torch.fx path: a trace that computes what the model computes, then the graph rewrite
# ----------------------------------------------------------------------------------------------


class _Unfaithful(Exception):
    """The forward does something a torch.fx graph would not record."""


def _modes() -> tuple:
    # saved-tensor hooks: activation checkpointing (torch.utils.checkpoint), save_on_cpu
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"),
            torch._C._autograd._top_saved_tensors_default_hooks(True) is not None)


class _FaithfulTracer(torch.fx.Tracer):
    """``symbolic_trace``'s tracer, refusing forwards that switch grad mode, autocast or saved-tensor hooks
    (``no_grad`` blocks, activation checkpointing): the graph would record the ops inside without the switch.
    Buffers are traced as graph inputs, not read as values: a forward's in-place update of one (an EMA) is
    recorded, and a Python decision on a buffer's value (``if self.scale.sum() > 0``) is refused by the
    tracer instead of frozen."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # fuselab's fused layers are called whole, as torch.nn's are (a model patched before is traced again)
        return isinstance(m, _FUSED_LAYERS) or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root, concrete_args=None):
        self.modes = _modes()
        return super().trace(root, concrete_args)

    def create_node(self, *args, **kwargs):
        if _modes() != self.modes:
            raise _Unfaithful("forward switches grad mode, autocast or saved-tensor hooks (activation checkpointing), "
                              "which a torch.fx graph does not record")
        return super().create_node(*args, **kwargs)


def _version(t: torch.Tensor) -> Optional[int]:
    """``t``'s in-place version counter; None for an inference tensor, which has none (and cannot change)."""
    try:
        return t._version
    except RuntimeError:
        return None


_FX_CONSTANT = re.compile(r"_tensor_constant\d+")  # the attribute torch.fx's tracer sets for a tensor it meets


@contextlib.contextmanager
def _state_kept(model: nn.Module):
    """Tracing runs the forward's Python: what it assigns to the modules (``self.count = self.count + 1``
    stores a tracing proxy) is put back, and the trace refused, as is a tensor it changed in place."""
    held = [(m, {k: dict(vars(m)[k]) for k in ("_parameters", "_buffers", "_modules")}, dict(vars(m)))
            for m in model.modules()]
    versions = {id(t): _version(t) for t in (*model.parameters(), *model.buffers())}
    names = {id(m): n or "the model" for n, m in model.named_modules()}
    try:
        yield
    finally:
        changed = []
        for module, tables, attributes in held:
            for key, table in tables.items():  # by identity: a proxy's == is itself traced
                now = vars(module)[key]
                if now.keys() != table.keys() or any(now[k] is not v for k, v in table.items()):
                    moved = [k for k in now.keys() | table.keys() if now.get(k) is not table.get(k)]
                    changed.append(f"{names[id(module)]}.{moved[0]}".replace("the model.", ""))
                    now.clear()
                    now.update(table)
            added = [k for k in vars(module).keys() - attributes.keys() if not _FX_CONSTANT.fullmatch(k)]
            if added or attributes.keys() - vars(module).keys() or any(
                    vars(module)[k] is not v for k, v in attributes.items() if k not in tables):
                changed.append(names[id(module)] + (f".{added[0]}" if added else ""))
            vars(module).clear()  # the tracer's own constants (tensors it met) go too: the GraphModule holds them
            vars(module).update(attributes)
    if changed:
        raise _Unfaithful(f"forward assigns to {changed[0]}, which a torch.fx graph does not record")
    if any(_version(t) != versions[id(t)] for t in (*model.parameters(), *model.buffers())):
        raise _Unfaithful("forward changed a parameter or buffer in place while it was traced")


def _graph_module(model: nn.Module) -> torch.fx.GraphModule:
    tracer = _FaithfulTracer()
    with _state_kept(model):
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


@contextlib.contextmanager
def training_mode(model: nn.Module, training: bool):
    """Every module of ``model`` in train or eval mode inside, each module's own flag restored after
    (``model.train(mode)`` sets one flag for all: a frozen BatchNorm in a training model would come back training)."""
    flags = {m: m.training for m in model.modules()}
    try:
        for m in flags:
            m.training = training
        yield model
    finally:
        for m, flag in flags.items():
            m.training = flag


@contextlib.contextmanager
def _modes_set(model: nn.Module, training: bool, grad: bool, autocast: bool):
    """Every module of ``model`` in train or eval mode, grad mode and cpu/cuda autocast as given; all
    restored on exit."""
    autocasts = {device: torch.is_autocast_enabled(device) for device in ("cpu", "cuda")}
    try:
        for device in autocasts:
            torch.set_autocast_enabled(device, autocast)
        with training_mode(model, training), torch.set_grad_enabled(grad):
            yield
    finally:
        for device, enabled in autocasts.items():
            torch.set_autocast_enabled(device, enabled)


# What torch.fx keeps on every GraphModule (a fuse_linear_relu result patched again is one): not the user's state
_GRAPH_MODULE_ATTRIBUTES = frozenset({"meta", "shape_env"})
# What nn.Module (and GraphModule) keep in a module's __dict__ themselves; any other attribute, private ones too,
# is the model's own state, which a graph would freeze.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_GRAPH_MODULE_INTERNALS = _GRAPH_MODULE_ATTRIBUTES | frozenset(vars(torch.fx.GraphModule(nn.Module(),
                                                                                    torch.fx.Graph())))


def _snapshot_hazard(model: nn.Module) -> Optional[str]:
    """Why a GraphModule (a snapshot of ``forward``) could behave differently from ``model`` later: hooks,
    Python attributes or methods of the modules the trace goes through (not of the leaf modules it
    calls whole, which the GraphModule keeps), which it would drop or freeze; None where none."""
    leaf = _FaithfulTracer().is_leaf_module
    for name, module in model.named_modules():
        if name and leaf(module, name):
            continue
        where = name or "the model"
        hooks = [k.strip("_") for k, v in vars(module).items() if k.endswith("_hooks") and v]
        if hooks:
            return f"{where} has hooks ({', '.join(hooks)}) that the rewritten GraphModule would drop"
        overrides = [k for k in ("state_dict", "load_state_dict", "_save_to_state_dict", "_load_from_state_dict")
                     if getattr(type(module), k) is not getattr(nn.Module, k)]
        if overrides:
            return f"{where} overrides {', '.join(overrides)}, which the rewritten GraphModule would not have"
        own = _GRAPH_MODULE_INTERNALS if isinstance(module, torch.fx.GraphModule) else _MODULE_INTERNALS
        plain = [k for k in vars(module) if k not in own and k != "training"]  # `self._temperature` too
        if plain:
            return (f"{where} keeps Python attributes ({', '.join(plain)}) that a torch.fx graph would freeze "
                    "(a later change would no longer take effect)")
    methods = [k for k, v in vars(type(model)).items() if callable(v) and not k.startswith("_") and k != "forward"]
    if methods:
        return f"the model defines methods ({', '.join(methods)}) that the rewritten GraphModule would not have"
    return None


# Attributes of a module that describe its structure (its shapes, its flags), which nothing changes later: reading
# them in a forward is safe to freeze. Any other attribute (a Dropout's p, scheduled during training) is not.
_STRUCTURAL = frozenset({"in_features", "out_features", "in_channels", "out_channels", "kernel_size", "stride",
                         "padding", "dilation", "groups", "padding_mode", "num_features", "normalized_shape", "eps",
                         "affine", "elementwise_affine", "track_running_stats", "embedding_dim", "num_embeddings",
                         "padding_idx", "embed_dim", "num_heads", "head_dim", "batch_first", "inplace"})
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict, nn.Sequential)


def _constant(value) -> bool:
    """Whether a global a forward reads names code, not data (a module, a class, a function, a dtype), safe for a
    graph to keep as it was when traced; a number, a tensor or an object may be rebound later (a rate a training
    loop schedules), and the graph would keep the old value."""
    if inspect.ismodule(value):  # Python's and NumPy's random generators are state: a draw would be frozen
        return value.__name__ not in _RANDOM_MODULES
    return (value is None or isinstance(value, (type, torch.dtype, enum.Enum))
            or inspect.isfunction(value) or inspect.isbuiltin(value) or isinstance(value, torch._ops.OpOverloadPacket))


_RANDOM_MODULES = frozenset({"random", "numpy.random", "secrets"})


def _outside_reads(fn) -> List[str]:
    """Names of the global and closure variables ``fn``'s code (nested code too) reads, with values that are data,
    not code (``_constant``)."""
    if not inspect.isfunction(fn):
        return []
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    names, codes = set(), [fn.__code__]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"):
                names.add(ins.argval)
    out = []
    for name in sorted(names):
        if name in cells:
            try:
                value = cells[name].cell_contents
            except ValueError:  # an empty cell
                continue
        elif name in fn.__globals__:
            value = fn.__globals__[name]
        else:
            continue  # a builtin, or a name local to nested code
        if not _constant(value):
            out.append(name)
    return out


def _frozen_by_trace(model: nn.Module, gm: torch.fx.GraphModule) -> Optional[str]:
    """What the graph of ``model``'s forward fixed at one value: an argument the graph never reads (a test
    such as ``mask is None`` ran once, while tracing) or one defaulting to None, a tensor met outside the
    model, a global that is data (a number, a tensor, an object), an attribute of a module the graph calls
    whole (not its shapes), a module it does not call (read instead); None where nothing."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and not node.users:
            return (f"forward's argument {node.target} does not reach the graph: a test on it (`is None`) "
                    "would be frozen at the traced value")
        if node.op == "placeholder" and node.args and not isinstance(node.args[0], (bool, int, float, str)):
            return (f"forward's argument {node.target} defaults to {node.args[0]!r}: the graph records the path "
                    "of a value passed (`mask is not None`), which a call without it would not take")
    leaf = _FaithfulTracer().is_leaf_module
    kept = dict(gm.named_modules())
    for name, module in model.named_modules():
        if name and name not in kept and leaf(module, name) and not any(name.startswith(f"{k}.") for k in kept if k):
            return (f"the forward reads module {name} without calling it (or never uses it): the rewritten "
                    "GraphModule would not have it, and a value read from it would be frozen")
        if name and leaf(module, name):
            continue
        where = name or "the model"
        methods = [fn for _, fn in inspect.getmembers(type(module), inspect.isfunction)  # forward and its helpers
                   if not (getattr(fn, "__module__", None) or "").startswith("torch.")]
        outside = sorted({name for fn in methods for name in _outside_reads(fn)})
        if outside:
            return (f"{where}'s code reads {', '.join(outside)} from outside the model, which a torch.fx graph "
                    "would freeze (a later change would no longer take effect)")
        tree = _source_tree(type(module).forward)
        why = _proxy_blind_test(tree) if tree is not None else None
        if why is not None:
            return f"{where}'s forward {why}"
        children = {k: c for k, c in module.named_children()
                    if leaf(c, f"{name}.{k}" if name else k) and not isinstance(c, _CONTAINERS)}
        for node in ast.walk(tree) if tree is not None else ():
            inner = node.value if isinstance(node, ast.Attribute) else None
            if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"
                    and inner.attr in children):
                child = children[inner.attr]
                if node.attr not in (*child._parameters, *child._buffers, *child._modules, *_STRUCTURAL):
                    return (f"{where}'s forward reads {inner.attr}.{node.attr}, which a torch.fx graph would freeze "
                            "(a later change would no longer take effect)")
    if any(node.op == "get_attr" and _FX_CONSTANT.fullmatch(node.target) for node in gm.graph.nodes):
        return ("the forward makes or reads a tensor outside the model (a global, `torch.tensor(...)`): a torch.fx "
                "graph keeps it as a frozen constant, and in its state dict")
    return None


def _proxy_blind_test(tree: ast.AST) -> Optional[str]:
    """What in a forward's syntax tree a torch.fx trace answers for a Proxy instead of the value, freezing its
    branch: ``isinstance(h, ...)`` of anything but ``self``'s attributes (a Proxy is no Tensor), a draw from
    ``np.random``; None where nothing."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and node.args and not (isinstance(node.args[0], ast.Attribute) and isinstance(node.args[0].value,
                                                                                                ast.Name)
                                       and node.args[0].value.id == "self")):
            return (f"tests isinstance({ast.unparse(node.args[0])}, ...), which a torch.fx trace answers for a "
                    "Proxy (freezing the branch it took)")
        if isinstance(node, ast.Attribute) and node.attr == "random" and isinstance(node.value, ast.Name) and \
                node.value.id in ("np", "numpy"):
            return "draws from numpy.random, which a torch.fx graph would freeze at the traced draw"
    return None


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    """``symbolic_trace(model)``, raising ``_Unfaithful`` where the graph would compute something else.

    Traced again in train mode with grad on and autocast off, and in eval mode with grad off and
    autocast on: a forward that reads these modes traces differently, and one that switches them
    (``no_grad``, ``autocast(enabled=False)``) is refused by the tracer in one of the traces."""
    gm = _graph_module(model)
    for training, grad in ((True, True), (False, False)):
        with _modes_set(model, training, grad, autocast=not grad):
            if _graph_module(model).code != gm.code:
                raise _Unfaithful("forward depends on train/eval mode, grad mode or autocast, "
                                  "which a torch.fx graph would freeze")
    gm.training = model.training
    return gm


def _fuse_children_traced(model: nn.Sequential, filter_fn, report) -> str:
    """The fx path on each child of a plain Sequential, in place (a nested plain Sequential likewise; a child ending
    in a Linear and a ReLU child after it are not fused: neither trace sees both); the reason for Linear layers
    left alone that no child's report names."""
    swaps = _plan_children_traced(model, filter_fn, report)
    for parent, key, result in swaps:  # every decision made (a raising filter_fn changed nothing)
        setattr(parent, key, result)
    if swaps:
        report.method = "torch.fx rewrite of the Sequential's children"
    return "not followed by ReLU, or its output is used elsewhere (fx graphs of the Sequential's children)"


def _plain_sequential(module: nn.Module) -> bool:
    return type(module) is nn.Sequential and "forward" not in vars(module)  # not a forward set on the instance


def _plan_children_traced(model: nn.Sequential, filter_fn, report, done: Optional[dict] = None
                          ) -> List[Tuple[nn.Module, str, nn.Module]]:
    """``_fuse_children_traced``'s decisions: (parent, key, rewritten child) for each child the fx path fuses."""
    swaps, done = [], {} if done is None else done  # a module under two keys is traced once, replaced under both
    for key, child in model._modules.items():
        if child is None:
            continue
        if id(child) not in done:
            child_report = FusionReport()
            child_filter = lambda name, layer, key=key: filter_fn(f"{key}.{name}", layer)  # noqa: E731
            if _plain_sequential(child):
                result, why = child, "not followed by ReLU, or its output is used elsewhere (fx graphs)"
                swaps += _plan_children_traced(child, child_filter, child_report, done)
            else:
                result, why = _fuse_traced(child, child_filter, child_report)
            for name, layer in child.named_modules():  # this child's reason for what its trace left alone
                if name and _is_linear_layer(layer) and name not in child_report.fused:
                    child_report.skipped.setdefault(name, why)
            done[id(child)] = result, child_report
        result, child_report = done[id(child)]
        report.fused += [f"{key}.{name}" for name in child_report.fused]
        for name, reason in child_report.skipped.items():  # module patching's reason, where it gave one, stays
            report.skipped.setdefault(f"{key}.{name}", reason)
        if child_report.fused and result is not child:
            swaps.append((model, key, result))
    return swaps


def _fuse_traced(model, filter_fn, report) -> Tuple[nn.Module, str]:
    """The fx path: (the rewritten GraphModule, or ``model``; why other Linear layers were left alone)."""
    refused = "no ReLU module after it, and the torch.fx path (functional ReLUs) could not run: "
    hazard = _snapshot_hazard(model)
    if hazard is not None:
        return model, refused + hazard
    try:
        gm = _trace(model)
    except _Unfaithful as e:
        return model, refused + str(e)
    except Exception as e:  # noqa: BLE001  dynamic control flow etc.: say so, change nothing
        return model, refused + f"model not traceable by torch.fx ({type(e).__name__})"
    # A GraphModule holds what its graph reads: parameters, buffers and modules the forward leaves unused
    # (an EMA buffer, an auxiliary head) would vanish from the model and its state dict.
    kept = {id(t) for t in (*gm.parameters(), *gm.buffers())}
    unused = sorted(n for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) not in kept)
    keys = sorted(set(model.state_dict()) - set(gm.state_dict()))
    if unused or keys:
        names = unused or keys
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        what = (f"the forward does not use {', '.join(names[:3])}{more}: the rewritten GraphModule would not "
                "have them" if unused else f"the rewritten GraphModule's state dict would lack {', '.join(names[:3])}"
                f"{more} (a module under two names, say)")
        return model, refused + what
    frozen = _frozen_by_trace(model, gm)
    if frozen is not None:
        return model, refused + frozen
    report.fused = fuse_relu_matmul(gm, filter_fn, report.skipped)
    if not report.fused:
        return model, "not followed by ReLU, or its output is used elsewhere (fx graph)"
    report.method = "torch.fx rewrite"
    return gm, "not followed by ReLU, or its output is used elsewhere (fx graph)"


# ----------------------------------------------------------------------------------------------
# The graph rewrite, shared by the fx path and the torch.compile backend
# ----------------------------------------------------------------------------------------------

_RELU_FUNCTIONS = {torch.relu, F.relu, torch.relu_, torch.ops.aten.relu.default}

# Product targets -> (their positional parameters, the names of (a, b, bias) among them). F.linear's
# b is its weight, (N, K); any other argument (addmm's beta, alpha) leaves the product alone.
_PRODUCTS = {
    F.linear: (("input", "weight", "bias"), ("input", "weight", "bias")),
    torch._C._nn.linear: (("input", "weight", "bias"), ("input", "weight", "bias")),
    torch.matmul: (("input", "other"), ("input", "other", None)),
    operator.matmul: (("a", "b"), ("a", "b", None)),
    torch.mm: (("input", "mat2"), ("input", "mat2", None)),
    torch.addmm: (("input", "mat1", "mat2"), ("mat1", "mat2", "input")),
}
_LINEAR_FUNCTIONS = {F.linear, torch._C._nn.linear}


def _relu_input(gm, node) -> Optional[torch.fx.Node]:
    """The node that ReLU node ``node`` rectifies; None if ``node`` is no ReLU."""
    is_relu = ((node.op == "call_function" and node.target in _RELU_FUNCTIONS)
               or (node.op == "call_method" and node.target in ("relu", "relu_"))
               or (node.op == "call_module" and type(gm.get_submodule(node.target)) is nn.ReLU))
    arg = (node.args[0] if node.args else node.kwargs.get("input")) if is_relu else None
    return arg if isinstance(arg, torch.fx.Node) else None


def _value(gm, node) -> Optional[torch.Tensor]:
    """The tensor (fake or real) the graph recorded for ``node``: meta 'val'/'example_value', or a
    get_attr's own tensor; None where unknown."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None and node.op == "get_attr":
        val = functools.reduce(getattr, node.target.split("."), gm)
    return val if isinstance(val, torch.Tensor) else None


def _operands(node) -> Optional[tuple]:
    """``(a, b, bias)`` of a product node (``b`` a linear's weight), or None if it is no product we know."""
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return None
    params, (a_name, b_name, bias_name) = _PRODUCTS[node.target]
    if len(node.args) > len(params) or set(node.kwargs) - set(params):
        return None
    bound = {**dict(zip(params, node.args)), **node.kwargs}
    a, b, bias = bound.get(a_name), bound.get(b_name), bound.get(bias_name)
    return None if a is None or b is None else (a, b, bias)


def _fused_function(gm, node):
    """The fused function that computes product ``node`` (then ReLU) exactly, or None. Checked on the
    graph's values; where they are unknown (a plain fx trace), linear is still fused
    (``fused_linear_relu`` checks its tensors when it runs), matmul and addmm are not."""
    operands = _operands(node)
    if operands is None:
        return None
    a_val, b_val, bias_val = (_value(gm, n) for n in operands)
    linear = node.target in _LINEAR_FUNCTIONS
    known = a_val is not None and b_val is not None and (operands[2] is None or bias_val is not None)
    if not (linear or known) or why_not_fused(a_val, b_val, bias_val, linear=linear) is not None:
        return None
    return fused_linear_relu if linear else fused_matmul_relu


def _relu_module_hazard(gm, relu) -> Optional[str]:
    """For a ReLU module's node, why dropping the module could change the model (hooks, say)."""
    why = why_not_swapped(gm.get_submodule(relu.target)) if relu.op == "call_module" else None
    return None if why is None else f"its ReLU {why}"


def _module_fusable(gm, target, sites, called, filter_fn, skipped) -> bool:
    """Whether the Linear module ``target``, followed by a ReLU at each of ``sites``, may be fused."""
    layer = gm.get_submodule(target)
    why = _why_not_fusable(layer, None)
    if why is None and len(sites) != len(called[target]):
        why = "also called where no ReLU follows it"
    if why is None and any(target.startswith(f"{other}.") for other in called):
        why = "inside a module that the graph calls as a whole"
    for relu, prod in sites:
        x_val = _value(gm, prod.args[0] if prod.args else prod.kwargs.get("input"))
        if why is None and x_val is not None:
            why = why_not_fused(x_val, layer.weight, layer.bias, linear=True)
        why = why or _relu_module_hazard(gm, relu)
    return _decide(target, layer, why, filter_fn, skipped)


def fuse_relu_matmul(gm: torch.fx.GraphModule, filter_fn=None, skipped: Optional[Dict[str, str]] = None
                     ) -> List[str]:
    """Rewrite ``relu(linear(x))``, ``relu(a @ b)`` and ``relu(addmm(bias, a, b))`` into fuselab ops,
    in place, where the product has no other user and is computed exactly. Returns the names of
    what was fused; Linear modules left alone go into ``skipped`` with the reason.

    An nn.Linear submodule becomes a FusedLinearReLU of the same name (same state_dict keys);
    functional products become calls of ``fused_linear_relu``/``fused_matmul_relu``, which a
    saved GraphModule re-traces as calls when it is loaded. ``filter_fn(name, layer)`` sees each
    Linear module, and each functional product with ``layer`` None.
    """
    filter_fn = filter_fn or _accept_all
    skipped = {} if skipped is None else skipped
    graph = gm.graph
    called = {}  # module target -> its call_module nodes
    for node in graph.nodes:
        if node.op == "call_module":
            called.setdefault(node.target, []).append(node)
    module_sites, function_sites = {}, []  # target -> [(relu, product)]; [(relu, product, fn)]
    for relu in graph.nodes:
        prod = _relu_input(gm, relu)
        if prod is None or len(prod.users) != 1:
            continue
        if prod.op == "call_module" and _is_linear_layer(gm.get_submodule(prod.target)):
            module_sites.setdefault(prod.target, []).append((relu, prod))
        elif (fn := _fused_function(gm, prod)) is not None and _relu_module_hazard(gm, relu) is None:
            function_sites.append((relu, prod, fn))
    # Every decision before any change: filter_fn may raise, and the graph must then be as it was.
    modules = [target for target, sites in module_sites.items()
               if _module_fusable(gm, target, sites, called, filter_fn, skipped)]
    functions = [site for site in function_sites if filter_fn(site[1].name, None)]
    for target in modules:
        layer = gm.get_submodule(target)
        gm.set_submodule(target, _fused_layer(layer)(layer).train(layer.training))
        for relu, prod in module_sites[target]:
            relu.replace_all_uses_with(prod)
            graph.erase_node(relu)
    for relu, prod, fn in functions:
        # at the product, not the ReLU: a grad or autocast switch between them must see the fused call where the
        # product was (else a no_grad feature layer got gradients); operands read now: an earlier fusion may have
        # replaced one
        with graph.inserting_before(prod):
            fused = graph.call_function(fn, _operands(prod))
        fused.meta.update(relu.meta)
        fused.meta["is_wrapped"] = True  # the generated code torch.fx.wrap-s it: a re-trace keeps the call
        relu.replace_all_uses_with(fused)
        graph.erase_node(relu)
        graph.erase_node(prod)
    names = modules + [prod.name for _, prod, _ in functions]
    if names:
        graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return names


def fused_backend(inner: str = "inductor"):
    """A ``torch.compile`` backend: ``fuse_relu_matmul`` on the captured graph, then ``inner``.

    ``torch.compile(model, backend=fuselab.nn.fused_backend())``
    """

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fuse_relu_matmul(gm)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    return backend
