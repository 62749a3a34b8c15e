"""Prefix cache and media cache through the whole server: follow-up questions skip the video's decode,
encode and prefill, give the tokens a server without caches gives, and a changed file is re-read."""

from __future__ import annotations

import os
import shutil
import signal

import openai
import pytest

import synthetic_video
from serve_helpers import Server, tiny_clip

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    return d, tiny_clip(d)


@pytest.fixture(scope="module")
def servers(media):
    d, _ = media
    cached, plain = Server(media_dir=d), Server("--no-prefix-caching", "--media-cache-gb", "0", media_dir=d)
    yield cached, plain
    for srv in (cached, plain):
        assert srv.stop(signal.SIGTERM) == 0, srv.log()


def _ask(server, path, question, video_first=True, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [{"type": "video_url", "video_url": {"url": f"file://{path}"}}, {"type": "text", "text": question}]
    messages = [{"role": "user", "content": parts if video_first else parts[::-1]}]
    return client.chat.completions.create(model="demo-model", messages=messages, **GREEDY, **kw)


def _cache(server, name):
    m = server.metrics()
    return m[f"unifiedserve_{name}_cache_hits_tokens"], m[f"unifiedserve_{name}_cache_queries_tokens"]


QUESTIONS = [("What happens in this video?", True), ("What colour is the background?", True),
             ("What happens in this video?", True), ("Count the moving objects.", False)]


def test_follow_ups_hit_the_caches_and_match_a_server_without_them(servers, media):
    cached, plain = servers
    _, clip = media
    for n, (question, video_first) in enumerate(QUESTIONS):
        prefix_before, _ = _cache(cached, "prefix")
        media_before, _ = _cache(cached, "media")
        a = _ask(cached, clip, question, video_first)
        b = _ask(plain, clip, question, video_first)
        assert a.choices[0].message.content == b.choices[0].message.content, f"question {n}"
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        cached.wait_idle()
        prefix_hit = _cache(cached, "prefix")[0] - prefix_before
        media_hit = _cache(cached, "media")[0] - media_before
        if n == 0:
            assert prefix_hit == 0 and media_hit == 0
        elif video_first:
            assert prefix_hit > a.usage.prompt_tokens // 2  # the video's blocks come from the prefix cache
        else:
            assert media_hit > 0  # question first: other prefix, the media cache spares decode and encode
    assert _cache(plain, "prefix")[0] == 0 and _cache(plain, "media")[0] == 0
    m = cached.wait_idle()
    assert 0 < m["unifiedserve_prefix_cache_hit_rate"] < 1 and m["unifiedserve_media_cache_bytes"] > 0


def test_a_file_changed_on_disk_is_not_served_from_the_cache(servers, media):
    cached, _ = servers
    d, clip = media
    path = d / "changing.mp4"
    shutil.copy(clip, path)
    _ask(cached, path, "What is this?")
    cached.wait_idle()
    # same name, other content: a new key, so nothing of the old entries may be used
    other = synthetic_video.make_video(d / "other.mp4", codec="h264", width=320, height=240, duration_s=4.0,
                                       fps=10.0, gop=10, seed=7)
    os.replace(other, path)
    prefix_before, _ = _cache(cached, "prefix")
    media_before, _ = _cache(cached, "media")
    fresh = _ask(cached, path, "What is this?")
    cached.wait_idle()
    assert _cache(cached, "media")[0] == media_before
    # only the template's text before the video may come from the prefix cache
    assert _cache(cached, "prefix")[0] - prefix_before < fresh.usage.prompt_tokens // 4
