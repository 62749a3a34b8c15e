#!/usr/bin/env python3
"""`make serve`: start the server on the demo model, with a generated sample video to ask about.

Generates (once, cached under .cache/samples) a 60-second 640x360 H.264 clip, prints a curl and
an openai-client example that ask about it, then runs ``unifiedserve serve`` with file:// media
allowed under .cache/samples. Extra arguments go to ``unifiedserve serve``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "datasets"))

import synthetic_video  # noqa: E402

SAMPLE = dict(codec="h264", width=640, height=360, duration_s=60.0, fps=30.0, gop=250, bframes=3,
              suffix=".mp4", preset="veryfast", seed=0)


def main() -> int:
    samples = ROOT / ".cache" / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    clip = samples / "sample.mp4"
    if not clip.exists():
        print("[serve] generating a 60 s sample video ...", flush=True)
        clip.write_bytes(synthetic_video.cached_video(SAMPLE).read_bytes())
    port = "8000"
    args = sys.argv[1:]
    if "--port" in args:
        port = args[args.index("--port") + 1]
    print(f"""
[serve] sample video: {clip}
[serve] once the server says "serving", ask about it from another terminal:

  curl -N http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' -d '{{
    "messages": [{{"role": "user", "content": [
      {{"type": "video_url", "video_url": {{"url": "file://{clip}"}}}},
      {{"type": "text", "text": "What happens in this video?"}}]}}],
    "max_tokens": 32, "stream": true}}'

  (the demo model has random weights: expect fluent-looking gibberish, streamed)
""", flush=True)
    from unifiedserve.cli import main as cli

    return cli(["serve", "--allowed-local-media-path", str(samples), *args])


if __name__ == "__main__":
    sys.exit(main())
