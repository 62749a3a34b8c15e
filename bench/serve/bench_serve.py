#!/usr/bin/env python3
"""Serving benchmark client for any OpenAI-compatible chat endpoint (ours, vLLM, SGLang).

Sends a workload (``datasets/workloads.py`` JSONL, or generated on the fly) by arrival time as
streamed ``/v1/chat/completions`` requests and reports TTFT, TPOT, ITL and E2E latency,
throughput, and SLO attainment / goodput, in the style of ``vllm bench serve``.

    python bench/serve/bench_serve.py --base-url http://127.0.0.1:8000 \\
        --workload long-video --scale 0.05 --num-requests 20 --request-rate 1 \\
        --max-concurrency 8 --goodput ttft:2000 tbt:100 --result-json serve.json

Other scripts import the pieces: ``sys.path.insert(0, "bench/serve")`` then
``from bench_serve import run_benchmark`` and ``from serve_metrics import compute_metrics`` (the records
and metrics live in ``serve_metrics.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import importlib.metadata
import json
import mimetypes
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "datasets") not in sys.path:
    sys.path.insert(0, str(ROOT / "datasets"))

import workload_config  # noqa: E402
from flashcodec._provenance import source_commit  # noqa: E402
import workload_jsonl  # noqa: E402
import workloads  # noqa: E402
from serve_metrics import RequestRecord, compute_metrics, format_metrics, parse_goodput  # noqa: E402

__all__ = ["fetch_model", "machine_info", "media_urls", "run_benchmark"]


# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------


def media_urls(requests: list[dict], mode: str = "file") -> dict[str, str]:
    """URL of every media path: ``file://PATH``, or a base64 ``data:`` URL (files read now).

    Raises FileNotFoundError in data mode when a file is missing here.
    """
    if mode not in ("file", "data"):
        raise ValueError(f"media url mode must be file or data, got {mode!r}")
    urls = {}
    for path in sorted({m["path"] for r in requests for m in r["media"]}):
        if mode == "file":
            urls[path] = Path(path).absolute().as_uri()
            continue
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--media-url-mode data: {path} not found on this machine")
        mime = mimetypes.guess_type(p.name)[0] or "application/octet-stream"
        urls[path] = f"data:{mime};base64," + base64.b64encode(p.read_bytes()).decode()
    return urls


def chat_messages(req: dict, urls: dict[str, str]) -> list[dict]:
    """One user message: the media parts in order, then the question; null options omitted."""
    content = []
    for m in req["media"]:
        if m["type"] == "video":
            part = {"url": urls[m["path"]]}
            part.update({k: m[k] for k in ("fps", "max_frames") if m.get(k) is not None})
            content.append({"type": "video_url", "video_url": part})
        else:
            content.append({"type": "image_url", "image_url": {"url": urls[m["path"]]}})
    content.append({"type": "text", "text": req["prompt"]})
    return [{"role": "user", "content": content}]


def _client(base_url: str, api_key: str | None, timeout_s: float):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "EMPTY",
                       max_retries=0, timeout=timeout_s)


def _error_text(e: Exception) -> str:
    status = getattr(e, "status_code", None)
    if status is None:
        return f"{type(e).__name__}: {e}"
    body = getattr(e, "body", None)  # openai unwraps {"error": {...}}; plain-text bodies stay str
    if isinstance(body, dict):
        msg = body.get("message") or body.get("detail") or json.dumps(body)
    else:
        msg = body or getattr(e, "message", None) or str(e)
    return f"HTTP {status}: {str(msg)[:500]}"


async def fetch_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id of ``GET {base_url}/v1/models``; RuntimeError when there is none."""
    client = _client(base_url, api_key, 30.0)
    try:
        page = await client.models.list()
        ids = [m.id for m in page.data]
    except Exception as e:
        raise RuntimeError(f"could not list models at {base_url}/v1/models ({_error_text(e)}); "
                           "is the server up? pass --model to skip this") from None
    finally:
        await client.close()
    if not ids:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return ids[0]


