#!/usr/bin/env python3
"""SM shares on one GPU: decode-shaped work beside prefill-shaped work, unpartitioned, in green contexts, under MPS.

UnifiedServe shares a GPU between its encode-prefill process and its decode process through MPS: each
process gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` when its context is made (``serve --decode-sm-percent``).
Green contexts (``torch.cuda.green_contexts``, CUDA >= 12.8 in torch) split SMs inside one process
instead. This measures both against running unpartitioned, on work of the model's MLP shapes (7B by
default: hidden 3584, intermediate 18944, bf16):

- **decode**: a step of ``--batch`` tokens through ``--layers`` MLP layers (up then down projection),
  waited for like a decode step (memory-bound: it reads every layer's weights);
- **prefill**: the same layers on a ``--chunk``-token chunk, back to back (compute-bound).

Modes, each in a fresh process (the parent never opens CUDA), both streams started together and run for
``--seconds`` after a warm-up:

- ``alone``: each stream by itself: the reference of every ratio;
- ``shared``: both at once in one process (two threads, a stream each), no partition: the hardware's
  own sharing;
- ``green:D``: decode in a green context of D SMs, prefill in one of the remaining SMs (two threads);
- ``mps:P``: two processes under a private MPS daemon (``launch/mps.sh``), decode with an active thread
  percentage of P, prefill with 100 - P (``serve --policy split``'s shares);
- ``unified:P``: the same pair, decode uncapped and prefill at 100 - P (``serve --policy unified
  --decode-sm-percent P``); ``unified:0``: neither capped;
- ``priority:P``: as ``unified:P``, prefill also a below-normal-priority MPS client (``CUDA_MPS_CLIENT_PRIORITY=1``,
  decode normal: ``serve --mps-priority``): while decode has work waiting, its thread blocks go first.

It prints, per mode, the decode step's p50 / p99 (ms, and x alone) and the prefill rate (TFLOP/s, and x
alone), and writes them as JSON.

    python bench/kernels/bench_sm_shares.py --quick --out bench/results/sm_shares.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MPS_SCRIPT = ROOT / "launch" / "mps.sh"

# name -> (hidden, intermediate): the MLP of each preset's language model
MODELS = {"demo": (256, 1344), "qwen2.5-vl-3b": (2048, 11008), "qwen2.5-vl-7b": (3584, 18944)}
SM_GRANULARITY = 8  # green contexts split SMs in groups (8 on Hopper); D and the rest are rounded down to it


#: the modes that run a pair of processes under a private MPS daemon
MPS_KINDS = ("mps", "unified", "priority")


def parse_mode(text: str) -> tuple[str, int | None]:
    """``"alone"``, ``"shared"``, ``"green:32"``, ``"mps:25"``, ``"unified:30"``, ``"priority:0"`` -> ``(kind,
    value)`` (ValueError when bad)."""
    kind, _, value = text.partition(":")
    if kind in ("alone", "shared") and not value:
        return kind, None
    if kind in ("green", *MPS_KINDS) and value.isdigit():
        number = int(value)
        if kind == "mps" and not 1 <= number <= 99:
            raise ValueError(f"mps:P needs a percentage in 1..99, got {text!r}")
        if kind in ("unified", "priority") and not 0 <= number <= 99:
            raise ValueError(f"{kind}:P needs a percentage in 0..99 (0: prefill uncapped), got {text!r}")
        if kind == "green" and number < SM_GRANULARITY:
            raise ValueError(f"green:D needs at least {SM_GRANULARITY} SMs, got {text!r}")
        return kind, number
    raise ValueError(f"a mode is alone, shared, green:SMS, mps:PERCENT, unified:PERCENT or priority:PERCENT, "
                     f"got {text!r}")


def mps_pair_env(kind: str, percent: int) -> tuple[dict[str, str], dict[str, str]]:
    """The decode and the prefill process's MPS settings for an MPS mode: the server's own placement
    (``runtime/gpu_placement.py``) of split (``mps``) or unified (``unified``; ``priority`` with ``--mps-priority``)
    on one GPU, core's for prefill, without the GPU ordinal."""
    if str(ROOT) not in sys.path:  # run as a script from anywhere
        sys.path.insert(0, str(ROOT))
    from unifiedserve.runtime.gpu_placement import plan_gpu_placement

    placement = plan_gpu_placement("split" if kind == "mps" else "unified", 1, decode_sm_percent=percent,
                                   mps_priority=kind == "priority")

    def settings(process: str) -> dict[str, str]:
        return {k: v for k, v in placement.env(process).items() if k != "CUDA_VISIBLE_DEVICES"}

    return settings("decode"), settings("core")


