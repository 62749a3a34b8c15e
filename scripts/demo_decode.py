#!/usr/bin/env python3
"""`make serve`'s job until the server exists: decode a generated sample video with flashcodec.

Generates (once, cached) a 60-second 640x360 H.264 sample clip, probes it, and decodes the frames
Qwen2.5-VL would sample, printing what came back.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "datasets"))

import synthetic_video  # noqa: E402

from flashcodec.cli import main  # noqa: E402

SAMPLE = dict(codec="h264", width=640, height=360, duration_s=60.0, fps=30.0, gop=250, bframes=3,
              suffix=".mp4", preset="veryfast", seed=0)


def run() -> int:
    print("[demo] the UnifiedServe server is not built yet; running flashcodec on a sample video instead")
    clip = synthetic_video.cached_video(SAMPLE)
    print(f"[demo] sample video: {clip}\n")
    print(f"$ flashcodec probe {clip.name}")
    if main(["probe", str(clip)]):
        return 1
    out = ROOT / ".cache" / "demo_frames.npy"
    out.parent.mkdir(exist_ok=True)
    print(f"\n$ flashcodec decode {clip.name} --out {out.relative_to(ROOT)}")
    return main(["decode", str(clip), "--out", str(out)])


if __name__ == "__main__":
    sys.exit(run())
