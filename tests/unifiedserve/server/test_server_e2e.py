"""The whole server (api, vision, core, decode processes) through the official openai client. Sampling options
(penalties, n choices, stops, min_tokens) against the engine: test_server_sampling.py."""

from __future__ import annotations

import base64
import concurrent.futures
import http.client as httplib
import json
import os
import re
import signal
import time

import pytest

import synthetic_video
from serve_helpers import QUESTION, Server, alive, http, leftovers, tiny_clip, video_message
from unifiedserve.runtime.launcher import UNIFIED_NICE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    files = {
        "video": tiny_clip(d),
        "video2": synthetic_video.make_video(d / "clip2.mkv", codec="hevc", width=192, height=144, duration_s=3.0,
                                             fps=8.0, gop=8, seed=2),
        "image": synthetic_video.make_image(d / "img.png", width=200, height=150, seed=3),
    }
    synthetic_video.corrupt_middle(files["video"], d / "corrupt.mp4", seed=4)
    (d / "notavideo.mp4").write_bytes(b"this is not a video at all" * 100)
    outside = tmp_path_factory.mktemp("outside")
    files["outside"] = synthetic_video.make_image(outside / "secret.png", seed=5)
    (d / "escape.png").symlink_to(files["outside"])
    return d, files


@pytest.fixture(scope="module")
def server(media):
    d, _ = media
    srv = Server(media_dir=d)
    yield srv
    pids = srv.pids()
    code = srv.stop(signal.SIGTERM)
    assert code == 0, srv.log()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "orphan processes after SIGTERM"
    assert leftovers(srv.instance) == []


