#!/usr/bin/env python3
"""Media-affinity routing vs Ray Serve's default router, same replicas, same workload, same run.

Starts ``unifiedserve serve --ray --replicas N`` once per router (``--ray-router media-affinity``
and ``serve-default``, Serve's power of two choices), sends the multi-question workload
(``datasets/workloads.py``: several videos, k different questions each, Poisson arrivals) as
streamed chat completions, and prints per router the usual serving metrics, goodput under the
SLOs, the affinity (share of requests served by the replica that served most of their video's
questions) and the replicas used; then the goodput ratio.

    python bench/serve/bench_ray.py --num-requests 24 --questions-per-video 4 --num-videos 2 \\
        --request-rate 0.5 --output-len 16 --goodput ttft:3000 tbt:500 --result-json ray.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "serve"))

from bench_serve import _client, _error_text, chat_messages, machine_info, media_urls  # noqa: E402
from serve_metrics import RequestRecord, compute_metrics, format_metrics, parse_goodput  # noqa: E402
import workloads  # noqa: E402  (bench_serve put datasets/ on sys.path)
from server_process import ServerProcess, run_main  # noqa: E402

REPLICA_HEADER = "x-unifiedserve-replica"
ROUTERS = ("media-affinity", "serve-default")
#: small pools, as the server tests use: two replicas share this machine's memory
SMALL_POOLS = ["--kv-cache-gb", "0.25", "--patch-buffer-gb", "0.5", "--visual-buffer-gb", "0.125"]


async def send(client, model: str, req: dict, urls: dict, t0: float) -> tuple[RequestRecord, str | None]:
    """One streamed request; returns its record and the replica that served it (None on failure)."""
    rec = RequestRecord(req["request_id"], scheduled_s=req["arrival_s"])
    rec.start_s = time.perf_counter() - t0
    replica = None
    try:
        async with client.chat.completions.with_streaming_response.create(
                model=model, messages=chat_messages(req, urls), stream=True, stream_options={"include_usage": True},
                max_tokens=req["output_len"], temperature=0, extra_body={"ignore_eos": req["ignore_eos"]}) as resp:
            replica = resp.headers.get(REPLICA_HEADER)
            async for chunk in await resp.parse():
                now = time.perf_counter() - t0
                for choice in chunk.choices:
                    text = choice.delta.content
                    if text is not None and not (text == "" and (choice.delta.role or choice.finish_reason)):
                        rec.token_times_s.append(now)
                if chunk.usage is not None:
                    rec.completion_tokens, rec.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        if not rec.token_times_s:
            raise RuntimeError("the stream ended without any token")
        rec.completion_tokens = rec.completion_tokens or len(rec.token_times_s)
        rec.is_success = True
    except Exception as e:  # a failed request is a result
        rec.error = _error_text(e)
    rec.end_s = time.perf_counter() - t0
    return rec, replica


async def run(url: str, requests: list[dict]) -> tuple[list[RequestRecord], list[str | None], float]:
    urls = media_urls(requests)
    client = _client(url, None, 3600.0)
    try:
        model = (await client.models.list()).data[0].id
        t0 = time.perf_counter()

        async def one(req):
            await asyncio.sleep(max(0.0, t0 + req["arrival_s"] - time.perf_counter()))
            return await send(client, model, req, urls, t0)

        results = await asyncio.gather(*(one(r) for r in requests))
        duration_s = time.perf_counter() - t0
    finally:
        await client.close()
    return [r for r, _ in results], [rep for _, rep in results], duration_s


def affinity(requests: list[dict], replicas: list[str | None]) -> dict:
    """Share of served requests on their video's most used replica, and the replicas used."""
    by_video = collections.defaultdict(collections.Counter)
    for req, replica in zip(requests, replicas):
        if replica is not None and req["media"]:
            by_video[req["media"][0]["path"]][replica] += 1
    served = sum(sum(c.values()) for c in by_video.values())
    on_owner = sum(c.most_common(1)[0][1] for c in by_video.values())
    used = collections.Counter(r for r in replicas if r is not None)
    return {"affinity": on_owner / served if served else 0.0, "requests_per_replica": dict(used)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_ray.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    workloads.add_workload_args(p)
    workloads.add_arrival_args(p)
    p.set_defaults(workload="multi-question", num_requests=24, num_videos=2, output_len=16, request_rate=0.5)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=["ttft:3000", "tbt:500"],
                   help="SLOs for goodput (default ttft:3000 tbt:500)")
    p.add_argument("--server-args", default="", help="more `unifiedserve serve` flags, one string")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "bench_ray", help="server logs")
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    return p, p.parse_args(argv)


def main(argv=None) -> int:
    p, a = parse_args(argv)
    try:
        if a.workload != "multi-question":
            raise ValueError("bench_ray.py measures the multi-question workload; leave --workload out")
        if a.replicas < 2:
            raise ValueError(f"--replicas must be >= 2 to compare routers, got {a.replicas}")
        slo = parse_goodput(a.goodput)
        cfg = workloads.config_from_args(a)
        requests = workloads.build_workload(cfg, progress=not a.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    media_dir = str(Path(requests[0]["media"][0]["path"]).parent)
    results = {}
    for router in a.routers:
        server = ServerProcess(["--ray", "--replicas", str(a.replicas), "--ray-router", router,
                                "--allowed-local-media-path", media_dir, *SMALL_POOLS, *a.server_args.split()],
                               a.log_dir / f"{router}.log")
        try:
            # warm-up: one text question per replica's worth, not timed
            asyncio.run(run(server.url, [{**r, "media": [], "arrival_s": 0.0} for r in requests[:a.replicas]]))
            records, replicas, duration_s = asyncio.run(run(server.url, requests))
        finally:
            server.stop()
        metrics = compute_metrics(records, duration_s, goodput=slo)
        results[router] = {"metrics": metrics, **affinity(requests, replicas),
                           "requests": [{**r.to_dict(), "replica": rep} for r, rep in zip(records, replicas)]}
        print(f"\n[{router}]\n{format_metrics(metrics)}")
        print(f"affinity {results[router]['affinity']:.1%}; requests per replica "
              f"{results[router]['requests_per_replica']}")
    if set(ROUTERS) <= set(results):
        ours, theirs = (results[r]["metrics"]["goodput"]["requests_per_s"] for r in ROUTERS)
        ratio = ours / theirs if theirs else float("inf")
        print(f"\ngoodput media-affinity / serve-default: {ours:.3f} / {theirs:.3f} req/s = {ratio:.2f}x")
        results["goodput_ratio"] = ratio
    if a.result_json:
        info = machine_info()
        a.result_json.parent.mkdir(parents=True, exist_ok=True)
        a.result_json.write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "workload": vars(cfg),
                                             "replicas": a.replicas, "results": results, "machine": info,
                                             "commit": info["commit"]}, indent=1, default=str))
        print(f"wrote {a.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_ray.py"))
