"""Regenerate the README's results tables and the plots from the JSON under results/.

    python experiments/report.py
"""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuselab.report import RESULTS, markdown_table, update_readme_section  # noqa: E402


def load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def env_line(data):
    e = data["environment"]
    commits = list(dict.fromkeys(r["commit"] for r in data["rows"] if "commit" in r))  # runs merged into one file
    commit = f"commits {', '.join(commits)} (per row: `commit`)" if len(commits) > 1 else f"commit {e['git_commit']}"
    return f"_{e['gpu']}, torch {e['torch']}, triton {e['triton']}, CUDA {e['cuda']}, {commit}, {e['date']}._"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def matmul_relu_section(data):
    rows = data["rows"]
    cols = ["shape", "dtype", "fuselab", "fuselab (CUDA graph)", "torch relu(mm)", "x relu(mm)", "fuselab+bias",
            "cuBLASLt addmm+relu", "x cuBLASLt", "inductor max-autotune", "x inductor"]
    out = [env_line(data), "", "Forward, TFLOP/s (higher is better; `x` columns are fuselab / peer). "
           "`fuselab` and every peer are eager calls; `fuselab (CUDA graph)` replays the same launch from a "
           "graph, i.e. without Python's per-call host cost (measured apart: the host-overhead table below).", "",
           markdown_table(cols, [[r.get(c, "") for c in cols] for r in rows]), ""]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        sel = [r for r in rows if r["dtype"] == dtype]
        out.append(f"- {dtype}: geometric mean fuselab+bias / cuBLASLt = {geomean([r['x cuBLASLt'] for r in sel]):.2f}x "
                   f"over {len(sel)} shapes; fuselab / relu(mm) = {geomean([r['x relu(mm)'] for r in sel]):.2f}x")
    return "\n".join(out + forward_backward_table(data))


def forward_backward_table(data):
    fb = data.get("forward_backward", [])
    cols = ["shape", "dtype", "fuselab", "torch autograd", "x torch"]
    return ["", "Forward + backward with bias (3 GEMMs' FLOPs), TFLOP/s:", "",
            markdown_table(cols, [[r[c] for c in cols] for r in fb])] if fb else []


def cuda_section(data, sweep=None):
    from bench_matmul_relu import CUDA_COLUMNS
    from sweep_cuda_tiles import COLUMNS as SWEEP_COLUMNS

    tiled = ("`CUDA C++ tiled` is the mma.sync kernel and `wgmma` Hopper's, each pinned with FUSELAB_CUDA_KERNEL; "
             "the default, auto, takes wgmma at K >= 512 on at least half the SMs' worth of 128x256 tiles or at "
             "K >= 2048, mma.sync elsewhere"
             if any("CUDA C++ wgmma+bias" in r for r in data["rows"])
             else "measured before the wgmma kernel existed: `CUDA C++ tiled` is the mma.sync kernel")
    out = [env_line(data), "", "Forward with bias, TFLOP/s, eager calls, one run with every peer on the same inputs "
           f"({tiled}; fp32: tf32 for the tiled kernel, Triton and cuBLAS; the SIMT kernel is exact fp32, the naive "
           "kernel is the tutorial's):", "",
           markdown_table(CUDA_COLUMNS, [[r.get(c, "") for c in CUDA_COLUMNS] for r in data["rows"]])]
    out += forward_backward_table(data)
    if sweep:
        out += ["", f"Tile sweep of the bf16 mma.sync kernel, 4096^3 with bias (`experiments/sweep_cuda_tiles.py`; "
                f"cuBLAS `relu(a @ b)` timed in each variant's process). {env_line(sweep)}", "",
                markdown_table(SWEEP_COLUMNS, [[r.get(c, "") for c in SWEEP_COLUMNS] for r in sweep["rows"]])]
    return "\n".join(out)


def compile_section(data):
    from compile_speedup import COLUMNS, add_speedups, study_order

    data = {**data, "rows": study_order(add_speedups(data["rows"]))}  # this version's columns for older JSON
    cols = COLUMNS + ["commit"] if any("commit" in r for r in data["rows"]) else COLUMNS  # rows merged from runs
    return "\n".join([env_line(data), "", "Training = forward + backward + SGD step; ms/step is the mean of 20 steps "
                      "after 5 warm-up steps; `first call s` includes compilation; graph breaks as counted by "
                      "`torch._dynamo.explain` (blank for eager); `x stock, same mode` is the stock decoder's ms/step over "
                      "the row's (same task, precision and mode): above 1 the variant is faster:", "",
                      markdown_table(cols, [[r.get(k) if r.get(k) is not None else "" for k in cols]
                                            for r in data["rows"]])]
                     + [f"\nFailed: {f['model']} {f['task']} {f['precision']} {f['mode']} (commit {f['commit']}): "
                        f"`{f['error']}`" for f in data.get("failed", [])])