def image_message(path, question="Describe the image."):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}},
                                         {"type": "text", "text": question}]}]


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_health_openapi(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-model"]
    status, body = http("GET", server.url + "/health")
    assert status == 200 and body["status"] == "ok" and body["policy"] == "unified"
    assert set(body["workers"]) == {"vision", "core", "decode"}
    nice = {name: os.getpriority(os.PRIO_PROCESS, pid) for name, pid in body["workers"].items()}
    assert nice["vision"] == nice["core"] == min(19, nice["decode"] + UNIFIED_NICE)  # decode goes first
    status, spec = http("GET", server.url + "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in spec["paths"]


def test_metrics_count_the_weights_once(server):
    """Pool bytes, and per-process weight bytes: core and decode map the one shared copy."""
    m = server.metrics()

    def value(name, **labels):
        found = [v for k, v in m.items() if k.startswith(name + "{")
                 and all(f'{label}="{x}"' in k for label, x in labels.items())]
        assert len(found) == 1, (name, labels, [k for k in m if k.startswith(name)])
        return found[0]

    assert sum(k.startswith("unifiedserve_pool_bytes{") for k in m) == 3
    assert all(value("unifiedserve_pool_bytes", pool=p, device="cpu") > 0 for p in ("kv", "patch", "weights"))
    weights = value("unifiedserve_pool_bytes", pool="weights")

    def mem(process, kind):
        return value("unifiedserve_process_memory_bytes", process=process, kind=kind)

    # every LLM parameter of both processes lives in the pool; what core owns is its vision tower
    assert mem("core", "weights_shared") == mem("decode", "weights_shared") == weights
    assert mem("decode", "weights_own") == 0 < mem("core", "weights_own")
    assert not any("device_allocated" in k for k in m)  # CUDA only


def test_metrics_count_the_engine_iterations(server, client, media):
    """unifiedserve_engine_*: core's iterations ran the new video's patches through the encoder and its prompt
    through prefill, decode's ran the other tokens, one row a step; busy time is positive and below wall time."""
    _, files = media

    def counters() -> dict[tuple[str, str], float]:
        found = {}
        for key, value in server.metrics().items():
            name, _, labels = key.partition("{")
            if name.startswith("unifiedserve_engine_"):
                process = re.search(r'process="([^"]*)"', labels).group(1)
                kind = re.search(r'kind="([^"]*)"', labels)
                found[(name[len("unifiedserve_engine_"):] + (f":{kind.group(1)}" if kind else ""), process)] = value
        return found

    before, start = counters(), time.monotonic()
    # fps 1.25: a sampling no earlier test asked for, so the video is decoded, encoded and prefilled again
    r = client.chat.completions.create(model="demo-model", messages=video_message(files["video"], fps=1.25),
                                       **GREEDY)
    deadline = time.monotonic() + 5
    while (after := counters()).get(("tokens:decode", "decode"), 0) < before.get(("tokens:decode", "decode"), 0) \
            + GREEDY["max_tokens"] - 1:  # the workers report every 50 ms at most
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    wall = time.monotonic() - start

    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    visual_tokens = r.usage.prompt_tokens - 64  # at least: the chat template and question are < 64 tokens
    assert grew(("tokens:encode", "core")) >= 4 * visual_tokens  # 4 patches per visual token
    assert grew(("tokens:prefill", "core")) >= visual_tokens
    assert grew(("tokens:decode", "core")) == 0  # unified: decode tokens are the decode process's
    assert grew(("tokens:decode", "decode")) >= GREEDY["max_tokens"] - 1  # the first token is core's
    assert grew(("iterations", "decode")) >= GREEDY["max_tokens"] - 1 and grew(("iterations", "core")) >= 1
    for process in ("core", "decode"):
        assert 0 < grew(("busy_seconds", process)) < wall
    assert 0 < grew(("encode_seconds", "core")) <= grew(("busy_seconds", "core"))


def test_milestones_give_a_video_requests_timeline(server, client, media):
    """unifiedserve_request_milestone_seconds: one new video request reaches every milestone once, each stamped by
    the process that saw it, in the order its way to the first token forces."""
    _, files = media

    def totals():
        out = {}
        for key, value in server.metrics().items():
            name, _, labels = key.partition("{")
            if name.startswith("unifiedserve_request_milestone_seconds_") and name.endswith(("_sum", "_count")):
                milestone = re.search(r'milestone="([^"]*)"', labels).group(1)
                out[(milestone, name.rsplit("_", 1)[1])] = value
        return out

    before = totals()
    started = time.monotonic()
    # fps 1.75: a sampling no earlier test asked for, so no cache serves it and the video is decoded again
    client.chat.completions.create(model="demo-model", messages=video_message(files["video"], fps=1.75), **GREEDY)
    ttft_bound = time.monotonic() - started
    after = totals()
    at = {}
    for (milestone, field), value in after.items():
        if field == "count":
            assert value - before.get((milestone, "count"), 0) == 1, milestone  # this request, once
            at[milestone] = after[(milestone, "sum")] - before.get((milestone, "sum"), 0)
    assert set(at) == {"probed", "decode_start", "added", "admitted", "first_part_decoded", "first_part_written",
                       "first_part_ready", "media_ready", "encode_start", "prefill_start", "first_token"}, at
    assert all(0 <= t <= ttft_bound for t in at.values()), at
    order = ["probed", "added", "admitted", "first_part_written", "first_part_ready", "encode_start", "first_token"]
    assert [at[m] for m in order] == sorted(at[m] for m in order), sorted(at.items(), key=lambda kv: kv[1])
    assert at["decode_start"] <= at["first_part_decoded"] <= at["first_part_written"], at
    assert at["first_part_ready"] <= at["media_ready"] <= at["first_token"], at
    # the text before the video is prefilled from the step that admits the request (stamped at its start)
    assert at["added"] <= at["prefill_start"] <= at["first_token"], at


def test_media_crosses_no_process_boundary(server, client, media):
    """Zero copies between stages, by count: a new video's patches (megabytes) are written by vision into
    the shared patch buffer and read there by core, its visual tokens and KV stay in the pools, and the
    messages between the processes carry only control data and page indices."""
    _, files = media

    def sent() -> dict[tuple[str, str], float]:
        """(src, dst) -> bytes sent, from unifiedserve_ipc_sent_bytes (its labels in any order)."""
        found = {}
        for key, value in server.metrics().items():
            if key.startswith("unifiedserve_ipc_sent_bytes{"):
                labels = dict(part.split("=") for part in key[key.index("{") + 1:-1].split(","))
                found[(labels["src"].strip('"'), labels["dst"].strip('"'))] = value
        return found

    before = sent()
    # fps 1.5: a sampling no earlier test asked for, so no cache serves it and the video is decoded again
    r = client.chat.completions.create(model="demo-model", messages=video_message(files["video"], fps=1.5),
                                       **GREEDY)
    deadline = time.monotonic() + 5
    edge = ("vision", "core")
    while (after := sent()).get(edge, 0) <= before.get(edge, 0):  # the workers report every 50 ms at most
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    moved = sum(after.values()) - sum(before.values())
    visual_tokens = r.usage.prompt_tokens - 40  # generous: the chat template and question are < 40 tokens
    patch_bytes = visual_tokens * 4 * 1176 * 4  # 4 patches per visual token, 1176 float32 values each
    assert 0 < moved < 0.01 * patch_bytes, (moved, patch_bytes, after)
    for edge in (("api", "vision"), ("vision", "core"), ("core", "decode"), ("decode", "api")):
        assert after.get(edge, 0) > before.get(edge, 0), (edge, before, after)


def test_video_nonstream_and_stream_agree(server, client, media):
    _, files = media
    full = client.chat.completions.create(model="demo-model", messages=video_message(files["video"]), **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 100  # the video's visual tokens are counted
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model="demo-model", messages=video_message(files["video"]),
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_logprobs_streamed_and_not(client, media):
    _, files = media
    kw = dict(model="demo-model", messages=video_message(files["video"]), logprobs=True, top_logprobs=3, **GREEDY)
    whole = client.chat.completions.create(**kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 12
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        raw = bytes(e.bytes)  # a token may hold part of a character: then its text spells the bytes
        assert e.logprob <= 0 and e.token == (raw.decode() if raw.isascii() or _utf8(raw) else
                                              "".join(f"\\x{b:02x}" for b in raw))
    streamed = [c.choices[0].logprobs.content for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs is not None]
    flat = [e for chunk in streamed for e in chunk]
    assert [(e.token, round(e.logprob, 5)) for e in flat] == [(e.token, round(e.logprob, 5)) for e in entries]
    plain = client.chat.completions.create(model="demo-model", messages=video_message(files["video"]), **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_image_and_text(client, media):
    _, files = media
    out = client.chat.completions.create(model="demo-model", messages=image_message(files["image"]), **GREEDY)
    assert out.usage.completion_tokens == 12 and out.choices[0].message.content
    text = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0.8, seed=7)
    assert text.usage.completion_tokens <= 5


def test_data_url_video_equals_file_url(client, media):
    _, files = media
    payload = base64.b64encode(files["video"].read_bytes()).decode()
    by_data = client.chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{payload}"}},
            {"type": "text", "text": QUESTION}]}], **GREEDY)
    by_file = client.chat.completions.create(model="demo-model", messages=video_message(files["video"]), **GREEDY)
    assert by_data.choices[0].message.content == by_file.choices[0].message.content


