#!/usr/bin/env python3
"""Paged-buffer copy benchmark: native paged_scatter/paged_gather (csrc/) vs the torch reference.

For each shape (patch rows, dim 1176; visual tokens, dim 256; N rows; page size) it builds one
iteration's RaggedIndex over 4 requests that start mid-page on scattered pages, checks native ==
reference, then times both (warmup excluded, best of repeats; JSON also has medians) next to plain
contiguous copies of the same bytes, the memory-bandwidth floors: ``Tensor.copy_`` into existing
memory for scatter, ``Tensor.clone`` for gather (which allocates its output too). Prints a table with
ratios and writes JSON to bench/results/.

With ``--device cuda`` the buffer, rows and index live on the GPU and the native side is the CUDA kernel
(csrc/paged_copy_cuda.cu); each timed call ends with ``torch.cuda.synchronize()``, so a time is the
latency of one call, including the op's host copy of the index for validation (the reference syncs
too). The table then shows GB/s of payload moved (bytes read + bytes written) and the ratio.

    python bench/kernels/bench_paged_copy.py                 # N = 1k, 10k, 100k
    python bench/kernels/bench_paged_copy.py --quick         # N = 1k, 10k
    python bench/kernels/bench_paged_copy.py --device cuda   # CUDA kernel vs the torch reference
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashcodec._provenance import source_commit  # noqa: E402
from unifiedserve import ops  # noqa: E402
from unifiedserve.memory.pages import RaggedIndex  # noqa: E402
from unifiedserve.ops import RaggedIndexTensors, reference  # noqa: E402

DIMS = {"patch": 1176, "visual": 256}
NUM_REQUESTS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only N = 1k and 10k")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where buffer and rows live (default cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-sizes", default="16,256", help="comma-separated (default 16,256)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed runs per cell (default 0.3)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    return p.parse_args(argv)


def make_index(num_rows: int, page_size: int, seed: int) -> tuple[RaggedIndex, int]:
    """One iteration over NUM_REQUESTS requests of ~num_rows/NUM_REQUESTS rows, each starting mid-page."""
    rng = random.Random(seed)
    sizes = [num_rows // NUM_REQUESTS + (i < num_rows % NUM_REQUESTS) for i in range(NUM_REQUESTS)]
    starts = [rng.randrange(page_size * 8) for _ in sizes]
    needs = [-(-(cu % page_size + n) // page_size) for cu, n in zip(starts, sizes)]
    num_pages = sum(needs) + 64  # some slack: the pool is never exactly full
    pages = list(range(num_pages))
    rng.shuffle(pages)  # a fragmented pool: a request's pages are not adjacent
    spans, taken = [], 0
    for n, cu, need in zip(sizes, starts, needs):
        spans.append((n, cu, pages[taken:taken + need]))
        taken += need
    return RaggedIndex.build(spans, page_size), num_pages


def timed(fn, min_time: float, device: str = "cpu") -> tuple[float, float]:
    """(best, median) seconds of fn() over repeats lasting about min_time, after two warmup calls.

    The table uses the best: on a shared machine the median mostly measures other people's load. On
    CUDA every call is followed by a synchronize, so a sample is one call's full latency.
    """
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn(), fn()
    sync()
    samples, spent = [], 0.0
    while spent < min_time or len(samples) < 5:
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
        if len(samples) >= 200:
            break
    return min(samples), statistics.median(samples)


def bench_cell(kind: str, num_rows: int, page_size: int, dtype: torch.dtype, min_time: float,
               device: str = "cpu") -> dict:
    dim = DIMS[kind]
    index, num_pages = make_index(num_rows, page_size, seed=num_rows + page_size)
    ix = RaggedIndexTensors.from_index(index, device)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(num_rows, dim, generator=gen).to(dtype).to(device)  # [N, dim]
    buffer = torch.zeros(num_pages, page_size, dim, dtype=dtype, device=device)  # [pages, page_size, dim]
    check = buffer.clone()
    native = torch.ops.unifiedserve

    # correctness first
    native.paged_scatter(buffer, src, *ix)
    reference.paged_scatter(check, src, ix)
    assert torch.equal(buffer, check), f"native scatter differs from the reference for {kind} N={num_rows}"
    assert torch.equal(native.paged_gather(buffer, *ix), reference.paged_gather(check, ix)), "gather differs"
    del check

    flat = torch.empty_like(src)
    row = {"kind": kind, "dim": dim, "rows": num_rows, "page_size": page_size, "dtype": str(dtype).split(".")[-1],
           "mib": src.numel() * src.element_size() / 2**20}
    if device != "cpu":
        row["device"] = device
    cases = {"copy": lambda: flat.copy_(src),  # scatter's floor: same bytes into existing memory
             "clone": lambda: src.clone(),  # gather's floor: it also allocates (and first-touches) its output
             "scatter_native": lambda: native.paged_scatter(buffer, src, *ix),
             "scatter_reference": lambda: reference.paged_scatter(buffer, src, ix),
             "gather_native": lambda: native.paged_gather(buffer, *ix),
             "gather_reference": lambda: reference.paged_gather(buffer, ix)}
    for name, fn in cases.items():
        row[f"{name}_s"], row[f"{name}_median_s"] = timed(fn, min_time, device)
    if device != "cpu":  # payload read + written per call, over the best time
        moved = 2 * src.numel() * src.element_size()
        row.update({f"{name}_gbps": moved / row[f"{name}_s"] / 1e9 for name in cases})
    return row


def print_cuda_table(rows: list[dict]) -> None:
    head = (f"{'kind':6} {'dim':>5} {'rows':>7} {'page':>4} {'MiB':>6} | {'scatter GB/s nat/ref':>20} {'x':>5} | "
            f"{'gather GB/s nat/ref':>20} {'x':>5} | {'copy GB/s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kind']:6} {r['dim']:>5} {r['rows']:>7} {r['page_size']:>4} {r['mib']:>6.1f} | "
              f"{r['scatter_native_gbps']:>9.1f}/{r['scatter_reference_gbps']:<10.1f} "
              f"{r['scatter_reference_s'] / r['scatter_native_s']:>5.1f} | "
              f"{r['gather_native_gbps']:>9.1f}/{r['gather_reference_gbps']:<10.1f} "
              f"{r['gather_reference_s'] / r['gather_native_s']:>5.1f} | {r['copy_gbps']:>9.1f}")
    print("best of repeats, each call synchronized; GB/s = bytes read + written / time; x = reference / native "
          "time; copy = contiguous copy_ of the same bytes")


def machine_info(device: str = "cpu") -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=5).stdout.strip()
        except Exception:
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": source_commit(),
            "dirty": bool(git("status", "--porcelain", "--", "csrc", "unifiedserve/ops")),
            "native_build": ops.build_info(), **gpu_info(device)}


def gpu_info(device: str) -> dict:
    if device != "cuda":
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30, "cuda": torch.version.cuda}


def print_table(rows: list[dict]) -> None:
    head = (f"{'kind':6} {'dim':>5} {'rows':>7} {'page':>4} {'MiB':>6} | {'scatter ms nat/ref':>19} {'x':>5} "
            f"{'floor':>6} | {'gather ms nat/ref':>19} {'x':>5} {'floor':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ms = {k: v * 1e3 for k, v in r.items() if k.endswith("_s")}  # best of repeats
        print(f"{r['kind']:6} {r['dim']:>5} {r['rows']:>7} {r['page_size']:>4} {r['mib']:>6.1f} | "
              f"{ms['scatter_native_s']:>9.3f}/{ms['scatter_reference_s']:<9.3f} "
              f"{r['scatter_reference_s'] / r['scatter_native_s']:>5.1f} "
              f"{100 * r['copy_s'] / r['scatter_native_s']:>5.0f}% | "
              f"{ms['gather_native_s']:>9.3f}/{ms['gather_reference_s']:<9.3f} "
              f"{r['gather_reference_s'] / r['gather_native_s']:>5.1f} "
              f"{100 * r['clone_s'] / r['gather_native_s']:>5.0f}%")
    print("best of repeats; x = reference / native; floor = contiguous copy_ (scatter) or clone (gather) time "
          "/ native time, 100% = memory-bandwidth floor")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_paged_copy.py: error: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    if not ops.native_available():
        print(f"native ops unavailable: {ops.build_info()['reason']}", file=sys.stderr)
        return 1
    if args.device == "cuda" and not ops.build_info()["cuda"]:
        print(f"CUDA kernels unavailable: {ops.build_info()['cuda_reason']}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rows = [bench_cell(kind, n, int(p), dtype, args.min_time, args.device)
            for kind in DIMS for p in args.page_sizes.split(",") for n in sizes]
    (print_cuda_table if args.device == "cuda" else print_table)(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-cuda" if args.device == "cuda" else ""
    path = args.out / f"paged-copy{suffix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine_info(args.device), "args": vars(args) | {"out": str(args.out)},
                                "results": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
