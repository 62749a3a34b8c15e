#!/usr/bin/env python3
"""What Ray Serve adds to one request: TTFT through ``serve --ray --replicas 1`` vs the plain server.

Same flags otherwise; each server gets, one at a time on an idle server, ``--text`` short text
requests and ``--videos`` first questions about videos it has never seen (no cache hits). Prints
the median TTFT of each kind on both, the difference and the ratio, and where the time went: the
API's own TTFT (its ``/metrics``, from the request's arrival in the API to its first token) and
its stage means, so ``client - API`` is what the HTTP path in front of the API costs (for Ray: the
Serve proxy, the ingress, the handle call and the chunk relay). The machine's load average is
printed with each server's run: on a shared machine, compare runs only at similar loads.

    python bench/serve/ray_overhead.py --text 20 --videos 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", HERE):
    sys.path.insert(0, str(extra))

import synthetic_video  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def ttft(url: str, messages: list[dict]) -> float:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="demo-model", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
    return first


STAGES = ("probe", "video_decode", "queue", "encode", "prefill")


def api_sums(server: ServerProcess) -> dict[str, float]:
    """Sums and counts of the API's TTFT and stage histograms, over every replica."""
    out: dict[str, float] = {}
    for key, value in server.metrics().items():
        name, _, labels = key.partition("{")
        base, _, field = name.rpartition("_")
        if field not in ("sum", "count"):
            continue
        if base == "unifiedserve_time_to_first_token_seconds":
            out[field] = out.get(field, 0.0) + value
        elif base == "unifiedserve_request_stage_seconds":
            stage = labels.split('stage="', 1)[1].split('"', 1)[0]
            out[f"{stage}.{field}"] = out.get(f"{stage}.{field}", 0.0) + value
    return out


def api_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean API TTFT and stage times (ms) of the requests served between two ``api_sums``."""
    def mean(prefix: str) -> float:
        n = after.get(prefix + "count", 0.0) - before.get(prefix + "count", 0.0)
        return (after.get(prefix + "sum", 0.0) - before.get(prefix + "sum", 0.0)) / n * 1e3 if n else float("nan")

    return {"ttft": mean(""), **{stage: mean(stage + ".") for stage in STAGES}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=int, default=20, help="text requests per server (default 20)")
    p.add_argument("--videos", type=int, default=4, help="first questions about new videos per server (default 4)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ray_overhead")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    media = a.out / "media"
    media.mkdir(exist_ok=True)
    clips = [synthetic_video.make_video(media / f"clip{i}.mp4", codec="h264", width=480, height=270, duration_s=8.0,
                                       fps=24.0, gop=48, seed=100 + i) for i in range(2 * a.videos)]
    results, breakdown, loads = {}, {}, {}
    for mode, flags, batch in (("plain", [], clips[:a.videos]), ("ray", ["--ray", "--replicas", "1"], clips[a.videos:])):
        server = ServerProcess(["--allowed-local-media-path", str(media), *flags], a.out / f"server-{mode}.log")
        try:
            ttft(server.url, [{"role": "user", "content": "warm up"}])
            load_before = os.getloadavg()[0]
            s0 = api_sums(server)
            text = [ttft(server.url, [{"role": "user", "content": f"Say something about {i}."}])
                    for i in range(a.text)]
            s1 = api_sums(server)
            video = [ttft(server.url, [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"file://{clip}"}},
                {"type": "text", "text": "What happens?"}]}]) for clip in batch]
            s2 = api_sums(server)
            loads[mode] = (load_before, os.getloadavg()[0])
        finally:
            server.stop()
        results[mode] = {"text": statistics.median(text), "video": statistics.median(video)}
        breakdown[mode] = {"text": {"client_mean": statistics.mean(text) * 1e3, **api_means_ms(s0, s1)},
                           "video": {"client_mean": statistics.mean(video) * 1e3, **api_means_ms(s1, s2)}}
    for kind in ("text", "video"):
        plain, ray = results["plain"][kind], results["ray"][kind]
        print(f"{kind:>6}: plain {plain * 1e3:8.1f} ms   ray {ray * 1e3:8.1f} ms   "
              f"+{(ray - plain) * 1e3:.1f} ms ({ray / plain:.2f}x)")
    print("means (ms): client TTFT | the API's TTFT | client - API | API stages " + " / ".join(STAGES))
    for kind in ("text", "video"):
        for mode in ("plain", "ray"):
            b = breakdown[mode][kind]
            print(f"{kind:>6} {mode:>5}: {b['client_mean']:8.1f} | {b['ttft']:8.1f} | "
                  f"{b['client_mean'] - b['ttft']:6.1f} | " + " / ".join(f"{b[stage]:.1f}" for stage in STAGES))
    print("load average (1 min) before/after the timed requests: "
          + ", ".join(f"{mode} {lo:.2f}/{hi:.2f}" for mode, (lo, hi) in loads.items()))
    (a.out / "ray_overhead.json").write_text(json.dumps(
        {"median_ttft_s": results, "means_ms": breakdown, "load_average": loads, "text": a.text, "videos": a.videos},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