def plot_compile(data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["default", "reduce-overhead", "max-autotune"]
    speedup = {(r["model"], r["task"], r["precision"], r["mode"]): r["speedup vs eager"] for r in data["rows"]}
    groups = sorted({key[:3] for key in speedup if key[3] in modes and speedup[key]})
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(groups)), 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):  # one bar per compile mode in each (model, task, precision) group
        xs = [g + i * width for g, key in enumerate(groups) if speedup.get((*key, mode))]
        ax.bar(xs, [speedup[(*key, mode)] for key in groups if speedup.get((*key, mode))], width, label=mode,
               color=f"C{i}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels(["\n".join(key) for key in groups], fontsize=7)
    ax.set_ylabel("speedup vs eager (same model, task, precision)")
    ax.set_title(f"torch.compile on {data['environment']['gpu']} (no bar: not measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / "compile_speedup.png"
    fig.savefig(path, dpi=110)
    return path


def plot_matmul_relu(data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["dtype"] == "bf16"]
    provs = ["fuselab", "fuselab (CUDA graph)", "torch relu(mm)", "cuBLASLt addmm+relu"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(provs)
    for i, p in enumerate(provs):
        ax.bar([x + i * width for x in range(len(rows))], [r[p] for r in rows], width, label=p)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["shape"].split(" ")[-1] + ("\n" + r["shape"].split(" ")[0] if " " in r["shape"] else "")
                        for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16, M x N x K)")
    ax.set_title(f"relu(a @ b [+ bias]) on {data['environment']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / "matmul_relu_bf16.png"
    fig.savefig(path, dpi=110)
    return path


def sparse_section(data):
    rows = data["rows"]
    header = list(rows[0])
    out = [env_line(data), "", f"MovieLens-100k matrix factorisation ({data.get('data', '')}), "
           "dim 64, batch 1024, 90/10 split, same epochs for each:", "",
           markdown_table(header, [[r[k] for k in header] for r in rows])]
    tp = data.get("throughput")
    if tp:
        from sparse_embedding import THROUGHPUT_COLUMNS as header

        floor = next(r for r in tp if "floor bytes" in r)
        out += ["", "1,000,000 x 128 fp32 embedding, 65,536 random lookups a step (do_bench medians; `CUDA graph` "
                "columns replay the same step from a captured graph, without Python's host cost):", "",
                markdown_table(header, [[r.get(k, "") for k in header] for r in tp]), "",
                f"Floor of SparseAdamW's step: {floor['floor bytes'] / 1e6:.0f} MB moved (the 65,536 gradient rows and "
                f"their ids read once; p, m, v of the {floor['unique rows']} touched rows read and written once) at the "
                f"measured copy bandwidth of {floor['copy GB/s']:.0f} GB/s = {floor['floor ms'] * 1e3:.0f} us."]
    return "\n".join(out)


def host_section(data):
    cols = ["shape", "path", "fwd us", "fwd+bwd us"]
    engine = data["engine_thread"]
    return "\n".join([env_line(data), "", "Wall microseconds per eager call over 500 calls, bf16, `nn.Linear` layout "
                      "(`experiments/host_overhead.py`); at 256 tokens the GPU work is a few microseconds, so this is "
                      "host time; at 8192 tokens (OPT's fc1) the GPU's share shows:", "",
                      markdown_table(cols, [[r[c] for c in cols] for r in data["rows"]]), "",
                      f"The same pure-Python loop: {engine['python loop, main thread us']:.0f} us on the main thread, "
                      f"{engine['same loop inside a backward us']:.0f} us inside a backward (autograd's device "
                      f"thread), {engine['slowdown']:.2f}x."])


def mlp_section(data):
    rows = data["rows"]
    header = list(rows[0])
    note = ("On a CPU fuselab computes with PyTorch, so this shows that patching keeps accuracy, not speed."
            if "CPU" in data["environment"]["gpu"] else "")
    return "\n".join([env_line(data), "", markdown_table(header, [[r[k] for k in header] for r in rows]), "", note])


def main():
    data = load("matmul_relu_bench")
    if data:
        update_readme_section("matmul_relu", matmul_relu_section(data))
        print(f"plot: {plot_matmul_relu(data)}")
    data = load("matmul_relu_bench_cuda")
    if data:
        update_readme_section("matmul_relu_cuda", cuda_section(data, load("cuda_tiles_sweep")))
    data = load("host_overhead_cuda")
    if data:
        update_readme_section("host_overhead", host_section(data))
    data = load("compile_speedup_cuda")
    if data:
        update_readme_section("compile_speedup", compile_section(data))
        print(f"plot: {plot_compile(data)}")
    data = load("sparse_embedding_cuda") or load("sparse_embedding_cpu")
    if data:
        update_readme_section("sparse_embedding", sparse_section(data))
    data = load("mlp_cuda") or load("mlp_cpu")
    if data:
        update_readme_section("mlp", mlp_section(data))
    print("README.md tables regenerated from results/")


if __name__ == "__main__":
    main()
