"""Autotune sweeps: ``python -m fuselab.tune``.

Times every config of every tuned fuselab kernel (``kernels.KERNELS``: the fused GEMM's forward and both
backward products, the quantized int8/fp8 GEMM) over a grid of shapes x dtypes x layouts (``grid``),
keeps the full table as JSON in experiments/harness.py's long format (``sweep``), and ships the best
config of each tuning key for this GPU in ``fuselab/kernels/configs/<gpu>.json``, which the runtime
reads before it times anything (``fuselab.kernels._autotune``).

    python -m fuselab.tune                            # the default grid -> runs/tune-<gpu>.json
    python -m fuselab.tune --resume --budget-min 7    # continue it, stopping after 7 minutes (then again)
    python -m fuselab.tune --resume --write-configs   # ship the best configs (times what is left first)
    python -m fuselab.tune --resume --retry-failed    # time again what failed (a resume skips it otherwise)
    python -m fuselab.tune --grid small               # a quick look: two shapes, bf16, forward and backward
    python -m fuselab.tune --grid my_grid.json        # blocks as in fuselab/tune/grid.py
    python -m fuselab.tune --dry-run                  # the tiny grid in the Triton interpreter (CPU, CI)
    python -m fuselab.tune --check-heldout            # shipped choice vs exhaustive best, unswept shapes
    python -m fuselab.tune --first-call               # a fresh process's first call, benchmark shapes
    python -m fuselab.tune --first-call --kernel scaled_gemm --dtypes int8,fp8   # the quantized GEMM's
    python -m fuselab.tune --plot runs/tune-NVIDIA_H200.json --plot-dir docs/results/tune

The default grid on one H200, estimated (not measured): 160 problems (30 of them the quantized GEMM's)
launch about 320 tuning keys; ~320 keys x ~13 pruned configs x ~0.05 s to time each (do_bench: 5
estimating calls, 5 ms of warmup, 25 ms of timed calls) is ~3 minutes, the ~340 cuBLAS baselines well
under one; plus ~300 compiles (one per config and kind of launch: dtype, layout, product, flags, sizes'
divisibility by 16) at ~1.5 s each, ~7 minutes in one process or ~1 minute over ``--jobs 8``: ~5 minutes
in all with the defaults, within the 15-minute target, split into calls by ``--budget-min`` and
``--resume``. A fresh machine compiles again (Triton's cache is per machine: point ``TRITON_CACHE_DIR``
somewhere that persists between calls).
"""
