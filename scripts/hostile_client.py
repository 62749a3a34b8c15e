#!/usr/bin/env python3
"""A hostile client against a fresh ``unifiedserve serve``: every case must get a clear 4xx (or its
documented success), never a 500, a hang or harm to another request; the server must end healthy,
with every pool back to free and its memory flat.

    python scripts/hostile_client.py [--out bench/results/hostile.json] [--server-args="--async-scheduling"]

Starts its own server (demo model, CPU, ``--api-key``), generates tiny media, runs the cases in
order, prints one line per case and a summary, and exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.client
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "datasets", ROOT / "bench" / "serve"):
    sys.path.insert(0, str(extra))

import damaged_media  # noqa: E402
import synthetic_image  # noqa: E402
import synthetic_video  # noqa: E402
from server_process import ServerProcess, ServerStartError  # noqa: E402

KEY = "hostile-test-key"


class Client:
    def __init__(self, port: int):
        self.port = port

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 120.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
        try:
            conn.request(method, path, body=body, headers={k: v for k, v in hdrs.items() if v is not None})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def send_bytes(self, request: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
        """``request`` sent as it is; the status and body of the answer, read until the server closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(request)
            answer = b""
            while part := sock.recv(65536):
                answer += part
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    def chat(self, body: dict, **kw) -> tuple[int, dict | str]:
        status, raw = self.raw("POST", "/v1/chat/completions", json.dumps(body).encode(), **kw)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")


def video_part(url: str, **options) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **options}}


