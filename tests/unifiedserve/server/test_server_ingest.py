"""Streaming ingest end to end: a server that encodes video slices as they decode answers exactly as one
that waits for the whole video (``--ingest streaming`` vs ``--ingest whole``)."""

from __future__ import annotations

import signal

import openai
import pytest

import synthetic_video
from serve_helpers import Server, leftovers

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    video = synthetic_video.make_video(d / "gops.mp4", codec="h264", width=320, height=240, duration_s=12.0, fps=10.0,
                                       gop=10, seed=31)  # 24 frames at 2 fps, one per 5: 12 slices over 12 GOPs
    image = synthetic_video.make_image(d / "img.png", width=120, height=90, seed=32)
    return d, video, image


def answer(media, ingest: str) -> tuple[list, dict]:
    d, video, image = media
    server = Server("--ingest", ingest, "--vision-threads", "2", media_dir=d)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="demo-model", logprobs=True, messages=[{"role": "user", "content": [
            {"type": "text", "text": "First this."},
            {"type": "video_url", "video_url": {"url": f"file://{video}", "min_pixels": 3136, "max_pixels": 160 * 120}},
            {"type": "image_url", "image_url": {"url": f"file://{image}"}},
            {"type": "text", "text": "What happens?"}]}], **GREEDY)
        idle = server.wait_idle()
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert leftovers(server.instance) == []
    return [(t.token, round(t.logprob, 4)) for t in out.choices[0].logprobs.content], idle


def test_streaming_and_whole_ingest_answer_the_same(media):
    streamed, idle = answer(media, "streaming")
    whole, _ = answer(media, "whole")
    assert len(streamed) == 8 and streamed == whole
    assert idle.get("unifiedserve_pool_used{pool=\"patch_pages\"}", 0) == 0  # every patch page went back
