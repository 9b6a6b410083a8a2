"""fuselab.quant: quantized Linear layers on fuselab's INT8 and FP8 GEMMs, calibration, distillation.

    report = quantize_(model, Int8DynamicActivationInt8WeightConfig())   # in place; print(report)

The GEMMs are ``torch.ops.fuselab.int8_matmul_epilogue`` and ``torch.ops.fuselab.fp8_matmul_epilogue``
(``int8_matmul``/``fp8_matmul``); conv nets on x86 CPUs take torchao's pt2e route (``quantize_pt2e_x86``).
"""
from fuselab.quant.config import (
           Float8RowwiseConfig,
           Int8DynamicActivationInt8WeightConfig,
           Int8StaticActivationInt8WeightConfig,
)
from fuselab.quant.distill import DistillationLoss
from fuselab.quant.fp8_gemm import fp8_matmul
from fuselab.quant.fused_distill import fused_distillation_loss  # noqa: F401  registers its ops
from fuselab.quant.int8_gemm import int8_matmul
from fuselab.quant.modules import Float8Linear, Int8Conv2d, Int8Linear
from fuselab.quant.norm_quant import QuantizedLayerNorm, QuantizedRows
from fuselab.quant.pt2e import quantize_pt2e_x86
from fuselab.quant.quantize import (
           Calibration,
           QuantizationReport,
           calibrate,
           quantize_,
           register_quantize_module_handler,
           relative_error,
)
from fuselab.quant.rowwise import quantize_fp8_rowwise, quantize_int8_rowwise, quantize_int8_static

__all__ = ["Calibration", "DistillationLoss", "Float8Linear", "Float8RowwiseConfig",
           "Int8Conv2d", "Int8DynamicActivationInt8WeightConfig", "Int8Linear", "Int8StaticActivationInt8WeightConfig",
           "QuantizationReport", "QuantizedLayerNorm", "QuantizedRows", "calibrate", "fp8_matmul", "int8_matmul",
           "quantize_", "quantize_fp8_rowwise", "quantize_int8_rowwise", "quantize_int8_static", "quantize_pt2e_x86",
           "register_quantize_module_handler", "relative_error"]