def green_split(total_sms: int, decode_sms: int) -> tuple[int, int]:
    """SMs of the decode and prefill green contexts: D and the rest, each a multiple of the granularity.

    Raises:
        ValueError: D leaves no group of SMs for prefill.
    """
    decode = decode_sms // SM_GRANULARITY * SM_GRANULARITY
    rest = (total_sms - decode) // SM_GRANULARITY * SM_GRANULARITY
    if decode < SM_GRANULARITY or rest < SM_GRANULARITY:
        raise ValueError(f"green:{decode_sms} leaves no {SM_GRANULARITY}-SM group for prefill on {total_sms} SMs")
    return decode, rest


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's); nan for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


# -- the work (runs in a worker process) -------------------------------------------------------------

class Work:
    """Weights and activations of both streams on ``device`` (``torch`` imported here, in the worker)."""

    def __init__(self, torch, device: str, model: str, layers: int, batch: int, chunk: int, dtype):
        hidden, inter = MODELS[model]
        self.torch, self.device, self.layers = torch, device, layers
        g = torch.Generator(device=device).manual_seed(0)  # drawn where they live: GBs of weights on a GPU
        scale = hidden ** -0.5

        def weight(rows, cols):
            return (torch.randn(rows, cols, generator=g, device=device) * scale).to(dtype)

        self.up = [weight(hidden, inter) for _ in range(layers)]  # [hidden, inter] each
        self.down = [weight(inter, hidden) for _ in range(layers)]  # [inter, hidden] each
        self.x_decode = weight(batch, hidden)  # [batch, hidden]
        self.x_prefill = weight(chunk, hidden)  # [chunk, hidden]
        self.prefill_flop = 2 * 2 * chunk * hidden * inter * layers  # one pass: two GEMMs a layer

    def mlp(self, x):
        for up, down in zip(self.up, self.down):
            x = (x @ up) @ down
        return x


def _timer(torch, device: str):
    """``(start(), stop() -> seconds)`` of one piece of work: CUDA events on CUDA, else the host clock."""
    if device.startswith("cuda"):
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def start():
            start_ev.record()

        def stop():
            end_ev.record()
            end_ev.synchronize()
            return start_ev.elapsed_time(end_ev) / 1000.0
        return start, stop
    box = []

    def start_host():
        box[:] = [time.perf_counter()]

    def stop_host():
        return time.perf_counter() - box[0]
    return start_host, stop_host


