#!/usr/bin/env python3
"""``n`` choices about one video: one request with ``n`` vs ``n`` separate requests sent at once.

What a client that wants several sampled answers (self-consistency, best-of) can do today: ask once
with ``n``, or send ``n`` requests with different seeds at the same time. With ``n``, the server adds
choices 1.. once choice 0 has its first token, so they find the prompt's KV blocks and the video's
tokens in the prefix and media caches; ``n`` separate requests all arrive before anything is cached,
so each decodes, encodes and prefills the whole video. Each trial uses two videos the server has never
seen (one per mode, the mode that goes first alternating), streams every answer, and records the first
choice's first token (TTFT), the time by which every choice has its first token, the time the last one
ends, and the engine work both modes caused (patch tokens encoded, prompt tokens prefilled, from the
server's ``/metrics``). Prints medians and the ratios separate / n.

    python bench/serve/bench_choices.py --n 4 --trials 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", HERE):
    sys.path.insert(0, str(extra))

import synthetic_video  # noqa: E402
from server_process import ServerProcess, engine_counters, run_main  # noqa: E402

QUESTION = "What happens in this video? Answer in one sentence."


def _messages(clip: Path) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{clip}"}},
                                         {"type": "text", "text": QUESTION}]}]


def _stream(url: str, body: dict, t0: float) -> dict[int, tuple[float, float]]:
    """POST a streamed request; per choice index: (its first token, its end), seconds after ``t0``."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    for chunk in client.chat.completions.create(model="demo-model", stream=True, **body):
        now = time.perf_counter() - t0
        for choice in chunk.choices:
            if choice.delta.content and choice.index not in first:
                first[choice.index] = now
            if choice.finish_reason is not None:
                end[choice.index] = now
    return {i: (first.get(i, end[i]), end[i]) for i in end}


def _work(server: ServerProcess) -> dict[str, float]:
    """Encode and prefill tokens the engine has run since start, over every process."""
    counters = engine_counters(server.metrics())
    return {kind: sum(p.get(f"{kind}_tokens", 0.0) for p in counters.values()) for kind in ("encode", "prefill")}


def trial(server: ServerProcess, mode: str, clip: Path, n: int, max_tokens: int, seed: int) -> dict:
    body = {"messages": _messages(clip), "max_tokens": max_tokens, "temperature": 1.0,
            "extra_body": {"ignore_eos": True}}
    before = _work(server)
    t0 = time.perf_counter()
    if mode == "n":
        times = _stream(server.url, {**body, "n": n, "seed": seed}, t0)
    else:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            parts = list(pool.map(lambda i: _stream(server.url, {**body, "seed": seed + i}, t0), range(n)))
        times = {i: part[0] for i, part in enumerate(parts)}
    after = _work(server)
    assert sorted(times) == list(range(n)), times
    return {"ttft_s": min(f for f, _ in times.values()), "all_first_s": max(f for f, _ in times.values()),
            "done_s": max(e for _, e in times.values()),
            **{f"{kind}_tokens": after[kind] - before[kind] for kind in ("encode", "prefill")}}


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=_count, default=4, help="choices per question (default 4)")
    p.add_argument("--trials", type=_count, default=3, help="questions per mode, each about a new video (default 3)")
    p.add_argument("--max-tokens", type=_count, default=32, help="tokens per choice (default 32)")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each generated 480x270 video (default 8)")
    p.add_argument("--server-args", default="", help="extra flags for unifiedserve serve, as one string")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "choices")
    a = p.parse_args(argv)
    if a.n < 2:
        p.error("--n must be at least 2 (one choice is the same request in both modes)")
    a.out.mkdir(parents=True, exist_ok=True)
    media = a.out / "media"
    media.mkdir(exist_ok=True)
    print(f"making {2 * a.trials} videos ({a.seconds:g} s, 480x270) ...", flush=True)
    clips = [synthetic_video.make_video(media / f"clip{i}.mp4", codec="h264", width=480, height=270,
                                        duration_s=a.seconds, fps=24.0, gop=48, seed=300 + i)
             for i in range(2 * a.trials)]
    server = ServerProcess(["--allowed-local-media-path", str(media), *a.server_args.split()], a.out / "server.log")
    runs: dict[str, list[dict]] = {"n": [], "separate": []}
    try:
        warm = synthetic_video.make_video(media / "warm.mp4", codec="h264", width=160, height=90, duration_s=2.0,
                                          fps=8.0, gop=8, seed=299)
        trial(server, "n", warm, 2, 4, 0)  # one unmeasured request: the server's first-use costs
        for t in range(a.trials):
            order = ("n", "separate") if t % 2 == 0 else ("separate", "n")
            for k, mode in enumerate(order):
                r = trial(server, mode, clips[2 * t + k], a.n, a.max_tokens, seed=1000 * t)
                runs[mode].append(r)
                print(f"trial {t} {mode:>8}: TTFT {r['ttft_s']:.2f} s, every choice's first token "
                      f"{r['all_first_s']:.2f} s, done {r['done_s']:.2f} s; encode {r['encode_tokens']:.0f} "
                      f"prefill {r['prefill_tokens']:.0f} tokens", flush=True)
    finally:
        server.stop()
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"\nmedians over {a.trials} trials, n={a.n}, {a.max_tokens} tokens per choice (separate / n):")
    for key, what in (("ttft_s", "first token (s)"), ("all_first_s", "every choice's first token (s)"),
                      ("done_s", "every choice done (s)"), ("encode_tokens", "patch tokens encoded"),
                      ("prefill_tokens", "prompt tokens prefilled")):
        n_value, sep = medians["n"][key], medians["separate"][key]
        ratio = f"{sep / n_value:.2f}x" if n_value else "-"
        print(f"  {what:>32}: n {n_value:9.2f}   separate {sep:9.2f}   {ratio}")
    (a.out / "bench_choices.json").write_text(json.dumps(
        {"n": a.n, "trials": a.trials, "max_tokens": a.max_tokens, "seconds": a.seconds, "medians": medians,
         "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_choices.py"))
