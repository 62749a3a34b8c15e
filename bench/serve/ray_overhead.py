#!/usr/bin/env python3
"""What Ray Serve adds to one request: TTFT through ``serve --ray --replicas 1`` vs the plain server.

Same flags otherwise; each server gets, one at a time on an idle server, ``--text`` short text
requests and ``--videos`` first questions about videos it has never seen (no cache hits). Prints
the median TTFT of each kind on both, the difference and the ratio.

    python bench/serve/ray_overhead.py --text 20 --videos 4
"""

from __future__ import annotations

import argparse
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
    results = {}
    for mode, flags, batch in (("plain", [], clips[:a.videos]), ("ray", ["--ray", "--replicas", "1"], clips[a.videos:])):
        server = ServerProcess(["--allowed-local-media-path", str(media), *flags], a.out / f"server-{mode}.log")
        try:
            ttft(server.url, [{"role": "user", "content": "warm up"}])
            text = [ttft(server.url, [{"role": "user", "content": f"Say something about {i}."}])
                    for i in range(a.text)]
            video = [ttft(server.url, [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"file://{clip}"}},
                {"type": "text", "text": "What happens?"}]}]) for clip in batch]
        finally:
            server.stop()
        results[mode] = {"text": statistics.median(text), "video": statistics.median(video)}
    for kind in ("text", "video"):
        plain, ray = results["plain"][kind], results["ray"][kind]
        print(f"{kind:>6}: plain {plain * 1e3:8.1f} ms   ray {ray * 1e3:8.1f} ms   "
              f"+{(ray - plain) * 1e3:.1f} ms ({ray / plain:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
