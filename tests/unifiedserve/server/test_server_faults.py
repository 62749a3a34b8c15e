"""Faults that take a server down: a worker dies, SIGINT. Each test runs its own server."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import openai
import pytest

from serve_helpers import Server, alive, http, leftovers

pytestmark = pytest.mark.slow


def _gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_decode_worker_death_fails_requests_and_exits_nonzero(clip_dir):
    srv = Server("--api-key", "sekret", media_dir=clip_dir)
    pids = srv.pids()
    try:
        assert http("GET", srv.url + "/v1/models")[0] == 401
        # a body's request without the key: 401 before its body is read (here the body is never sent)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000000\r\n\r\n")
            head = conn.recv(4096).lower()
        assert head.startswith(b"http/1.1 401") and b"www-authenticate: bearer" in head, head
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "demo-model"
        messages = [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"file://{clip_dir}/clip.mp4"}}, {"type": "text", "text": "?"}]}]
        errors, chunks = [], []

        def streaming():
            try:
                for chunk in client.chat.completions.create(model="demo-model", messages=messages, max_tokens=5000,
                                                            stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
            except Exception as e:  # the in-band error event, or the connection closing
                errors.append(e)

        def blocking():
            try:
                client.chat.completions.create(model="demo-model", messages=messages, max_tokens=5000,
                                               extra_body={"ignore_eos": True})
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=streaming), threading.Thread(target=blocking)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(chunks) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(chunks) >= 3, srv.log()
        os.kill(srv.workers["decode"], signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a request hung after the decode worker died"
        assert len(errors) == 2, errors
        assert any(isinstance(e, openai.InternalServerError) and "decode worker" in str(e) for e in errors), errors
        status, body = http("GET", srv.url + "/health")
        assert status == 503 and "decode" in body["error"]
        code = srv.proc.wait(30)
        assert code == 1
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert _gone(pids), "worker processes outlived the server"
    assert leftovers(srv.instance) == []
    assert "decode worker process exited unexpectedly" in srv.log()


def test_sigint_during_requests_shuts_down_cleanly(clip_dir):
    srv = Server(media_dir=clip_dir)
    pids = srv.pids()
    body = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3000, "ignore_eos": True})
    results = []
    t = threading.Thread(target=lambda: results.append(http("POST", srv.url + "/v1/chat/completions",
                                                            json.loads(body), timeout=60)))
    t.start()
    time.sleep(1.0)
    code = srv.stop(signal.SIGINT)
    t.join(30)
    assert code == 0, srv.log()
    assert _gone(pids), "orphan processes after SIGINT"
    assert leftovers(srv.instance) == []
    assert not t.is_alive()
    status, body = results[0]
    assert status == 503 and "shutting down" in body["error"]["message"]


def test_a_stuck_worker_fails_requests_and_exits_nonzero(clip_dir):
    """A worker alive but stuck (here stopped with SIGSTOP; on a GPU, a device call that never returns) sends no
    heartbeat: after --worker-timeout the server treats it as dead. Its requests hung, and /health said ok."""
    srv = Server("--worker-timeout", "3", media_dir=clip_dir)
    pids = srv.pids()
    try:
        time.sleep(4)  # idle workers beat too: nothing fires while all of them are alive
        assert http("GET", srv.url + "/health")[0] == 200
        os.kill(srv.workers["vision"], signal.SIGSTOP)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"file://{clip_dir}/clip.mp4"}}, {"type": "text", "text": "?"}]}]
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="vision worker process has sent nothing"):
            client.chat.completions.create(model="demo-model", messages=messages, max_tokens=5)
        assert time.monotonic() - started < 10
        status, body = http("GET", srv.url + "/health")
        assert status == 503 and "stuck" in body["error"]
        assert srv.proc.wait(30) == 1
    finally:
        if alive(srv.workers["vision"]):
            os.kill(srv.workers["vision"], signal.SIGCONT)
        if srv.proc.poll() is None:
            srv.stop()
    assert _gone(pids), "worker processes outlived the server"
    assert leftovers(srv.instance) == []