async def _send(client, model: str, req: dict, urls: dict, t0: float, rec: RequestRecord | None = None
                ) -> RequestRecord:
    rec = rec or RequestRecord(req["request_id"], scheduled_s=req["arrival_s"])
    rec.start_s = time.perf_counter() - t0
    pieces = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=chat_messages(req, urls), stream=True,
            stream_options={"include_usage": True}, max_tokens=req["output_len"], temperature=0,
            extra_body={"ignore_eos": req["ignore_eos"]})
        async for chunk in stream:
            now = time.perf_counter() - t0
            for choice in chunk.choices:
                text = choice.delta.content
                if text is None:
                    text = (choice.delta.model_extra or {}).get("reasoning_content")
                # a chunk carrying content counts as a token event even when the text is empty (a
                # token may decode to no visible text yet); the opening role chunk does not
                if text is not None and not (text == "" and (choice.delta.role or choice.finish_reason)):
                    rec.token_times_s.append(now)
                    pieces.append(text)
            if chunk.usage is not None:
                rec.completion_tokens = chunk.usage.completion_tokens
                rec.prompt_tokens = chunk.usage.prompt_tokens
        if not rec.token_times_s and not rec.completion_tokens:
            raise RuntimeError("the stream ended without any token")
        rec.completion_tokens = rec.completion_tokens or len(rec.token_times_s)
        rec.is_success = True
    except Exception as e:  # a failed request is a result, never the end of the run
        rec.error = _error_text(e)
    rec.end_s = time.perf_counter() - t0
    rec.output_text = "".join(pieces)
    return rec


#: the error of a request still running (or not yet sent) when ``run_benchmark``'s ``deadline_s`` came
CUT_ERROR = "cut: the run's time budget ended before this request finished"