def _engine_reference(files):
    """The same requests through the single-process engine (greedy, 12 tokens)."""
    import flashcodec
    from unifiedserve.engine import LLM, SamplingParams, VisionInput

    llm = LLM()
    spec = llm.processor.patch_spec
    video = VisionInput.from_video(flashcodec.decode_video(str(files["video"]), output="patches", patch_spec=spec))
    video2 = VisionInput.from_video(flashcodec.decode_video(str(files["video2"]), output="patches",
                                                            patch_spec=spec, fps=4.0))
    image = VisionInput.from_image(flashcodec.decode_image(str(files["image"])), spec)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cases = {
        "video": [{"role": "user", "content": [{"type": "video", "vision": video},
                                               {"type": "text", "text": QUESTION}]}],
        "video2": [{"role": "user", "content": [{"type": "video", "vision": video2},
                                                {"type": "text", "text": "Count the objects."}]}],
        "image": [{"role": "user", "content": [{"type": "image", "vision": image},
                                               {"type": "text", "text": "Describe the image."}]}],
        "text": [{"role": "user", "content": "Tell me a story."}],
    }
    out = {}
    for name, messages in cases.items():
        ids, vision = llm.build_prompt(messages)
        out[name] = llm.generate([(ids, vision, params)])[0]
    return out


def _served(client, files, name):
    messages = {
        "video": video_message(files["video"]),
        "video2": video_message(files["video2"], "Count the objects.", fps=4.0),
        "image": image_message(files["image"]),
        "text": [{"role": "user", "content": "Tell me a story."}],
    }[name]
    return client.chat.completions.create(model="demo-model", messages=messages, **GREEDY)