class FileBarrier:
    """A barrier between processes: each writes a file into ``folder`` and waits for ``parties`` of them."""

    def __init__(self, folder: str, parties: int, timeout: float = 120.0):
        self.folder, self.parties, self.timeout = Path(folder), parties, timeout

    def wait(self) -> None:
        (self.folder / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + self.timeout
        while len(list(self.folder.glob("ready-*"))) < self.parties:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other process was not ready within {self.timeout:.0f} s")
            time.sleep(0.005)


def run_decode(work: Work, seconds: float, warmup: int, go: threading.Barrier | None = None,
               green=None) -> dict:
    """Decode steps for ``seconds``: each step's time (waited for, as a decode loop waits for its tokens)."""
    torch = work.torch
    if green is not None:
        green.set_context()  # this thread's kernels run on the green context's SMs
    try:
        start, stop = _timer(torch, work.device)
        for _ in range(warmup):
            start()
            work.mlp(work.x_decode)
            stop()
        if go is not None:
            go.wait()
        steps = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start()
            work.mlp(work.x_decode)
            steps.append(stop())
        return {"steps": len(steps), "p50_ms": percentile(steps, 50) * 1e3, "p99_ms": percentile(steps, 99) * 1e3}
    finally:
        if green is not None:
            green.pop_context()


def run_prefill(work: Work, seconds: float, warmup: int, go: threading.Barrier | None = None,
                green=None) -> dict:
    """Prefill passes back to back for ``seconds`` (synchronized after each): TFLOP/s."""
    torch = work.torch
    # this thread's stream only: a device-wide synchronize would also wait for the decode thread's kernels
    sync = (lambda: torch.cuda.current_stream().synchronize()) if work.device.startswith("cuda") else (lambda: None)
    if green is not None:
        green.set_context()
    try:
        for _ in range(warmup):
            work.mlp(work.x_prefill)
        sync()
        if go is not None:
            go.wait()
        passes = 0
        started = time.perf_counter()
        end = started + seconds
        while time.perf_counter() < end:
            work.mlp(work.x_prefill)
            sync()
            passes += 1
        elapsed = time.perf_counter() - started
        return {"passes": passes, "tflops": passes * work.prefill_flop / elapsed / 1e12}
    finally:
        if green is not None:
            green.pop_context()


def run_together(work: Work, seconds: float, warmup: int, greens=(None, None)) -> dict:
    """Decode and prefill at once, one thread each, released together after their warm-ups."""
    go = threading.Barrier(2)
    results: dict = {}
    errors: list[BaseException] = []

    def thread(name, fn, green):
        try:
            if green is None and work.device.startswith("cuda"):
                # a stream of its own: both threads on the default stream would just take turns
                with work.torch.cuda.stream(work.torch.cuda.Stream(work.device)):
                    results[name] = fn(work, seconds, warmup, go, green)
            else:  # a green context makes its own stream current (torch's setContext)
                results[name] = fn(work, seconds, warmup, go, green)
        except BaseException as e:  # reported by the caller
            errors.append(e)
            go.abort()

    threads = [threading.Thread(target=thread, args=("decode", run_decode, greens[0])),
               threading.Thread(target=thread, args=("prefill", run_prefill, greens[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def worker(args) -> dict:
    """One measurement in this process: ``--worker decode|prefill|together`` (``--green D`` for green contexts)."""
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    work = Work(torch, args.device, args.model, args.layers, args.batch, args.chunk, dtype)
    info = {"device": args.device}
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(args.device)
        info.update(name=props.name, sms=props.multi_processor_count,
                    mps_percent=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                    mps_priority=os.environ.get("CUDA_MPS_CLIENT_PRIORITY"))
    go = FileBarrier(args.barrier, 2) if args.barrier else None  # the two processes of an MPS pair begin together
    if args.worker == "decode":
        return info | {"decode": run_decode(work, args.seconds, args.warmup, go)}
    if args.worker == "prefill":
        return info | {"prefill": run_prefill(work, args.seconds, args.warmup, go)}
    greens = (None, None)
    if args.green:
        from torch.cuda.green_contexts import GreenContext

        decode_sms, prefill_sms = green_split(info["sms"], args.green)
        index = torch.device(args.device).index or 0
        # keywords: torch 2.11 measured create(num_sms=, device_id=); from 2.12 they are keyword-only
        greens = (GreenContext.create(num_sms=decode_sms, device_id=index),
                  GreenContext.create(num_sms=prefill_sms, device_id=index))
        info |= {"green_sms": [decode_sms, prefill_sms]}
    return info | run_together(work, args.seconds, args.warmup, greens)


# -- the parent: one process per mode --------------------------------------------------------------

def spawn(args, role: str, extra: list[str] = (), env: dict | None = None, barrier: str | None = None):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--device", args.device, "--model",
           args.model, "--layers", str(args.layers), "--batch", str(args.batch), "--chunk", str(args.chunk),
           "--dtype", args.dtype, "--seconds", str(args.seconds), "--warmup", str(args.warmup), *extra]
    if barrier is not None:
        cmd += ["--barrier", barrier]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def collect(proc, what: str, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{what}: no result within {timeout:.0f} s") from None
    except BaseException:  # SIGTERM's SystemExit, ^C: the worker must not outlive this process on the GPU
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {err.strip().splitlines()[-1:] or ''}")
    return json.loads(out.strip().splitlines()[-1])


def measure(args, kind: str, value: int | None) -> dict:
    budget = args.seconds * 2 + 120  # start-up (torch, CUDA, weights), warm-up and the window
    if kind == "alone":
        decode = collect(spawn(args, "decode"), "alone (decode)", budget)
        prefill = collect(spawn(args, "prefill"), "alone (prefill)", budget)
        return decode | {"prefill": prefill["prefill"]}
    if kind == "shared":
        return collect(spawn(args, "together"), "shared", budget)
    if kind == "green":
        return collect(spawn(args, "together", ["--green", str(value)]), f"green:{value}", budget)
    return measure_mps(args, kind, value, budget)


def measure_mps(args, kind: str, percent: int, budget: float) -> dict:
    """An MPS mode's pair (:func:`mps_pair_env`) under a private MPS daemon, started and stopped here."""
    mode = f"{kind}:{percent}"
    decode_env, prefill_env = mps_pair_env(kind, percent)
    with tempfile.TemporaryDirectory(prefix="sm-shares-mps-") as folder:
        env = {"UNIFIEDSERVE_MPS_DIR": folder}
        started = subprocess.run(["bash", str(MPS_SCRIPT), "start"], env={**os.environ, **env}, capture_output=True,
                                 text=True, timeout=60)
        if started.returncode != 0:
            raise RuntimeError(f"{mode}: launch/mps.sh start failed: {started.stderr.strip()}")
        procs = []
        try:
            client = {"CUDA_MPS_PIPE_DIRECTORY": f"{folder}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{folder}/log"}
            barrier = tempfile.mkdtemp(dir=folder)  # both loaded and warm, then both measure
            decode = spawn(args, "decode", env=client | decode_env, barrier=barrier)
            prefill = spawn(args, "prefill", env=client | prefill_env, barrier=barrier)
            procs = [decode, prefill]
            result = collect(decode, f"{mode} (decode)", budget)
            result["prefill"] = collect(prefill, f"{mode} (prefill)", budget)["prefill"]
            shares = [decode_env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                      prefill_env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")]
            return result | {"mps_percent": [int(p) if p else None for p in shares],
                             "mps_priority": [decode_env.get("CUDA_MPS_CLIENT_PRIORITY"),
                                              prefill_env.get("CUDA_MPS_CLIENT_PRIORITY")]}
        finally:
            for proc in procs:  # one failed: the other must not outlive the daemon
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            subprocess.run(["bash", str(MPS_SCRIPT), "stop"], env={**os.environ, **env}, capture_output=True,
                           timeout=60)


def table(results: dict) -> str:
    """Markdown: each mode's decode step and prefill rate, with ratios to ``alone``."""
    alone = results.get("alone") or {}
    base_p50 = (alone.get("decode") or {}).get("p50_ms")
    base_tflops = (alone.get("prefill") or {}).get("tflops")
    lines = ["| mode | SMs or % (decode / prefill) | decode step p50 / p99 (ms) | x alone (p50) | prefill TFLOP/s "
             "| x alone |", "|---|---|---|---|---|---|"]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | - | {r['error']} | | | |")
            continue
        d, p = r.get("decode") or {}, r.get("prefill") or {}
        share = r.get("green_sms") or r.get("mps_percent")
        if share and "mps_percent" in r:
            share = " / ".join("all" if v is None else str(v) for v in share) + " %"
            if "1" in (r.get("mps_priority") or ()):
                share += ", prefill low priority"
        elif share:
            share = f"{share[0]} / {share[1]} SMs"
        else:
            share = "-"
        ratio_d = d["p50_ms"] / base_p50 if base_p50 else float("nan")
        ratio_p = p["tflops"] / base_tflops if base_tflops else float("nan")
        lines.append(f"| {mode} | {share} | {d['p50_ms']:.2f} / {d['p99_ms']:.2f} | {ratio_d:.2f} | "
                     f"{p['tflops']:.1f} | {ratio_p:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    p.add_argument("--model", default="qwen2.5-vl-7b", choices=list(MODELS), help="MLP shapes of this preset")
    p.add_argument("--layers", type=int, default=8, help="MLP layers a decode step and a prefill pass run (default 8)")
    p.add_argument("--batch", type=int, default=8, help="decode batch (default 8)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens (default 8192)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--modes", default=None, help="comma-separated: alone, shared, green:SMS, mps:PERCENT, "
                   "unified:PERCENT, priority:PERCENT (default alone,shared,green:16,green:32,green:48,mps:12,mps:25,"
                   "mps:36; --quick: alone,shared,green:32,mps:25); mps, unified and priority modes need "
                   "nvidia-cuda-mps-control")
    p.add_argument("--seconds", type=float, default=None, help="measured window per mode (default 3; --quick 2)")
    p.add_argument("--warmup", type=int, default=5, help="steps and passes before the window (default 5)")
    p.add_argument("--quick", action="store_true", help="fewer modes, shorter windows (the GPU check's setting)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sm_shares.json")
    p.add_argument("--worker", choices=["decode", "prefill", "together"], help=argparse.SUPPRESS)
    p.add_argument("--green", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 3.0
    for name in ("layers", "batch", "chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.seconds <= 0 or args.warmup < 0:
        p.error("--seconds must be positive and --warmup at least 0")
    modes = args.modes or ("alone,shared,green:32,mps:25" if args.quick else
                           "alone,shared,green:16,green:32,green:48,mps:12,mps:25,mps:36")
    try:
        args.modes = [(m, *parse_mode(m)) for m in modes.split(",")]
    except ValueError as e:
        p.error(str(e))
    if args.worker is None:
        if not args.device.startswith("cuda"):
            p.error(f"--device {args.device}: SM shares need a CUDA device")
        if "alone" not in [m for m, *_ in args.modes]:
            p.error("--modes must include alone (every ratio is to it)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return 0
    import shutil
    import signal

    # a time limit's SIGTERM (scripts/gpu_check.sh) unwinds: the MPS daemon and the workers are stopped in
    # measure_mps's finally, and the modes measured so far are already in the JSON
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out if args.out.suffix == ".json" else args.out / "sm_shares.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "green", "barrier", "out")}
    config["modes"] = [m for m, *_ in args.modes]
    results: dict = {}
    for mode, kind, value in args.modes:
        if kind in MPS_KINDS and shutil.which("nvidia-cuda-mps-control") is None:
            results[mode] = {"error": "skipped: nvidia-cuda-mps-control is not installed"}
        else:
            print(f"{mode} ...", flush=True)
            try:
                results[mode] = measure(args, kind, value)
            except (RuntimeError, ValueError, subprocess.SubprocessError) as e:
                results[mode] = {"error": str(e)}
                print(f"{mode}: {e}", file=sys.stderr)
        out.write_text(json.dumps({"config": config, "results": results}, indent=1, default=str))
    if "error" in results.get("alone", {}):
        print(f"bench_sm_shares.py: error: {results['alone']['error']}", file=sys.stderr)
        return 1
    print(f"\n{args.model} MLP x {args.layers} layers, decode batch {args.batch}, prefill chunk {args.chunk}, "
          f"{args.dtype}, {args.seconds:g} s per mode\n")
    print(table(results))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
