"""CPU deployment of conv nets: static int8 through torchao's pt2e flow on ``torch.export``.

fuselab's quantized layers replace Linear layers; a conv net on an x86 CPU is better served by
PyTorch's own route: export the graph, let torchao's ``X86InductorQuantizer`` annotate it (int8
convolutions and linears, with their adds and pools), calibrate observers on real batches, convert
to quantize/dequantize pairs, and let ``torch.compile`` (inductor) lower those to oneDNN int8 kernels.
torchao is an optional dependency, imported when this runs.
"""
from typing import Iterable, Tuple

import torch
from torch import nn

from fuselab.nn.fuse import training_mode
from fuselab.quant.quantize import calibration_batches


def _torchao_pt2e():
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )
    except ImportError as e:
        raise ImportError("quantize_pt2e_x86 needs torchao's pt2e quantization (torchao.quantization.pt2e): "
                          f"install torchao built for torch {torch.__version__.split('+')[0]} "
                          f"(pip install torchao); importing it failed with: {e}") from e
    return prepare_pt2e, convert_pt2e, X86InductorQuantizer, get_default_x86_inductor_quantization_config


def quantize_pt2e_x86(model: nn.Module, example_inputs: Tuple, loader: Iterable, n_batches: int, *,
                      progress: bool = True) -> torch.fx.GraphModule:
    """``model`` exported with ``example_inputs``, int8-quantized statically for x86 CPUs by torchao's
    ``X86InductorQuantizer`` (its default config: per-channel weights, per-tensor activations),
    observers calibrated on ``n_batches`` batches of ``loader`` (batches as ``calibrate`` takes them).

    Returns the converted GraphModule (quantize/dequantize pairs around float ops, eval-mode semantics):
    run it as it is to check accuracy, and through ``torch.compile`` for the int8 kernels. The
    model itself is not changed. Raises ImportError naming torchao when it is missing, ValueError
    if the loader runs out first.
    """
    prepare_pt2e, convert_pt2e, X86InductorQuantizer, default_config = _torchao_pt2e()
    if not (isinstance(n_batches, int) and n_batches >= 1):
        raise ValueError(f"n_batches must be a positive int, got {n_batches!r}")
    # The batch dimension stays dynamic (the graph runs at any batch size); strict tracing gives a module
    # called twice (torchvision's BasicBlock ReLU) one node per call, which the quantizer's partitions need.
    batch = torch.export.Dim("batch")
    dynamic = tuple({0: batch} if isinstance(t, torch.Tensor) and t.dim() else None for t in example_inputs)
    with training_mode(model, False):
        graph = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic, strict=True).module()
    quantizer = X86InductorQuantizer()
    quantizer.set_global(default_config())
    prepared = prepare_pt2e(graph, quantizer)
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), None)
    with torch.no_grad():
        for args, kwargs in calibration_batches(loader, n_batches, device, "calibrating (pt2e)", progress):
            prepared(*args, **kwargs)
    return convert_pt2e(prepared)  # exported in eval mode: dropout and batch norm are frozen in the graph