def test_parity_and_concurrency_then_no_leaks(server, client, media):
    """16 mixed requests at once; every one equals the single-process engine's greedy output."""
    _, files = media
    reference = _engine_reference(files)
    names = ["video", "video2", "image", "text"] * 4
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda n: _served(client, files, n), names))
    for name, res in zip(names, results):
        ref = reference[name]
        assert res.usage.prompt_tokens == ref.prompt_len, name
        assert res.usage.completion_tokens == 12
        assert res.choices[0].message.content == ref.text, name
    m = server.wait_idle()
    assert m['unifiedserve_pool_capacity{pool="kv_blocks"}'] > 0
    assert m["unifiedserve_time_to_first_token_seconds_count"] >= 16
    counts = {s: m[f'unifiedserve_request_stage_seconds_count{{stage="{s}"}}'] for s in
              ("probe", "video_decode", "queue", "encode", "prefill")}
    # a request whose media the prefix or media cache already holds runs no encode step
    assert all(counts[s] >= 16 for s in ("probe", "video_decode", "queue", "prefill")) and counts["encode"] >= 3, counts
    # decode start -> first encode step, for each request that encoded media vision decoded for it
    lag_count = m["unifiedserve_request_first_encode_lag_seconds_count"]
    assert 3 <= lag_count <= counts["encode"], (lag_count, counts)
    assert 0 < m["unifiedserve_request_first_encode_lag_seconds_sum"] < \
        m["unifiedserve_time_to_first_token_seconds_sum"]


def _error(status_body, status):
    code, body = status_body
    assert code == status, body
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]["message"]


def test_bad_requests_get_400_and_server_keeps_serving(server, media):
    d, files = media
    url = server.url + "/v1/chat/completions"

    def video(u, **kw):
        return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": u}},
                                                          {"type": "text", "text": "?"}]}], "max_tokens": 4, **kw}

    msg = _error(http("POST", url, video(f"file://{d}/corrupt.mp4")), 400)
    assert "corrupt" in msg.lower() or "decode" in msg.lower()
    _error(http("POST", url, video(f"file://{d}/notavideo.mp4")), 400)
    garbage = base64.b64encode(b"\x00\x01garbage" * 50).decode()
    _error(http("POST", url, video(f"data:video/mp4;base64,{garbage}")), 400)
    assert "outside" in _error(http("POST", url, video(f"file://{files['outside']}")), 400)
    _error(http("POST", url, video(f"file://{d}/escape.png")), 400)
    _error(http("POST", url, video(f"file://{d}/../outside/x.png")), 400)
    _error(http("POST", url, video("http://example.com/a.mp4")), 400)
    msg = _error(http("POST", url, video(f"file://{files['video']}", max_tokens=40000)), 400)
    assert "maximum context length" in msg and "40000" in msg
    _error(http("POST", url, video(f"file://{files['video']}", temperature=-1)), 400)
    _error(http("POST", url, video(f"file://{files['video']}", n=17)), 400)
    _error(http("POST", url, {"messages": []}), 400)
    _error(http("POST", url, b"{not json"), 400)
    _error(http("POST", url, {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404)
    # still serving, and nothing leaked
    status, body = http("POST", url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3
    server.wait_idle()


def test_client_disconnect_mid_stream_frees_everything(server, media):
    _, files = media
    body = json.dumps({"messages": video_message(files["video"]), "max_tokens": 2000, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 5:
        line = resp.readline()
        if line.startswith(b"data: ") and b"content" in line:
            seen += 1
    conn.sock.shutdown(2)
    conn.close()
    m = server.wait_idle(timeout=30)
    assert m['unifiedserve_requests_total{finish_reason="abort"}'] >= 1


def test_non_streaming_disconnect_aborts(server, media):
    _, files = media
    body = json.dumps({"messages": video_message(files["video"]), "max_tokens": 3000, "ignore_eos": True})
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while server.metrics()['unifiedserve_pool_used{pool="kv_blocks"}'] == 0:  # until admitted and prefilled
        assert time.monotonic() < deadline, "the request never got KV blocks"
        time.sleep(0.1)
    conn.sock.shutdown(2)
    conn.close()
    server.wait_idle(timeout=30)
