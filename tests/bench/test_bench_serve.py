"""Tests for bench/serve/bench_serve.py: the wire format, and full runs against a tiny fake
OpenAI-compatible streaming server (FastAPI + uvicorn in a background thread). Its metrics are tested in
test_serve_metrics.py."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import pathlib
import socket
import sys

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "bench" / "serve") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench" / "serve"))

import bench_serve as bs  # noqa: E402
from serve_metrics import compute_metrics  # noqa: E402
from uvicorn_thread import uvicorn_in_thread  # noqa: E402


def test_chat_messages_wire_format():
    req = {"prompt": "why?", "media": [
        {"type": "video", "path": "/v.mp4", "fps": 2.0, "max_frames": None},
        {"type": "image", "path": "/i.png", "fps": None, "max_frames": None}]}
    urls = bs.media_urls([req], "file")
    assert bs.chat_messages(req, urls) == [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "file:///v.mp4", "fps": 2.0}},
        {"type": "image_url", "image_url": {"url": "file:///i.png"}},
        {"type": "text", "text": "why?"}]}]
    with pytest.raises(FileNotFoundError, match="not found on this machine"):
        bs.media_urls([req], "data")


# ---------------------------------------------------------------------------
# a fake OpenAI-compatible streaming server
# ---------------------------------------------------------------------------

TOKEN_DELAY_S = 0.01


def fake_app(received: list):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-vl", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        received.append(body)
        if "BAD" in body["messages"][-1]["content"][-1]["text"]:
            return JSONResponse(status_code=400, content={"object": "error", "error": {
                "message": "prompt rejected: BAD", "type": "BadRequestError", "param": None, "code": 400}})
        n = body["max_tokens"]
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}

        def sse(obj):
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                yield sse({**head, "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]})
            yield sse({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            yield sse({**head, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                         "total_tokens": 7 + n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server():
    """``(base_url, received request bodies)``; the list is cleared for each test."""
    received: list = []
    with uvicorn_in_thread(uvicorn.Config(fake_app(received), log_level="warning", lifespan="off")) as port:
        yield f"http://127.0.0.1:{port}", received


@pytest.fixture
def fake(server):
    server[1].clear()
    return server


def request(i: int, *, arrival_s: float = 0.0, output_len: int = 4, prompt: str = "What happens?",
            media=None) -> dict:
    return {"request_id": f"r{i}", "arrival_s": arrival_s, "prompt": prompt, "output_len": output_len,
            "ignore_eos": True, "media": media if media is not None else [
                {"type": "video", "path": "/data/clip.mp4", "fps": 2.0, "max_frames": 64}]}


def test_run_records_every_request(fake):
    base_url, received = fake
    reqs = [request(i, arrival_s=0.02 * i, output_len=3 + i) for i in range(4)]
    reqs.append(request(4, arrival_s=0.03, prompt="BAD question", media=[]))
    records, duration_s = asyncio.run(bs.run_benchmark(base_url, reqs, max_concurrency=None, model=None,
                                                       api_key=None, progress=False))
    assert [r.request_id for r in records] == [f"r{i}" for i in range(5)]
    for req, rec in zip(reqs[:4], records[:4]):
        assert rec.is_success and rec.error is None
        assert rec.completion_tokens == req["output_len"] == len(rec.token_times_s)
        assert rec.prompt_tokens == 7 and rec.output_text.startswith("w0 w1 ")
        assert rec.start_s >= rec.scheduled_s == req["arrival_s"]
        assert 0 < rec.ttft_s < rec.e2e_s and len(rec.itls_s) == req["output_len"] - 1
        assert rec.start_s < rec.token_times_s[0] <= rec.token_times_s[-1] <= rec.end_s <= duration_s
    bad = records[4]
    assert not bad.is_success and bad.error == "HTTP 400: prompt rejected: BAD" and bad.ttft_s is None
    m = compute_metrics(records, duration_s)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 1, 3 + 4 + 5 + 6)
    # the mean gap: on a busy machine two tokens can arrive in one read (a near-zero gap, then a double one),
    # which moves the median but not the mean (the span over the gaps)
    assert m["itl_ms"]["mean"] >= TOKEN_DELAY_S * 1e3 * 0.5

    body = next(b for b in received if "BAD" not in json.dumps(b))
    assert body["model"] == "fake-vl" and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "file:///data/clip.mp4", "fps": 2.0, "max_frames": 64}},
        {"type": "text", "text": "What happens?"}]}]
    assert sorted(b["max_tokens"] for b in received) == [3, 4, 4, 5, 6]


def test_max_concurrency_one_serialises_requests(fake):
    base_url, _ = fake
    reqs = [request(i, output_len=3) for i in range(4)]
    records, _ = asyncio.run(bs.run_benchmark(base_url, reqs, max_concurrency=1, model="fake-vl",
                                              api_key=None, progress=False))
    spans = sorted((r.start_s, r.end_s) for r in records)
    assert all(r.is_success for r in records)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:]))
    # without the cap the same requests overlap
    records, _ = asyncio.run(bs.run_benchmark(base_url, reqs, max_concurrency=None, model="fake-vl",
                                              api_key=None, progress=False))
    assert max(r.start_s for r in records) < min(r.end_s for r in records)


def test_a_deadline_cuts_the_run_and_records_what_was_unfinished(fake):
    """deadline_s (a device run's time limit): requests still streaming or not yet sent when it comes are cancelled
    and recorded as failed with CUT_ERROR, keeping the tokens they had; finished ones are untouched."""
    base_url, _ = fake
    reqs = [request(0, output_len=2), request(1, output_len=400), request(2, arrival_s=30.0, output_len=2)]
    started = time.perf_counter()
    records, duration_s = asyncio.run(bs.run_benchmark(base_url, reqs, model="fake-vl", progress=False,
                                                       deadline_s=1.0))
    assert time.perf_counter() - started < 10  # not the 30-s arrival, nor 400 tokens of 10 ms
    assert 1.0 <= duration_s < 5
    done, streaming, unsent = records
    assert done.is_success and done.error is None and done.completion_tokens == 2
    assert not streaming.is_success and streaming.error == bs.CUT_ERROR
    assert 0 < streaming.completion_tokens == len(streaming.token_times_s) < 400 and streaming.end_s == duration_s
    assert not unsent.is_success and unsent.error == bs.CUT_ERROR and unsent.token_times_s == []
    assert unsent.start_s == unsent.end_s == duration_s  # never sent: no time in flight
    m = compute_metrics(records, duration_s, goodput={"ttft": 10_000})
    assert (m["completed"], m["failed"]) == (1, 2) and m["goodput"]["num_met"] == 1


def test_data_urls_carry_the_file_bytes(fake, tmp_path):
    base_url, received = fake
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00\x01fake mp4 bytes")
    reqs = [request(0, media=[{"type": "video", "path": str(clip), "fps": None, "max_frames": None}])]
    records, _ = asyncio.run(bs.run_benchmark(base_url, reqs, model="fake-vl", progress=False,
                                              media_url_mode="data"))
    assert records[0].is_success
    part = received[0]["messages"][0]["content"][0]["video_url"]
    assert part.keys() == {"url"} and part["url"].startswith("data:video/mp4;base64,")
    assert base64.b64decode(part["url"].split(",", 1)[1]) == clip.read_bytes()


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(RuntimeError, match="could not list models"):
        asyncio.run(bs.fetch_model(f"http://127.0.0.1:{port}"))


def test_cli_writes_result_json(fake, tmp_path, capsys):
    base_url, received = fake
    wl = tmp_path / "w.jsonl"
    reqs = [request(i, arrival_s=0.0, output_len=3) for i in range(3)]
    wl.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "res" / "serve.json"
    rc = bs.main(["--base-url", base_url, "--workload-file", str(wl), "--request-rate", "50", "--seed", "1",
                  "--max-concurrency", "2", "--goodput", "ttft:5000", "tbt:5000", "--result-json", str(out),
                  "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "TTFT" in text
    res = json.loads(out.read_text())
    assert res["model"] == "fake-vl" and res["metrics"]["completed"] == 3
    assert res["metrics"]["goodput"]["attainment"] == 1.0 and len(received) == 4  # one warmup
    arrivals = sorted(r["scheduled_s"] for r in res["requests"])
    assert arrivals[0] == 0.0 and arrivals[-1] > 0  # re-generated from --request-rate
    first = res["requests"][0]
    assert {"ttft_s", "itls_s", "e2e_s", "token_times_s", "start_s", "error", "completion_tokens"} <= first.keys()
    assert {"platform", "cpu_count", "python", "packages"} <= res["machine"].keys() and "commit" in res


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    assert bs.main(["--goodput", "e2e:5"]) == 2
    assert bs.main([]) == 2  # neither --workload nor --workload-file
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"request_id": 1}\n')
    assert bs.main(["--workload-file", str(bad)]) == 2
    errs = capsys.readouterr().err.strip().splitlines()
    assert len(errs) == 3 and "w.jsonl:1:" in errs[2]


# ---------------------------------------------------------------------------
# server_process: a server that will not start is one error line, not a traceback
# ---------------------------------------------------------------------------


def test_bad_server_flag_is_one_error_line(tmp_path, capsys):
    import server_process as sp

    with pytest.raises(sp.ServerStartError, match=r"the server exited \(2\): .*error: .*--no-such-flag"):
        sp.ServerProcess(["--no-such-flag"], tmp_path / "server.log", timeout=60)

    def main() -> int:
        sp.ServerProcess(["--no-such-flag"], tmp_path / "server2.log", timeout=60)
        return 0

    assert sp.run_main(main, "ttft_breakdown.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ttft_breakdown.py: error: the server exited (2): ")
    assert sp.run_main(lambda: 0, "x") == 0


# ---------------------------------------------------------------------------
# bench_vision_ahead.py: its helpers and its argument errors (a full run takes minutes: see docs/benchmarks.md)
# ---------------------------------------------------------------------------


def test_vision_ahead_helpers_and_bad_arguments(capsys):
    import os

    import bench_vision_ahead as va

    own = int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert va.tree_rss(os.getpid()) >= own * 0.9  # this process and its children, if any
    metrics = {'unifiedserve_vision_ahead_bytes{model_name="m"}': 7.0, "unifiedserve_vision_ahead_bytes_x": 1.0}
    assert va.gauge(metrics, "unifiedserve_vision_ahead_bytes") == 7.0 and va.gauge({}, "absent") == 0.0
    for bad in (["--bounds", "0"], ["--num-videos", "0"]):
        with pytest.raises(SystemExit) as exit_:
            va.main(bad)
        assert exit_.value.code == 2 and "must be positive" in capsys.readouterr().err


def test_engine_counters_and_iteration_summary():
    """/metrics' unifiedserve_engine_* per process, and a window's iterations from two readings."""
    import server_process as sp

    def reading(core_iters, core_busy, prefill, decode_iters):
        return {
            'unifiedserve_engine_iterations{model_name="m",process="core"}': core_iters,
            'unifiedserve_engine_busy_seconds{model_name="m",process="core"}': core_busy,
            'unifiedserve_engine_encode_seconds{model_name="m",process="core"}': core_busy / 4,
            'unifiedserve_engine_tokens{kind="encode",model_name="m",process="core"}': 4096.0 * core_iters,
            'unifiedserve_engine_tokens{kind="prefill",model_name="m",process="core"}': prefill,
            'unifiedserve_engine_tokens{kind="decode",model_name="m",process="core"}': 0.0,
            'unifiedserve_engine_iterations{model_name="m",process="decode"}': decode_iters,
            'unifiedserve_engine_busy_seconds{model_name="m",process="decode"}': decode_iters * 0.01,
            'unifiedserve_engine_tokens{kind="decode",model_name="m",process="decode"}': decode_iters * 4,
            'unifiedserve_request_stage_seconds_sum{model_name="m",stage="encode"}': 1.0,
        }

    before = sp.engine_counters(reading(10, 1.0, 5120.0, 100))
    assert before["core"]["prefill_tokens"] == 5120.0 and before["decode"]["decode_tokens"] == 400
    assert set(before) == {"core", "decode"}
    window = sp.iteration_summary(before, sp.engine_counters(reading(30, 3.0, 46080.0, 100)))
    assert set(window) == {"core"}  # decode ran nothing in the window
    core = window["core"]
    assert core["iterations"] == 20 and core["mean_ms"] == pytest.approx(100.0)
    assert core["prefill_tokens_per_iteration"] == pytest.approx(2048.0)
    assert core["encode_tokens_per_iteration"] == pytest.approx(4096.0) and core["encode_s"] == pytest.approx(0.5)


def test_ttft_breakdown_timeline_from_two_readings(capsys):
    """ttft_breakdown's timeline: the one request's milestones between two /metrics readings, in the server's
    order; one another request also reached (count 2) or none reached is left out."""
    import ttft_breakdown as tb

    def reading(**milestones):
        out = {}
        for name, (total, count) in milestones.items():
            out[f'unifiedserve_request_milestone_seconds_sum{{milestone="{name}",model_name="m"}}'] = total
            out[f'unifiedserve_request_milestone_seconds_count{{milestone="{name}",model_name="m"}}'] = count
            out[f'unifiedserve_request_milestone_seconds_bucket{{le="+Inf",milestone="{name}",model_name="m"}}'] = count
        return tb.milestone_sums(out)

    before = reading(probed=(1.0, 4), first_token=(9.0, 4), added=(2.0, 4))
    after = reading(probed=(1.1, 5), first_token=(12.5, 5), added=(2.4, 6), encode_start=(0.5, 1))
    line = tb.timeline(before, after)
    assert list(line) == ["probed", "encode_start", "first_token"]  # added: two requests; MILESTONES order
    assert line["probed"] == pytest.approx(0.1) and line["first_token"] == pytest.approx(3.5)
    tb.print_timelines({"streaming": {"timeline_s": line}, "whole": {"timeline_s": {"first_token": 4.0}}})
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["timeline", "(s", "from", "arrival)", "streaming", "step", "whole", "step"]
    rows = {row.split()[0]: row.split()[1:] for row in out[2:]}
    assert set(rows) == set(tb.MILESTONES)
    assert rows["encode_start"] == ["0.500", "+0.400", "n/a"]
    assert rows["first_token"] == ["3.500", "+3.000", "4.000", "+4.000"]


def test_memory_accounting_says_the_weights_are_held_once_and_what_crossed():
    """server_process.memory_accounting on a reading shaped like the H200 server's (2026-11-28): core and decode map
    the 14.19 GiB weights pool, decode owns none, a few MiB crossed between processes; the GPU's used memory leaves
    less than the weights pool unexplained. A second copy (decode owning the weights, or 14 GiB more used) fails."""
    import server_process as sp
    import ttft_breakdown as tb

    gib, mib = 2 ** 30, 2 ** 20

    def reading(decode_own=0.0):
        m = {}
        for pool, size in (("kv", 16 * gib), ("patch", 1 * gib), ("weights", 14.19 * gib)):
            m[f'unifiedserve_pool_bytes{{device="cuda:0",model_name="m",pool="{pool}"}}'] = size
        for process, own, shared, peak in (("core", 1299 * mib, 14525 * mib, 2107 * mib),
                                           ("decode", decode_own, 14525 * mib, 365 * mib)):
            for kind, v in (("weights_own", own), ("weights_shared", shared), ("device_peak", peak)):
                m[f'unifiedserve_process_memory_bytes{{kind="{kind}",model_name="m",process="{process}"}}'] = v
        m['unifiedserve_ipc_sent_bytes{dst="core",model_name="m",src="vision"}'] = 2 * mib
        m['unifiedserve_ipc_sent_bytes{dst="decode",model_name="m",src="core"}'] = 1 * mib
        return m

    used = (16 + 1 + 14.19) * gib + (2107 + 365) * mib + 3 * gib  # three contexts, NVDEC surfaces, slack
    m = sp.memory_accounting(reading(), used, media_bytes=200 * mib)
    assert m["shared_by"] == ["core", "decode"] and m["ipc_sent_bytes"] == 3 * mib
    assert m["ipc_over_media"] == pytest.approx(0.015) and m["unexplained_bytes"] == pytest.approx(3 * gib)
    assert m["weights_once"] is True
    assert sp.memory_accounting(reading(), used + 14.19 * gib)["weights_once"] is False
    assert sp.memory_accounting(reading(decode_own=14525 * mib), used)["weights_once"] is False
    assert "device_used_bytes" not in sp.memory_accounting(reading())  # the CPU: no GPU reading
    line = tb.describe_memory(m)
    assert "the weights pool mapped by core, decode" in line and "own weights core 1.27, decode 0.00 GiB" in line
    assert line.endswith("weights held once: True") and "(0.01500 x the videos' patch bytes)" in line
    assert tb.gpu_index("--device cuda:1 --model x") == 1 and tb.gpu_index("--device cuda") == 0


def test_ttft_breakdown_asks_about_a_video_and_times_its_first_token(tmp_path):
    """ask_video (the measured request and --warm-video's): TTFT at the first chunk with a choice (not the role-less
    ones before it), the usage from the last chunk, the video by file:// URL with the run's sampling."""
    import time
    from types import SimpleNamespace as NS

    import ttft_breakdown as tb

    sent = {}

    def chunks():
        yield NS(choices=[], usage=None)
        time.sleep(0.05)
        yield NS(choices=[NS(delta=NS(content="a"))], usage=None)
        time.sleep(0.05)
        yield NS(choices=[], usage=NS(prompt_tokens=7))

    def create(**kw):
        sent.update(kw)
        return chunks()

    client = NS(models=NS(list=lambda: NS(data=[NS(id="demo")])), chat=NS(completions=NS(create=create)))
    clip = tmp_path / "v.mp4"
    ttft, e2e, usage = tb.ask_video(client, clip, NS(fps=2.0, max_pixels=1234))
    assert 0.04 < ttft < e2e and e2e >= 0.09 and usage.prompt_tokens == 7
    video = sent["messages"][0]["content"][0]["video_url"]
    assert video == {"url": f"file://{clip}", "fps": 2.0, "max_pixels": 1234} and sent["model"] == "demo"


# ---------------------------------------------------------------------------
# bench_choices.py: its argument errors (a full run takes minutes: see docs/benchmarks.md)
# ---------------------------------------------------------------------------


def test_choices_bad_arguments(capsys):
    import bench_choices as bc

    for bad, needle in ((["--n", "1"], "--n must be at least 2"), (["--trials", "0"], "must be a whole number >= 1"),
                        (["--max-tokens", "x"], "must be a whole number >= 1")):
        with pytest.raises(SystemExit) as exit_:
            bc.main(bad)
        assert exit_.value.code == 2 and needle in capsys.readouterr().err
