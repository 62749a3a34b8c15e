"""Media URL resolution under the server's policy: file://, data: and http(s) (127.0.0.1 only)."""

import base64
import http.server
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from unifiedserve.server import media
from unifiedserve.server.media import MediaError, MediaPolicy, describe, resolve_media

CLIP_BYTES = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256))


def file_url(path) -> str:
    return "file://" + urllib.parse.quote(str(path))


def data_url(payload: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


@pytest.fixture
def media_root(tmp_path) -> Path:
    """``tmp_path/data`` holding ``clip.mp4``; the directory a local policy allows."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "clip.mp4").write_bytes(CLIP_BYTES)
    return root


@pytest.fixture
def local(media_root) -> MediaPolicy:
    return MediaPolicy(allowed_local_media_path=media_root)


# --- file:// ------------------------------------------------------------------------------------


def test_allowed_file_resolves_to_its_real_path(media_root, local):
    path = media_root / "clip.mp4"
    for url in (file_url(path), "file://localhost" + urllib.parse.quote(str(path))):
        got = resolve_media(url, local)
        assert got.path == os.path.realpath(media_root / "clip.mp4")
        assert got.data is None and got.kind_hint is None and got.source == got.path
        assert Path(got.source).read_bytes() == CLIP_BYTES


def test_percent_encoded_file_name_with_space(media_root, local):
    (media_root / "my clip.mp4").write_bytes(b"spaced")
    url = file_url(media_root / "my clip.mp4")
    assert "%20" in url
    assert Path(resolve_media(url, local).path).read_bytes() == b"spaced"


def test_hash_in_file_name_must_be_percent_encoded(media_root, local):
    (media_root / "a#b.mp4").write_bytes(b"hash")
    assert Path(resolve_media(file_url(media_root / "a#b.mp4"), local).path).read_bytes() == b"hash"
    with pytest.raises(MediaError, match="percent-encode"):
        resolve_media(f"file://{media_root}/a#b.mp4", local)


def test_file_outside_allowed_dir_is_refused_without_leaking_paths(tmp_path, media_root, local):
    outside = tmp_path / "secret.mp4"
    outside.write_bytes(b"secret")
    with pytest.raises(MediaError, match="outside the directory allowed") as e:
        resolve_media(file_url(outside), local)
    assert str(media_root) not in str(e.value)


@pytest.mark.parametrize("tail", ["/../secret.mp4", "/sub/../clip.mp4", "/%2E%2E/secret.mp4"])
def test_dotdot_component_is_refused(tmp_path, media_root, local, tail):
    (tmp_path / "secret.mp4").write_bytes(b"secret")
    (media_root / "sub").mkdir()
    with pytest.raises(MediaError, match=r"'\.\.'"):
        resolve_media("file://" + urllib.parse.quote(str(media_root)) + tail, local)


def test_dots_inside_a_name_are_fine(media_root, local):
    (media_root / "a..b.mp4").write_bytes(b"dots")
    assert Path(resolve_media(file_url(media_root / "a..b.mp4"), local).path).read_bytes() == b"dots"


def test_symlink_escaping_the_allowed_dir_is_refused(tmp_path, media_root, local):
    outside = tmp_path / "secret.mp4"
    outside.write_bytes(b"secret")
    (media_root / "link.mp4").symlink_to(outside)
    (media_root / "linkdir").symlink_to(tmp_path)
    for url in (file_url(media_root / "link.mp4"), file_url(media_root / "linkdir" / "secret.mp4")):
        with pytest.raises(MediaError, match="outside the directory allowed") as e:
            resolve_media(url, local)
        assert str(outside) not in str(e.value)


def test_symlink_within_the_allowed_dir_is_followed(media_root, local):
    (media_root / "sub").mkdir()
    (media_root / "sub" / "link.mp4").symlink_to(media_root / "clip.mp4")
    got = resolve_media(file_url(media_root / "sub" / "link.mp4"), local)
    assert got.path == os.path.realpath(media_root / "clip.mp4")


def test_allowed_dir_reached_through_a_symlink(tmp_path, media_root):
    (tmp_path / "alias").symlink_to(media_root)
    policy = MediaPolicy(allowed_local_media_path=tmp_path / "alias")
    got = resolve_media(file_url(tmp_path / "alias" / "clip.mp4"), policy)
    assert Path(got.path).read_bytes() == CLIP_BYTES


def test_sibling_dir_sharing_a_name_prefix_is_refused(tmp_path, local):
    (tmp_path / "data2").mkdir()
    (tmp_path / "data2" / "clip.mp4").write_bytes(b"sibling")
    with pytest.raises(MediaError, match="outside the directory allowed"):
        resolve_media(file_url(tmp_path / "data2" / "clip.mp4"), local)


def test_missing_file(media_root, local):
    with pytest.raises(MediaError, match="not found"):
        resolve_media(file_url(media_root / "nope.mp4"), local)
    with pytest.raises(MediaError, match="not found"):  # a file used as a directory
        resolve_media(file_url(media_root / "clip.mp4" / "x"), local)


def test_directory_is_not_a_regular_file(media_root, local):
    (media_root / "sub").mkdir()
    for url in (file_url(media_root / "sub"), file_url(media_root)):
        with pytest.raises(MediaError, match="not a regular file"):
            resolve_media(url, local)


def test_file_urls_refused_without_allowed_dir(media_root):
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        resolve_media(file_url(media_root / "clip.mp4"), MediaPolicy())


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file://otherhost/{root}/clip.mp4", "must be local"),
        ("file:clip.mp4", "not an absolute path"),
        ("file://{root}/clip%00.mp4", "NUL"),
        ("file://{root}/clip.mp4?x=1", "percent-encode"),
    ],
)
def test_malformed_file_urls(media_root, local, url, reason):
    with pytest.raises(MediaError, match=reason):
        resolve_media(url.format(root=media_root), local)


# --- data: ---------------------------------------------------------------------------------------


def test_data_url_decodes():
    got = resolve_media(data_url(CLIP_BYTES, "Video/MP4"), MediaPolicy())
    assert got.data == CLIP_BYTES and got.source == CLIP_BYTES
    assert got.path is None and got.kind_hint == "video/mp4"
    assert "bytes>" in repr(got) and str(CLIP_BYTES[:8]) not in repr(got)
    no_mime = resolve_media("data:;base64," + base64.b64encode(b"abc").decode(), MediaPolicy())
    assert no_mime.data == b"abc" and no_mime.kind_hint is None


@pytest.mark.parametrize(
    "payload", ["@@@@", "QUJDRA", "QUJD REVG", "QUJD\nREVG", "QQ==QQ==", "QUJD-_8=", "QUJDé"]
)
def test_data_url_with_bad_base64(payload):
    with pytest.raises(MediaError, match="not valid base64"):
        resolve_media("data:video/mp4;base64," + payload, MediaPolicy())


@pytest.mark.parametrize("url", ["data:text/plain,hello", "data:video/mp4,AAAA", "data:base64,AAAA"])
def test_non_base64_data_url(url):
    with pytest.raises(MediaError, match="not base64"):
        resolve_media(url, MediaPolicy())


@pytest.mark.parametrize(
    ("url", "reason"), [("data:video/mp4;base64,", "empty"), ("data:video/mp4;base64", "malformed")]
)
def test_empty_or_malformed_data_url(url, reason):
    with pytest.raises(MediaError, match=reason):
        resolve_media(url, MediaPolicy())


@pytest.mark.parametrize("num_bytes", range(1, 16))
def test_data_url_limit_is_exact(num_bytes):
    """A limit of 10 (or 12, a multiple of 3) bytes admits exactly that many, whatever the padding."""
    for limit in (10, 12):
        url = data_url(bytes(range(num_bytes)))
        policy = MediaPolicy(max_media_bytes=limit)
        if num_bytes <= limit:
            assert resolve_media(url, policy).data == bytes(range(num_bytes))
        else:
            with pytest.raises(MediaError, match=f"{num_bytes} bytes, over the server's limit of {limit}"):
                resolve_media(url, policy)


def test_oversized_data_url_is_refused_before_decoding(monkeypatch):
    def must_not_decode(*args, **kwargs):
        raise AssertionError("payload was decoded")

    monkeypatch.setattr(media.binascii, "a2b_base64", must_not_decode)
    with pytest.raises(MediaError, match="over the server's limit of 1000 bytes"):
        resolve_media("data:video/mp4;base64," + "A" * 4000, MediaPolicy(max_media_bytes=1000))


# --- other schemes, describe, policy -------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://127.0.0.1/clip.mp4", "unsupported media URL scheme 'ftp'"),
        ("s3://bucket/clip.mp4", "unsupported media URL scheme 's3'"),
        ("/abs/clip.mp4", "has no scheme"),
        ("clip.mp4", "has no scheme"),
        (" file:///abs/clip.mp4", "whitespace"),
        ("http://127.0.0.1/a\nb", "control characters"),
    ],
)
def test_unknown_or_malformed_urls(url, reason):
    with pytest.raises(MediaError, match=reason) as e:
        resolve_media(url, MediaPolicy(allowed_media_domains=("127.0.0.1",)))
    if "scheme" in reason:
        assert "file:///" in str(e.value) and "data:" in str(e.value) and "http(s)://" in str(e.value)


def test_describe_shortens():
    assert describe("data:video/mp4;base64," + "A" * 1000) == "data:video/mp4;base64,...(1000 chars)"
    long = "http://example.com/" + "x" * 500
    assert describe(long) == long[:200] + "..."
    assert describe("file:///a\nb") == "file:///a\\nb"
    assert describe("file:///short.mp4") == "file:///short.mp4"


def test_policy_validation(tmp_path):
    with pytest.raises(ValueError, match="not an existing directory"):
        MediaPolicy(allowed_local_media_path=tmp_path / "missing")
    for bad in ("https://example.com", "example.com:8080", "", "a/b"):
        with pytest.raises(ValueError, match="not a hostname"):
            MediaPolicy(allowed_media_domains=(bad,))
    with pytest.raises(ValueError, match="not one string"):
        MediaPolicy(allowed_media_domains="example.com")
    with pytest.raises(ValueError, match="max_media_bytes"):
        MediaPolicy(max_media_bytes=0)
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path), allowed_media_domains=["Example.COM", "::1"])
    assert policy.allowed_media_domains == ("example.com", "::1")
    assert policy.allowed_local_media_path == tmp_path


# --- http(s):// against a server on 127.0.0.1 ----------------------------------------------------

LIMIT = 1000


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code, body=b"", headers=(), content_length=True):
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        if content_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        routes = {
            "/clip.mp4": lambda: self._send(200, CLIP_BYTES, [("Content-Type", "video/mp4; codecs=avc1")]),
            "/exact": lambda: self._send(200, b"x" * LIMIT, content_length=False),
            "/big-length": lambda: self._send(200, b"x" * (LIMIT + 1)),
            "/big-body": lambda: self._send(200, b"x" * (LIMIT + 1), content_length=False),
            "/empty": lambda: self._send(200),
            "/to-clip": lambda: self._send(302, headers=[("Location", "/clip.mp4")]),
            "/to-localhost": lambda: self._send(302, headers=[("Location", f"http://localhost:{port}/clip.mp4")]),
            "/to-ftp": lambda: self._send(302, headers=[("Location", f"ftp://127.0.0.1:{port}/clip.mp4")]),
            "/to-file": lambda: self._send(302, headers=[("Location", "file:///etc/passwd")]),
            "/stall": self._stall,
            "/drip": self._drip,
        }
        routes.get(self.path, lambda: self._send(404, b"no such media"))()

    def _stall(self):
        self.server.stop.wait(5)

    def _drip(self):
        self.send_response(200)
        self.send_header("Content-Length", str(LIMIT))
        self.end_headers()
        for _ in range(LIMIT):
            if self.server.stop.wait(0.02):
                return
            self.wfile.write(b"x")
            self.wfile.flush()


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # clients that time out leave broken pipes behind


@pytest.fixture(scope="module")
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.stop = threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.stop.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def web(monkeypatch) -> MediaPolicy:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return MediaPolicy(allowed_media_domains=("127.0.0.1",), max_media_bytes=LIMIT, download_timeout_s=2.0)


def test_download_from_allowed_host(server, web):
    got = resolve_media(server + "/clip.mp4", web)
    assert got.data == CLIP_BYTES and got.path is None and got.kind_hint == "video/mp4"
    assert resolve_media(server + "/exact", web).data == b"x" * LIMIT


def test_http_refused_for_hosts_not_allowed(server, web):
    with pytest.raises(MediaError, match="'localhost' is not allowed; add it to --allowed-media-domains"):
        resolve_media(server.replace("127.0.0.1", "localhost") + "/clip.mp4", web)
    with pytest.raises(MediaError, match="started without --allowed-media-domains"):
        resolve_media(server + "/clip.mp4", MediaPolicy())


@pytest.mark.parametrize("netloc", ["evil.example%2F@127.0.0.1", "user:pw@127.0.0.1", "127.0.0.1:notaport"])
def test_http_host_part_with_user_info_or_escapes_is_refused(web, netloc):
    with pytest.raises(MediaError, match="user info or escapes|malformed"):
        resolve_media(f"http://{netloc}/clip.mp4", web)


def test_http_404(server, web):
    with pytest.raises(MediaError, match="HTTP 404"):
        resolve_media(server + "/missing.mp4", web)


def test_oversized_download_is_refused(server, web):
    with pytest.raises(MediaError, match=f"Content-Length {LIMIT + 1}, over the server's limit"):
        resolve_media(server + "/big-length", web)
    with pytest.raises(MediaError, match=f"larger than the server's limit of {LIMIT} bytes"):
        resolve_media(server + "/big-body", web)


def test_empty_download_is_refused(server, web):
    with pytest.raises(MediaError, match="empty body"):
        resolve_media(server + "/empty", web)


def test_redirect_within_allowed_host_is_followed(server, web):
    assert resolve_media(server + "/to-clip", web).data == CLIP_BYTES


@pytest.mark.parametrize(("path", "reason"), [
    ("/to-localhost", "refused redirect .*'localhost' is not allowed"),
    ("/to-ftp", "refused redirect .*only http"),
    ("/to-file", "HTTP 302 .*not allowed"),
])
def test_redirect_off_the_allowed_hosts_is_refused(server, web, path, reason):
    with pytest.raises(MediaError, match=reason):
        resolve_media(server + path, web)


def test_timeouts(server, web):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_media_bytes=LIMIT, download_timeout_s=0.3)
    for path in ("/stall", "/drip"):  # no response at all; a response too slow in total
        start = time.monotonic()
        with pytest.raises(MediaError, match="timed out after 0.3 s"):
            resolve_media(server + path, policy)
        assert time.monotonic() - start < 2.0


def test_connection_refused(web):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaError, match="could not fetch"):
        resolve_media(f"http://127.0.0.1:{port}/clip.mp4", web)

