#!/usr/bin/env python3
"""A chat's next turn about a video: its TTFT when the previous answer's KV blocks are cached.

Turn one asks about a video and gets an answer of N tokens; turn two sends the whole conversation
back (turn one's prompt, the answer, a new question) as a chat client does. The in-process engine
(demo model unless --model) serves turn two three ways, each a fresh engine that saw turn one:

  - ``answer cached``: prefix caching as shipped: the prompt's and the answer's full blocks are cached;
  - ``prompt only``: the same engine with the answer's blocks left out of the cache (what prefix
    caching did before generated tokens were cached, and what a cache keyed on prompts alone does);
  - ``no prefix cache``: ``enable_prefix_caching=False``: every turn prefills the whole conversation (the
    media cache, on as by default, still spares the video's encode).

Turn two is given as token ids (the answer as generated), so the demo model's answers, which do not
survive a detokenize/retokenize round trip, still exercise the cache as a real model's would.

    python bench/engine/bench_multiturn.py [--answer-tokens 64,256,1024] [--video-seconds 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "datasets"))

import synthetic_video  # noqa: E402

import flashcodec  # noqa: E402
from unifiedserve.engine.inputs import VisionInput  # noqa: E402
from unifiedserve.engine.llm import LLM, EngineConfig  # noqa: E402
from unifiedserve.engine.params import SamplingParams  # noqa: E402
from unifiedserve.model.presets import DEFAULT_DEMO_PATH  # noqa: E402

MODES = ("answer cached", "prompt only", "no prefix cache")


def _engine(model: str, mode: str) -> LLM:
    engine = LLM(model, EngineConfig(device="cpu", enable_prefix_caching=mode != "no prefix cache"))
    if mode == "prompt only":  # the answer's blocks are freed without joining the cache
        engine.scheduler._cache_outputs = lambda req, output_token_ids=None: None
    return engine


def run(model: str, video: VisionInput, answer_lens: list[int], repeats: int) -> dict:
    results = {}
    for mode in MODES:
        engine = _engine(model, mode)
        engine.generate([(engine.build_prompt([{"role": "user", "content": "Hello."}])[0], [],
                          SamplingParams(max_tokens=2))])  # warm-up: thread pools, first-call costs
        rows = []
        for n in answer_lens:
            ttfts, hits = [], []
            for r in range(repeats):  # each repeat its own conversation (another first question)
                ids, vision = engine.build_prompt([{"role": "user", "content": [
                    {"type": "video", "vision": video}, {"type": "text", "text": f"Question {n}.{r}: what happens?"}]}])
                answer = engine.generate([(ids, vision, SamplingParams(max_tokens=n, ignore_eos=True))])[0].token_ids
                follow = engine.build_prompt([{"role": "user", "content": f"And after that? ({n}.{r})"}])[0]
                turn_two = [*ids, *answer, *follow[-12:]]  # the new user turn's tokens close the conversation
                before = engine.scheduler.prefix_hit_tokens
                start = time.perf_counter()
                engine.generate([(turn_two, vision, SamplingParams(max_tokens=1))])
                ttfts.append(time.perf_counter() - start)
                hits.append(engine.scheduler.prefix_hit_tokens - before)
            rows.append({"answer_tokens": n, "turn_two_tokens": len(turn_two), "ttft_s": statistics.median(ttfts),
                         "ttfts_s": ttfts, "cached_tokens": statistics.median(hits)})
            print(f"{mode:>13}  answer {n:5d} tokens: turn two ({len(turn_two)} tokens) TTFT "
                  f"{statistics.median(ttfts) * 1e3:8.1f} ms, {statistics.median(hits):.0f} tokens from the cache",
                  flush=True)
        results[mode] = rows
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_DEMO_PATH))
    p.add_argument("--answer-tokens", default="64,256,1024", help="turn one's answer lengths (comma-separated)")
    p.add_argument("--video-seconds", type=float, default=60.0, help="the 480x270 video's length (sampled at 2 fps)")
    p.add_argument("--repeats", type=int, default=3, help="conversations per answer length (median)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    a = p.parse_args(argv)
    try:
        answer_lens = [int(x) for x in a.answer_tokens.split(",")]
        if any(n < 1 for n in answer_lens) or a.repeats < 1 or a.video_seconds <= 0:
            raise ValueError
    except ValueError:
        p.error("--answer-tokens takes positive integers, --repeats and --video-seconds positive values")
    if a.model == str(DEFAULT_DEMO_PATH) and not (DEFAULT_DEMO_PATH.expanduser() / "config.json").exists():
        from unifiedserve.model.demo import write_demo_model
        write_demo_model(DEFAULT_DEMO_PATH)
    with tempfile.TemporaryDirectory() as tmp:
        clip = synthetic_video.make_video(Path(tmp) / "clip.mp4", codec="h264", width=480, height=270,
                                          duration_s=a.video_seconds, fps=24.0, gop=48, seed=7)
        video = VisionInput.from_video(flashcodec.decode_video(clip, output="patches"))
    print(f"video: {a.video_seconds:g} s 480x270, {video.num_visual_tokens(2)} visual tokens; block size "
          f"{EngineConfig().block_size}", flush=True)
    results = run(a.model, video, answer_lens, a.repeats)
    print("\nturn-two TTFT, ratio to 'answer cached':")
    for i, n in enumerate(answer_lens):
        base = results["answer cached"][i]["ttft_s"]
        print(f"  answer {n:5d} tokens: " + ", ".join(
            f"{m} {results[m][i]['ttft_s'] * 1e3:.1f} ms ({results[m][i]['ttft_s'] / base:.2f}x)" for m in MODES))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