async def run_benchmark(base_url: str, requests: list[dict], *, max_concurrency: int | None = None,
                        model: str | None = None, api_key: str | None = None, progress: bool = True,
                        media_url_mode: str = "file", timeout_s: float = 3600.0, deadline_s: float | None = None
                        ) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` (workload records) at their ``arrival_s`` and record each one.

    ``max_concurrency`` caps requests in flight (a request past its arrival waits for a slot);
    ``model=None`` takes the first id of ``/v1/models``. Media URLs are built before the clock
    starts. Returns ``(records in request order, duration_s)``: duration runs from the start to
    the last request's end. Request failures are recorded, never raised. ``deadline_s``: seconds
    after the start at which the run is cut (a device run's time limit): requests still running
    or not yet sent are cancelled and recorded as failed with :data:`CUT_ERROR` (what they had
    streamed is kept), and the duration ends at the cut.
    """
    model = model or await fetch_model(base_url, api_key)
    urls = media_urls(requests, media_url_mode)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    client = _client(base_url, api_key, timeout_s)
    records = [RequestRecord(r["request_id"], scheduled_s=r["arrival_s"]) for r in requests]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        req = requests[i]
        await asyncio.sleep(max(0.0, t0 + req["arrival_s"] - time.perf_counter()))
        if slots is None:
            await _send(client, model, req, urls, t0, records[i])
        else:
            async with slots:
                await _send(client, model, req, urls, t0, records[i])
        bar.update(1)

    try:
        # tasks start in arrival order so that the semaphore's FIFO queue follows arrivals
        order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"])
        tasks = [asyncio.create_task(one(i)) for i in order]
        timeout = None if deadline_s is None else max(0.0, t0 + deadline_s - time.perf_counter())
        _, running = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        duration_s = time.perf_counter() - t0
        if running:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for rec in records:
                if not rec.is_success and rec.error is None:  # still running, or never sent
                    rec.error, rec.end_s = CUT_ERROR, duration_s
                    rec.start_s = rec.start_s or duration_s
                    rec.completion_tokens = len(rec.token_times_s)
        else:
            for task in tasks:
                task.result()  # an error in the client itself (not a request's) is raised
    finally:
        bar.close()
        await client.close()
    return records, duration_s


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def machine_info() -> dict:
    """Platform, cores, Python, package versions (not imported), GPU names and the git commit."""
    versions = {}
    for name in ("openai", "numpy", "torch", "vllm", "sglang", "unifiedserve"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass

    def run(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT)
            return (out.stdout.strip() or None) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    gpus = run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "packages": versions,
            "gpus": gpus.splitlines() if gpus else [], "commit": source_commit()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_serve.py", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    p.add_argument("--workload-file", type=Path, default=None,
                   help="a datasets/workloads.py JSONL; the workload options then do not apply, and "
                        "--request-rate/--arrival/--burstiness (with --seed) replace its arrivals")
    workloads.add_workload_args(p)
    p.set_defaults(workload=None)
    workloads.add_arrival_args(p)
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--media-url-mode", choices=("file", "data"), default="file",
                   help="file:// paths (server on this machine) or base64 data: URLs")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs for goodput: ttft:MS (time to first token) and/or tbt:MS (p90 of TBTs)")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent (and checked) before the timed run, not recorded")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout (s)")
    p.add_argument("--result-json", type=Path, default=None, help="write metrics and per-request records")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p, p.parse_args(argv)


def load_requests(a: argparse.Namespace) -> tuple[list[dict], dict]:
    """The workload records and a description of where they came from."""
    given = {k: getattr(a, k) for k in ("request_rate", "arrival", "burstiness") if getattr(a, k) is not None}
    if a.workload_file is not None:
        if a.workload is not None:
            raise ValueError("give either --workload-file or --workload, not both")
        requests = workload_jsonl.read_workload(a.workload_file)
        if given:  # re-generate arrivals with the seed
            if "request_rate" not in given:
                raise ValueError("--arrival/--burstiness need --request-rate with --workload-file")
            cfg = workloads.config_from_args(a, workload="long-video")  # validates the arrival options
            requests = workload_config.with_arrivals(requests, cfg.request_rate, arrival=cfg.arrival,
                                                     burstiness=cfg.burstiness, seed=cfg.seed)
        return requests, {"file": str(a.workload_file), **given}
    if a.workload is None:
        raise ValueError("give --workload-file PATH or --workload NAME (see --help)")
    cfg = workloads.config_from_args(a)
    return workloads.build_workload(cfg, progress=not a.no_progress), dataclasses.asdict(cfg)


async def warm_up(base_url: str, requests: list[dict], num: int = 1, **kwargs) -> list[RequestRecord]:
    """Send ``num`` of ``requests`` one at a time, unmeasured (first-call costs stay out of the
    numbers) and return their records (the last one: a request served alone, warm); raises
    ``RuntimeError`` if one fails."""
    warm = [{**requests[i % len(requests)], "arrival_s": 0.0, "request_id": f"warmup-{i}"} for i in range(num)]
    recs, _ = await run_benchmark(base_url, warm, max_concurrency=1, progress=False, **kwargs)
    bad = [r for r in recs if not r.is_success]
    if bad:
        raise RuntimeError(f"warmup request failed: {bad[0].error}")
    return recs


async def _run(a, requests: list[dict]):
    model = a.model or await fetch_model(a.base_url, a.api_key)
    if a.num_warmups > 0:
        await warm_up(a.base_url, requests, a.num_warmups, model=model, api_key=a.api_key,
                      media_url_mode=a.media_url_mode, timeout_s=a.timeout)
    records, duration_s = await run_benchmark(
        a.base_url, requests, max_concurrency=a.max_concurrency, model=model, api_key=a.api_key,
        progress=not a.no_progress, media_url_mode=a.media_url_mode, timeout_s=a.timeout)
    return model, records, duration_s


def main(argv=None) -> int:
    p, a = parse_args(argv)
    try:
        slo = parse_goodput(a.goodput)
        if a.max_concurrency is not None and a.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
        requests, source = load_requests(a)
        if a.media_url_mode == "data":
            missing = [m["path"] for r in requests for m in r["media"] if not Path(m["path"]).is_file()]
            if missing:
                raise FileNotFoundError(f"--media-url-mode data: {missing[0]} not found on this machine")
        model, records, duration_s = asyncio.run(_run(a, requests))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    metrics = compute_metrics(records, duration_s, goodput=slo)
    print(format_metrics(metrics))
    for r in [r for r in records if not r.is_success][:5]:
        print(f"failed {r.request_id}: {r.error}")
    if a.result_json:
        info = machine_info()
        result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": a.base_url, "model": model,
                  "workload": source, "max_concurrency": a.max_concurrency, "media_url_mode": a.media_url_mode,
                  "metrics": metrics, "machine": info, "commit": info["commit"],
                  "requests": [r.to_dict() for r in records]}
        a.result_json.parent.mkdir(parents=True, exist_ok=True)
        a.result_json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {a.result_json}")
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