def user(*parts, text: str = "What is shown?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def build_cases(media: dict[str, Path], outside: Path) -> list[tuple[str, dict | None, set[int], str | None]]:
    """``(name, body, accepted statuses, text the error must not contain)``; body None: special case."""
    clip, png = f"file://{media['clip']}", f"file://{media['png']}"
    ok = {200}
    bad = {400}
    text = [{"role": "user", "content": "hi"}]
    cases = [
        ("min_pixels 1e12 on a video", {"messages": user(video_part(clip, min_pixels=10**12))}, bad, None),
        ("min_pixels 2e8 on a tiny image", {"messages": user({"type": "image_url", "image_url": {
            "url": png, "min_pixels": 2 * 10**8}})}, bad, None),
        ("max_pixels below min_pixels", {"messages": user(video_part(clip, min_pixels=100000, max_pixels=10))},
         bad, None),
        ("max_frames 1e9", {"messages": user(video_part(clip, max_frames=10**9))}, bad, None),
        ("fps 0", {"messages": user(video_part(clip, fps=0))}, bad, None),
        ("fps -2", {"messages": user(video_part(clip, fps=-2))}, bad, None),
        ("fps 1e9", {"messages": user(video_part(clip, fps=1e9))}, bad | ok, None),
        ("not a video (data: URL)", {"messages": user(video_part(
            "data:video/mp4;base64," + base64.b64encode(b"not a video" * 50).decode()))}, bad, None),
        ("corrupt middle of a video", {"messages": user(video_part(f"file://{media['corrupt']}")),
                                       "max_tokens": 4}, bad | ok, None),
        ("truncated video", {"messages": user(video_part(f"file://{media['truncated']}")), "max_tokens": 4},
         bad | ok, None),
        ("file:// outside the allowed folder", {"messages": user(video_part(f"file://{outside}"))}, bad, None),
        ("file:// symlink escaping", {"messages": user(video_part(f"file://{media['escape']}"))}, bad,
         str(outside.parent)),
        ("file:// with ..", {"messages": user(video_part(f"file://{media['clip'].parent}/../etc/passwd"))}, bad, None),
        ("http URL not allowed", {"messages": user(video_part("http://example.com/v.mp4"))}, bad, None),
        ("data: URL with bad base64", {"messages": user(video_part("data:video/mp4;base64,@@@@"))}, bad, None),
        ("url is a number", {"messages": user({"type": "video_url", "video_url": {"url": 123}})}, bad, None),
        ("17 media parts", {"messages": user(*[{"type": "image_url", "image_url": {"url": png}}] * 17)}, bad, None),
        ("video in a system message", {"messages": [{"role": "system", "content": [video_part(clip)]},
                                                    *text]}, bad, None),
        ("seed 2^70", {"messages": text, "seed": 2**70}, bad, None),
        ("lone surrogate in text", None, bad, None),
        ("top_logprobs 21", {"messages": text, "logprobs": True, "top_logprobs": 21}, bad, None),
        ("tools", {"messages": text, "tools": [{"type": "function", "function": {"name": "f"}}]}, bad, None),
        ("response_format bad schema", {"messages": text, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}, bad, None),
        ("response_format json_object", {"messages": text, "response_format": {"type": "json_object"},
                                         "max_tokens": 64}, ok, None),
        ("max_tokens 0", {"messages": text, "max_tokens": 0}, bad, None),
        ("max_tokens -1", {"messages": text, "max_tokens": -1}, bad, None),
        ("max_tokens 1e9", {"messages": text, "max_tokens": 10**9}, bad, None),
        ("temperature -1", {"messages": text, "temperature": -1}, bad, None),
        ("top_p 0", {"messages": text, "top_p": 0}, bad, None),
        ("top_p 2", {"messages": text, "top_p": 2}, bad, None),
        ("n 1000", {"messages": text, "n": 1000}, bad, None),
        ("n 0", {"messages": text, "n": 0}, bad, None),
        ("n 3", {"messages": text, "n": 3, "max_tokens": 4}, ok, None),
        ("logit_bias out of the vocabulary", {"messages": text, "logit_bias": {"99999999": 5}}, bad, None),
        ("logit_bias 1e6", {"messages": text, "logit_bias": {"5": 10**6}}, bad, None),
        ("logit_bias 100k entries", {"messages": text, "logit_bias": {str(i): 1 for i in range(100_000)}}, bad, None),
        ("min_p 2", {"messages": text, "min_p": 2}, bad, None),
        ("unknown field", {"messages": text, "frobnicate": 1}, bad, None),
        ("wrong model", {"messages": text, "model": "gpt-9"}, {404}, None),
        ("empty messages", {"messages": []}, bad, None),
        ("messages not a list", {"messages": "hi"}, bad, None),
        ("100 stop strings", {"messages": text, "stop": [f"s{i}" for i in range(100)], "max_tokens": 4},
         bad | ok, None),
        ("empty stop string", {"messages": text, "stop": [""]}, bad, None),
        ("10 MB of text", {"messages": [{"role": "user", "content": "word " * 2_000_000}]}, {400, 413}, None),
        ("deeply nested JSON body", None, {400, 413}, None),
        ("malformed JSON", None, bad, None),
        ("JSON array body", None, bad, None),
        ("80 MB body, Content-Length declared", None, {413}, None),
        ("80 MB body, chunked", None, {413, -1}, None),
        ("lower-case bearer", None, ok, None),
        ("no API key", None, {401}, None),
        ("GET on the chat route", None, {405}, None),
        # framing that does not parse never reaches the app: the HTTP layer answers it
        ("malformed request line", None, bad, None),
        ("illegal header line", None, bad, None),
        ("broken chunked body", None, bad, None),
        ("1 MB of headers", None, {431, -1}, None),  # -1: reset, the server closed with the rest unread
        ("half a head, then silence", None, {408}, None),  # answered after the server's 30-s head timeout
        ("half a body, then silence", None, {408}, None),  # answered when its pace runs out (30 s + 1 s / 64 KiB)
        ("min_tokens 1e9", {"messages": text, "min_tokens": 10**9}, bad, None),
        # found by review on 2026-11-27
        ("a 13000x13000 PNG of a few KB", {"messages": user({"type": "image_url", "image_url": {
            "url": f"file://{media['bomb']}"}})}, bad, None),
        ("60 MB of empty content parts", None, bad, None),
        ("repetition_penalty 1e-300", {"messages": text, "repetition_penalty": 1e-300}, bad, None),
        ("stop_token_ids past the vocabulary", {"messages": text, "stop_token_ids": [2**31 - 1]}, bad, None),
        ("store true", {"messages": text, "store": True}, bad, None),
        ("service_tier flex", {"messages": text, "service_tier": "flex"}, bad, None),
        ("min_tokens with a JSON grammar", {"messages": text, "min_tokens": 2,
                                            "response_format": {"type": "json_object"}}, bad, None),
        # /v1/completions (OpenAI's legacy endpoint)
        ("completion", None, ok, None),
        ("completion: 10 MB prompt", None, {400, 413}, None),
        ("completion: 2M token ids", None, {400, 413}, None),
        ("completion: token id 2^31", None, bad, None),
        ("completion: an image placeholder", None, bad, None),
        ("completion: a batch of prompts", None, ok, None),
        ("completion: a batch past --max-n", None, bad, None),
        ("completion: a batch with one prompt past the context", None, bad, None),
        ("completion: echo with logprobs", None, bad, None),
        # vLLM's /tokenize and /detokenize
        ("tokenize: 10 MB prompt", None, {400, 413}, None),
        ("tokenize: a symlink escaping the media root", None, bad, str(outside.parent)),
        ("detokenize: 2M token ids", None, {400, 413}, None),
        ("detokenize: an id past the vocabulary", None, bad, None),
    ]
    return cases


#: the /v1/completions cases' bodies (``special`` posts them there)
COMPLETIONS = {
    "completion": {"prompt": "Once upon a time", "max_tokens": 4},
    "completion: 10 MB prompt": {"prompt": "word " * 2_000_000},
    "completion: 2M token ids": {"prompt": [5] * 2_000_000},
    "completion: token id 2^31": {"prompt": [5, 2**31]},
    "completion: an image placeholder": {"prompt": "look: <|image_pad|>"},
    "completion: a batch of prompts": {"prompt": ["a", "b", "c"], "max_tokens": 2},
    "completion: a batch past --max-n": {"prompt": ["a"] * 1000, "max_tokens": 2},
    "completion: a batch with one prompt past the context": {"prompt": ["a", "word " * 100_000], "max_tokens": 2},
    "completion: echo with logprobs": {"prompt": "a", "echo": True, "logprobs": 2},
}


#: raw requests whose HTTP framing is broken (``special`` sends them as they are)
FRAMING = {
    "malformed request line": b"\x00\x01 not HTTP at all\r\n\r\n",
    "illegal header line": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    "broken chunked body": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "1 MB of headers": b"GET /health HTTP/1.1\r\nHost: x\r\n" + (b"x-filler: " + b"a" * 4000 + b"\r\n") * 256
                       + b"\r\n",
}


#: the /tokenize and /detokenize cases: (path, body)
TOKENIZE = {
    "tokenize: 10 MB prompt": ("/tokenize", {"prompt": "word " * 2_000_000}),
    "detokenize: 2M token ids": ("/detokenize", {"tokens": [5] * 2_000_000}),
    "detokenize: an id past the vocabulary": ("/detokenize", {"tokens": [5, 2**31 - 1]}),
}


def special(client: Client, name: str, media: dict[str, Path] | None = None) -> tuple[int, bytes]:
    text = [{"role": "user", "content": "hi"}]
    if name in TOKENIZE:
        path, body = TOKENIZE[name]
        return client.raw("POST", path, json.dumps(body).encode())
    if name == "tokenize: a symlink escaping the media root":  # the target's folder must not show
        body = {"messages": user(video_part(f"file://{media['escape']}"))}
        return client.raw("POST", "/tokenize", json.dumps(body).encode())
    if name in COMPLETIONS:
        return client.raw("POST", "/v1/completions", json.dumps(COMPLETIONS[name]).encode())
    if name == "lone surrogate in text":
        body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
        return client.raw("POST", "/v1/chat/completions", body)
    if name == "deeply nested JSON body":
        return client.raw("POST", "/v1/chat/completions", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    if name == "60 MB of empty content parts":  # refused from its raw bytes, before the event loop parses them
        part = b'{"type":"text","text":""},'
        parts = part * ((60 << 20) // len(part))
        return client.raw("POST", "/v1/chat/completions",
                          b'{"messages":[{"role":"user","content":[' + parts + b'{"type":"text","text":""}]}]}')
    if name == "malformed JSON":
        return client.raw("POST", "/v1/chat/completions", b'{"messages": [')
    if name == "JSON array body":
        return client.raw("POST", "/v1/chat/completions", b"[1, 2, 3]")
    if name == "80 MB body, Content-Length declared":
        # as curl does for large bodies: headers first, then the answer is read before the body is sent
        with socket.create_connection(("127.0.0.1", client.port), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {80 * 2**20}\r\n"
                         f"Expect: 100-continue\r\n\r\n".encode())
            head = b""
            while b"}}" not in head:  # the status line and headers may come before the body
                part = sock.recv(65536)
                if not part:
                    break
                head += part
        status = int(head.split(b" ", 2)[1])
        return status, head.split(b"\r\n\r\n", 1)[-1]
    if name == "80 MB body, chunked":
        # no length given: the server counts as it reads and answers 413 once past the limit; a client
        # that keeps writing after that may see its connection reset instead of the answer (-1)
        conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=60)
        try:
            conn.putrequest("POST", "/v1/chat/completions")
            for k, v in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                         ("Transfer-Encoding", "chunked")):
                conn.putheader(k, v)
            conn.endheaders()
            chunk = b"a" * 2**20
            for _ in range(80):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
            resp = conn.getresponse()
            return resp.status, resp.read()
        except OSError as e:
            return -1, f'{{"error": "{type(e).__name__}"}}'.encode()
        finally:
            conn.close()
    if name == "lower-case bearer":
        return client.raw("POST", "/v1/chat/completions", json.dumps({"messages": text, "max_tokens": 2}).encode(),
                          headers={"Authorization": f"bearer {KEY}"})
    if name == "no API key":
        return client.raw("POST", "/v1/chat/completions", json.dumps({"messages": text}).encode(),
                          headers={"Authorization": None})
    if name == "GET on the chat route":
        return client.raw("GET", "/v1/chat/completions")
    if name in FRAMING:
        return client.send_bytes(FRAMING[name])
    if name == "half a head, then silence":
        return client.send_bytes(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty", timeout=90)
    if name == "half a body, then silence":
        return client.send_bytes(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                 b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 50000000\r\n\r\n"
                                 b'{"messages": [', timeout=90)
    raise AssertionError(name)


def disconnects(client: Client, clip: Path, n: int) -> None:
    """``n`` streams dropped after a few tokens, and ``n`` non-streamed requests dropped before the answer."""
    body = json.dumps({"messages": user(video_part(f"file://{clip}")), "max_tokens": 500, "stream": True,
                       "ignore_eos": True}).encode()
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        for _ in range(4):
            resp.readline()
        conn.sock.shutdown(2)
        conn.close()
    body = json.dumps({"messages": user(video_part(f"file://{clip}")), "max_tokens": 500,
                       "ignore_eos": True}).encode()
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=0.3)
        try:
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            conn.getresponse()
        except OSError:
            pass
        finally:
            conn.close()


def idle(server: ServerProcess, timeout: float = 60.0) -> dict:
    """Wait until no request runs or waits and every pool is free; returns what is still busy (empty: idle)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = {k: v for k, v in m.items() if (k.startswith("unifiedserve_pool_used")
                                              or k.startswith("unifiedserve_num_requests")) and v}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.3)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--server-args", default="", help="extra flags for the server (e.g. \"--async-scheduling\" or "
                   "\"--policy monolithic\"): the same cases against another configuration")
    p.add_argument("--rounds", type=int, default=3, help="passes over the cases (default 3; memory is checked "
                   "from the second on)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    media_dir, outside_dir = work / "media", work / "outside"
    media_dir.mkdir()
    outside_dir.mkdir()
    media = {"clip": synthetic_video.make_video(media_dir / "clip.mp4", codec="h264", width=320, height=240,
                                                duration_s=4.0, fps=10.0, gop=10, seed=1),
             "png": synthetic_image.make_image(media_dir / "tiny.png", width=8, height=8, seed=2)}
    media["corrupt"] = damaged_media.corrupt_middle(media["clip"], media_dir / "corrupt.mp4", seed=3)
    media["bomb"] = media_dir / "bomb.png"  # 169 M pixels declared in a few KB: refused from its header
    from PIL import Image
    Image.new("1", (13000, 13000)).save(media["bomb"])
    media["truncated"] = damaged_media.truncate_file(media["clip"], media_dir / "truncated.mp4", 0.4)
    outside = synthetic_image.make_image(outside_dir / "secret.png", seed=4)
    media["escape"] = media_dir / "escape.png"
    media["escape"].symlink_to(outside)
    try:
        server = ServerProcess(["--allowed-local-media-path", str(media_dir), "--api-key", KEY,
                                "--kv-cache-gb", "0.125", "--patch-buffer-gb", "0.25", *a.server_args.split()],
                               work / "server.log")
    except ServerStartError as e:  # e.g. a bad --server-args flag: the server says which
        print(f"hostile_client.py: error: {e}", file=sys.stderr)
        return 2
    client = Client(server.port)
    pids = [server.proc.pid, *server.health["workers"].values()]
    names = ["api", *server.health["workers"]]
    results, failures = [], 0
    try:
        client.chat({"messages": user(video_part(f"file://{media['clip']}")), "max_tokens": 4})  # warm
        rss_before = rss_mib(pids)
        rounds = []
        cases = build_cases(media, outside)
        for i, (name, body, accepted, secret) in enumerate(cases * a.rounds):  # memory must not keep growing
            if i and i % len(cases) == 0:
                rounds.append(rss_mib(pids))
                print(f"     round {len(rounds)} done: RSS {rounds[-1]:.0f} MiB "
                      f"({', '.join(f'{n} {rss_mib([pid]):.0f}' for n, pid in zip(names, pids))})")
            t0 = time.perf_counter()
            try:
                if body is None:
                    status, raw = special(client, name, media)
                    shown = raw.decode(errors="replace")
                else:
                    status, parsed = client.chat(body)
                    shown = json.dumps(parsed) if not isinstance(parsed, str) else parsed
            except OSError as e:
                status, shown = -1, f"{type(e).__name__}: {e}"
            elapsed = time.perf_counter() - t0
            good = status in accepted and (secret is None or secret not in shown) and elapsed < 60
            if status >= 400 and good:
                good = '"error"' in shown  # an OpenAI-style body
            failures += not good
            results.append({"case": name, "status": status, "ok": good, "seconds": round(elapsed, 3),
                            "body": shown[:200]})
            print(f"{'ok  ' if good else 'FAIL'} {status:>4} {elapsed:6.2f} s  {name}: {shown[:110]!r}")
        # floods and disconnects
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            statuses = list(pool.map(lambda i: client.chat({"messages": [{"role": "user", "content": f"q{i}"}],
                                                            "max_tokens": 8})[0], range(64)))
        flood_ok = all(s == 200 for s in statuses)
        failures += not flood_ok
        results.append({"case": "64 concurrent text requests", "ok": flood_ok, "statuses": sorted(set(statuses))})
        print(f"{'ok  ' if flood_ok else 'FAIL'} 64 concurrent text requests: {sorted(set(statuses))} in "
              f"{time.perf_counter() - t0:.1f} s")
        disconnects(client, media["clip"], 20)
        busy = idle(server)
        failures += bool(busy)
        results.append({"case": "40 disconnects free everything", "ok": not busy, "busy": busy})
        print(f"{'ok  ' if not busy else 'FAIL'} 40 disconnects, then idle: {busy or 'every pool free'}")
        status, _ = client.chat({"messages": user(video_part(f"file://{media['clip']}")), "max_tokens": 4})
        health = json.loads(client.raw("GET", "/health")[1])
        rss_after = rss_mib(pids)
        alive = status == 200 and health.get("status") == "ok"
        failures += not alive
        results.append({"case": "serves after all of it", "ok": alive})
        print(f"{'ok  ' if alive else 'FAIL'} still serving: status {status}, health {health.get('status')}")
        # the first round warms caches and allocator arenas; later rounds must not keep adding to it
        rounds.append(rss_after)
        first, last = rounds[0] - rss_before, rounds[-1] - rounds[1 if len(rounds) > 2 else 0]
        flat = len(rounds) < 3 or last <= max(128.0, 0.25 * first)
        failures += not flat
        results.append({"case": "memory flat after the first round", "ok": flat, "rss_mib": [rss_before, *rounds]})
        print(f"{'ok  ' if flat else 'FAIL'} RSS of all processes (MiB): start {rss_before:.0f}, after each round "
              f"{', '.join(f'{r:.0f}' for r in rounds)} (the last also after floods and disconnects)")
    finally:
        code = server.stop()
    print(f"\n{len(results) - failures}/{len(results)} cases held; server exit {code}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"results": results, "failures": failures, "exit_code": code}, indent=2))
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
