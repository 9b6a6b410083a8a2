"""The cast fuselab's kernels store a float result through: to the output's dtype, rounded to nearest even.

Triton's interpreter (``TRITON_INTERPRET=1``, where the CPU tests run the kernels) casts fp32 to bf16 by
truncating, and mangles subnormals, where a GPU's ``cvt.rn`` rounds to nearest even: a bf16 result there
was off by up to an ulp, biased toward zero (a SparseAdamW step with a zero gradient moved bf16 weights).
Under the interpreter the bf16 cast is made on the bits instead; compiled, it is the plain cast (the
branch is a constexpr: the GPU's code is unchanged). SparseAdamW's, the distillation loss's and the 8-bit
GEMM's epilogue use it; the bf16 GEMM's will with its next GPU sweep (a tuned kernel's source is part of its
shipped configs' fingerprint: an edit there drops them until a sweep rewrites them).
"""
import triton
import triton.language as tl

from fuselab.kernels._runtime import INTERPRET

_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    # x (fp32) as dtype, rounded to nearest, ties to even
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        # bf16 is fp32's top half: add just under half of the dropped part's range, plus the kept part's
        # last bit (ties go to even), and carry; a NaN stays a (quiet) NaN
        rounded = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y  # one return: the GPU's triton (3.6) compiles past a return inside an if
