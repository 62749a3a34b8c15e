"""Rejected and aborted video requests stop decoding: the next request does not wait behind them."""

from __future__ import annotations

import time

import pytest
import synthetic_video

from serve_helpers import Server, http, tiny_clip

pytestmark = pytest.mark.slow

NUM_REJECTED = 6


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("cancel")
    tiny_clip(d)
    # 60 s of 640x360 with 10-s GOPs: several seconds of decoding on one decoder thread
    synthetic_video.make_video(d / "long.mp4", codec="h264", width=640, height=360, duration_s=60.0, fps=25.0,
                               gop=250, seed=3)
    return d


def _ask(url, video, max_tokens=1):
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{video}"}},
                                                      {"type": "text", "text": "?"}]}],
            "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    status, reply = http("POST", url + "/v1/chat/completions", body, timeout=120)
    return status, reply, time.perf_counter() - started


def test_rejected_long_videos_do_not_delay_the_next_request(media):
    # one decoder thread and a context too short for the long video: it is rejected right after its probe,
    # while its decode has already started
    srv = Server("--vision-threads", "1", "--max-model-len", "2048", media_dir=media)
    try:
        idle = min(_ask(srv.url, media / "clip.mp4")[2] for _ in range(3))
        for _ in range(NUM_REJECTED):
            status, reply, _ = _ask(srv.url, media / "long.mp4")
            assert status == 400 and "maximum context length" in reply["error"]["message"], reply
        status, _, after = _ask(srv.url, media / "clip.mp4")
        assert status == 200
        print(f"\nshort video: {idle:.2f} s idle, {after:.2f} s after {NUM_REJECTED} rejected long videos")
        assert after <= 2 * idle + 0.25, f"{after:.2f} s after the rejections vs {idle:.2f} s idle"
        srv.wait_idle(timeout=30)
    finally:
        assert srv.stop() == 0
