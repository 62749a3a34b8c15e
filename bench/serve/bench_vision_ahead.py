"""A queue of long videos against the decode-ahead bound (``serve --vision-ahead-gb``): peak memory and TTFT.

Several one-minute videos arrive at once at a server whose patch buffer holds only a few of them, so most
requests wait for admission. Without a bound the vision process decodes every waiting video ahead; with
one, at most that many bytes of patches are held ahead of admission. The same server and workload run
once per bound; the script prints the peak bytes held ahead (``unifiedserve_vision_ahead_bytes``), the
peak resident memory of the server's processes, the videos waiting at the peak, and TTFT, with each
bound's ratio to the first.

    python bench/serve/bench_vision_ahead.py --bounds 100 0.25
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ROOT, ServerProcess, run_main  # noqa: E402


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,rss=", "-A"], capture_output=True, text=True).stdout
    rows = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    tree, grew = {pid}, True
    while grew:
        grew = False
        for p, parent, _ in rows:
            if parent in tree and p not in tree:
                tree.add(p)
                grew = True
    return sum(rss for p, _, rss in rows if p in tree) * 1024


def gauge(metrics: dict[str, float], name: str) -> float:
    return next((v for k, v in metrics.items() if k.partition("{")[0] == name), 0.0)


def run_bound(bound: float, args, workload: Path, media: Path) -> dict:
    server = ServerProcess(["--device", "cpu", "--allowed-local-media-path", str(media),
                            "--vision-ahead-gb", str(bound), "--patch-buffer-gb", str(args.patch_buffer_gb),
                            "--no-prefix-caching", "--media-cache-gb", "0"],
                           args.out / f"server-{bound:g}.log")
    peak = {"rss": 0, "ahead": 0.0, "waiting": 0.0}
    idle = tree_rss(server.proc.pid)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], tree_rss(server.proc.pid))
            try:
                m = server.metrics()
            except OSError:
                m = {}
            peak["ahead"] = max(peak["ahead"], gauge(m, "unifiedserve_vision_ahead_bytes"))
            peak["waiting"] = max(peak["waiting"], gauge(m, "unifiedserve_vision_videos_waiting"))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = args.out / f"result-{bound:g}.json"
    try:
        subprocess.run([sys.executable, "bench/serve/bench_serve.py", "--base-url", server.url, "--workload-file",
                        str(workload), "--num-warmups", "0", "--no-progress", "--result-json", str(result)],
                       cwd=ROOT, check=True, capture_output=True, text=True)
    finally:
        done.set()
        sampler.join()
        server.stop()
    metrics = json.loads(result.read_text())["metrics"]
    return {"bound_gb": bound, "completed": metrics["completed"], "idle_rss_gib": idle / 2**30,
            "peak_rss_gib": peak["rss"] / 2**30, "peak_ahead_gib": peak["ahead"] / 2**30,
            "peak_videos_waiting": int(peak["waiting"]), "mean_ttft_s": metrics["ttft_ms"]["mean"] / 1000,
            "duration_s": metrics["duration_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bounds", type=float, nargs="+", default=[100.0, 0.25], metavar="GB",
                   help="--vision-ahead-gb values to run, the first the reference (default: 100 0.25)")
    p.add_argument("--num-videos", type=int, default=8, help="videos, one request each, all sent at once")
    p.add_argument("--video-seconds", type=float, default=60.0, help="each video's length")
    p.add_argument("--patch-buffer-gb", type=float, default=0.4,
                   help="the server's patch buffer: small, so that most requests wait (default %(default)g)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/vision_ahead")
    args = p.parse_args(argv)
    if any(not b > 0 for b in args.bounds) or args.num_videos < 1 or not args.video_seconds > 0:
        p.error("--bounds, --num-videos and --video-seconds must be positive")
    args.out.mkdir(parents=True, exist_ok=True)
    media, workload = args.out / "media", args.out / "workload.jsonl"
    secs = f"{args.video_seconds:g},{args.video_seconds:g}"
    subprocess.run([sys.executable, "datasets/workloads.py", "--workload", "long-video", "--video-seconds", secs,
                    "--scale", "0.375", "--num-videos", str(args.num_videos), "--num-requests", str(args.num_videos),
                    "--output-len", "4", "--request-rate", "inf", "--media-dir", str(media), "--out", str(workload),
                    "--no-progress"], cwd=ROOT, check=True)
    rows = []
    for bound in args.bounds:
        rows.append(run_bound(bound, args, workload, media))
        print(json.dumps(rows[-1]), flush=True)
    ref = rows[0]
    print(f"\n{args.num_videos} x {args.video_seconds:g}-s videos at once, patch buffer {args.patch_buffer_gb:g} GiB")
    print("| --vision-ahead-gb | peak held ahead (GiB) | videos waiting | peak RSS (GiB) | mean TTFT (s) | vs first |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bound_gb']:g} | {r['peak_ahead_gib']:.2f} | {r['peak_videos_waiting']} | "
              f"{r['peak_rss_gib']:.2f} | "
              f"{r['mean_ttft_s']:.1f} | RSS {r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}x, "
              f"TTFT {r['mean_ttft_s'] / ref['mean_ttft_s']:.2f}x |")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_vision_ahead.py"))
