#!/usr/bin/env python3
"""Paged-buffer copy benchmark: native paged_scatter/paged_gather (csrc/) vs the torch reference.

For each shape (patch rows, dim 1176; visual tokens, dim 256; N rows; page size) it builds one
iteration's RaggedIndex over 4 requests that start mid-page on scattered pages, checks native ==
reference, then times both (warmup excluded, best of repeats; JSON also has medians) next to plain
contiguous copies of the same bytes, the memory-bandwidth floors: ``Tensor.copy_`` into existing
memory for scatter, ``Tensor.clone`` for gather (which allocates its output too). Prints a table with
ratios and writes JSON to bench/results/.

    python bench/kernels/bench_paged_copy.py            # N = 1k, 10k, 100k
    python bench/kernels/bench_paged_copy.py --quick    # N = 1k, 10k
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

from unifiedserve import ops  # noqa: E402
from unifiedserve.memory.pages import RaggedIndex  # noqa: E402
from unifiedserve.ops import RaggedIndexTensors, reference  # noqa: E402

DIMS = {"patch": 1176, "visual": 256}
NUM_REQUESTS = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only N = 1k and 10k")
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


def timed(fn, min_time: float) -> tuple[float, float]:
    """(best, median) seconds of fn() over repeats lasting about min_time, after two warmup calls.

    The table uses the best: on a shared machine the median mostly measures other people's load.
    """
    fn(), fn()
    samples, spent = [], 0.0
    while spent < min_time or len(samples) < 5:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
        if len(samples) >= 200:
            break
    return min(samples), statistics.median(samples)


def bench_cell(kind: str, num_rows: int, page_size: int, dtype: torch.dtype, min_time: float) -> dict:
    dim = DIMS[kind]
    index, num_pages = make_index(num_rows, page_size, seed=num_rows + page_size)
    ix = RaggedIndexTensors.from_index(index)
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(num_rows, dim, generator=gen).to(dtype)  # [N, dim]
    buffer = torch.zeros(num_pages, page_size, dim, dtype=dtype)  # [pages, page_size, dim]
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
    cases = {"copy": lambda: flat.copy_(src),  # scatter's floor: same bytes into existing memory
             "clone": lambda: src.clone(),  # gather's floor: it also allocates (and first-touches) its output
             "scatter_native": lambda: native.paged_scatter(buffer, src, *ix),
             "scatter_reference": lambda: reference.paged_scatter(buffer, src, ix),
             "gather_native": lambda: native.paged_gather(buffer, *ix),
             "gather_reference": lambda: reference.paged_gather(buffer, ix)}
    for name, fn in cases.items():
        row[f"{name}_s"], row[f"{name}_median_s"] = timed(fn, min_time)
    return row


def machine_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=5).stdout.strip()
        except Exception:
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "csrc", "unifiedserve/ops")),
            "native_build": ops.build_info()}


def print_table(rows: list[dict]) -> None:
    head = (f"{'kind':6} {'dim':>5} {'rows':>7} {'page':>4} {'MiB':>6} | {'scatter ms nat/ref':>19} {'x':>5} "
            f"{'floor':>6} | {'gather ms nat/ref':>19} {'x':>5} {'floor':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ms = {k: v * 1e3 for k, v in r.items() if k.endswith("_s")}  # best of repeats
        print(f"{r['kind']:6} {r['dim']:>5} {r['rows']:>7} {r['page_size']:>4} {r['mib']:>6.1f} | "
              f"{ms['scatter_native_s']:>9.3f}/{ms['scatter_reference_s']:<9.3f} "
              f"{r['scatter_reference_s'] / r['scatter_native_s']:>5.1f} {100 * r['copy_s'] / r['scatter_native_s']:>5.0f}% | "
              f"{ms['gather_native_s']:>9.3f}/{ms['gather_reference_s']:<9.3f} "
              f"{r['gather_reference_s'] / r['gather_native_s']:>5.1f} {100 * r['clone_s'] / r['gather_native_s']:>5.0f}%")
    print("best of repeats; x = reference / native; floor = contiguous copy_ (scatter) or clone (gather) time "
          "/ native time, 100% = memory-bandwidth floor")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not ops.native_available():
        print(f"native ops unavailable: {ops.build_info()['reason']}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rows = [bench_cell(kind, n, int(p), dtype, args.min_time)
            for kind in DIMS for p in args.page_sizes.split(",") for n in sizes]
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"paged-copy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                                "results": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
