"""Fair admission under KV pressure: a short question is not held behind a long request waiting for KV blocks."""

from __future__ import annotations

import threading
import time

import pytest

from serve_helpers import Server, http

pytestmark = pytest.mark.slow


def _stream_body(max_tokens):
    return {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}


def test_short_request_overtakes_one_waiting_for_kv_blocks(tmp_path):
    # 128 blocks x 16 tokens: two streams hold ~114 blocks, a third needs ~63 and must wait for one of them
    srv = Server("--num-kv-blocks", "128", "--max-model-len", "2048", media_dir=tmp_path)
    results = {}

    def run(name, max_tokens):
        results[name] = http("POST", srv.url + "/v1/chat/completions", _stream_body(max_tokens), timeout=300)

    try:
        holders = [threading.Thread(target=run, args=(f"holder-{i}", 880)) for i in range(2)]
        for t in holders:
            t.start()
        deadline = time.monotonic() + 60
        while srv.metrics()['unifiedserve_pool_used{pool="kv_blocks"}'] < 110:
            assert time.monotonic() < deadline, "the holders never got their KV blocks"
            time.sleep(0.05)
        waiter = threading.Thread(target=run, args=("waiter", 980))
        waiter.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["unifiedserve_num_requests_waiting"] < 1:  # it waits, and the gauge says so
            assert time.monotonic() < deadline, "the waiting request was never reported as waiting"
            time.sleep(0.05)
        started = time.perf_counter()
        status, reply = http("POST", srv.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=120)
        short_s = time.perf_counter() - started
        assert status == 200 and reply["usage"]["completion_tokens"] <= 4
        holders_busy = any(t.is_alive() for t in holders)
        for t in [*holders, waiter]:
            t.join(300)
        assert all(results[k][0] == 200 for k in results), results
        print(f"\nshort request: {short_s:.2f} s while the long streams held the cache")
        assert holders_busy, "the holders finished first: the test did not exercise the overtake"
        assert short_s < 1.0  # with first-come-first-served KV it waited for a holder to finish (seconds)
        srv.wait_idle(timeout=30)
    finally:
        assert srv.stop() == 0
