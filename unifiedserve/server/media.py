"""Media URLs from chat requests (``image_url.url`` / ``video_url.url``) -> a file path or bytes.

The client names media in one of three ways, each off unless the server allows it:

* ``file:///abs/path`` — only under ``--allowed-local-media-path``. ``..`` components are refused
  outright, then the path is resolved (symlinks included) and must stay inside that directory.
* ``data:<mime>;base64,<payload>`` — strict base64, at most ``max_media_bytes`` once decoded.
* ``http(s)://host/...`` — only for hosts in ``--allowed-media-domains``, redirects included.

Every refusal is a ``MediaError`` (a ``ValueError``; the API maps it to HTTP 400) whose message is
one line naming the problem. Messages quote only what the client sent (via ``describe``), never the
server's resolved paths or the allowed directory.
"""

from __future__ import annotations

import binascii
import http.client
import os
import re
import stat
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

__all__ = ["MediaError", "MediaPolicy", "ResolvedMedia", "check_declared_type", "describe", "resolve_media"]

_ACCEPTED = "accepted media URLs are file:///path, data:<mime>;base64,<payload> and http(s)://host/path"
_READ_CHUNK_BYTES = 1 << 20
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class MediaError(ValueError):
    """The client's media reference cannot be used (maps to HTTP 400).

    ``str(e)`` is a one-line message meant for the client.
    """


@dataclass(frozen=True)
class MediaPolicy:
    """Which media URLs the server accepts; the defaults accept only ``data:`` URLs.

    ``allowed_media_domains`` are bare hostnames (``"example.com"``, no scheme or port) matched
    exactly and case-insensitively. ``max_media_bytes`` bounds decoded ``data:`` payloads and
    downloads, not local files. ``download_timeout_s`` bounds each socket operation and also the
    whole download.
    """

    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_media_bytes: int = 512 * 2**20
    download_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            path = Path(self.allowed_local_media_path)
            if not path.is_dir():
                raise ValueError(
                    f"--allowed-local-media-path {str(path)!r} is not an existing directory; "
                    "create it or point the flag at the directory holding your media"
                )
            object.__setattr__(self, "allowed_local_media_path", path)
        if isinstance(self.allowed_media_domains, str):
            raise ValueError("allowed_media_domains must be a sequence of hostnames, not one string")
        domains = tuple(d.strip().lower() for d in self.allowed_media_domains)
        for domain in domains:
            # One ':' is host:port; IPv6 literals such as '::1' have several.
            if not domain or any(c in domain for c in "/@ \t") or domain.count(":") == 1:
                raise ValueError(
                    f"--allowed-media-domains entry {domain!r} is not a hostname; give bare "
                    "hostnames such as 'example.com' (no scheme, port or path)"
                )
        object.__setattr__(self, "allowed_media_domains", domains)
        if self.max_media_bytes <= 0:
            raise ValueError(f"max_media_bytes must be positive, got {self.max_media_bytes}")
        if self.download_timeout_s <= 0:
            raise ValueError(f"download_timeout_s must be positive, got {self.download_timeout_s}")


@dataclass(frozen=True)
class ResolvedMedia:
    """Media the decoder can open: exactly one of ``path`` (a local file) and ``data`` is set."""

    path: str | None  # resolved local file path (file:// URLs)
    data: bytes | None  # in-memory bytes (data: URLs, downloads)
    kind_hint: str | None  # MIME type from the data: URL or Content-Type header, if any

    def __post_init__(self) -> None:
        assert (self.path is None) != (self.data is None), "exactly one of path and data is set"

    @property
    def source(self) -> str | bytes:
        """The path or the bytes, whichever is set."""
        return self.path if self.path is not None else self.data

    def __repr__(self) -> str:
        data = None if self.data is None else f"<{len(self.data)} bytes>"
        return f"ResolvedMedia(path={self.path!r}, data={data}, kind_hint={self.kind_hint!r})"


def describe(url: str) -> str:
    """A short, printable, one-line form of ``url`` for logs and error messages.

    ``data:`` URLs become ``data:<mime>;base64,...(<n> chars)``; others are cut to 200 chars.
    """
    if url[:5].lower() == "data:":
        comma = url.find(",", 5, 5 + 200)
        if comma < 0:
            short = f"data:...({len(url) - 5} chars)"
        else:
            short = f"data:{url[5:comma]},...({len(url) - comma - 1} chars)"
    else:
        short = url if len(url) <= 200 else url[:200] + "..."
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in short)


def resolve_media(url: str, policy: MediaPolicy) -> ResolvedMedia:
    """Check ``url`` against ``policy`` and make it something the decoder can open.

    Args:
        url: the ``image_url.url`` / ``video_url.url`` string from the request.
        policy: what the server was started to allow.

    Returns:
        ``ResolvedMedia`` with ``path`` for ``file://`` URLs (resolved, inside the allowed
        directory) or ``data`` for ``data:`` URLs and downloads.

    Raises:
        MediaError: the URL is malformed, not allowed by the policy, too large, or cannot be
            read or fetched.
    """
    if not isinstance(url, str):
        raise MediaError(f"media URL must be a string, got {type(url).__name__}")
    if url[:1].isspace() or url[-1:].isspace():
        raise MediaError(f"media URL {describe(url)} has leading or trailing whitespace")
    if url[:5].lower() == "data:":
        return _resolve_data(url, policy)
    if _CONTROL_CHARS.search(url):
        raise MediaError(f"media URL {describe(url)} contains control characters")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise MediaError(f"malformed media URL {describe(url)}; {_ACCEPTED}") from None
    if parts.scheme == "file":
        return _resolve_file(url, parts, policy)
    if parts.scheme in ("http", "https"):
        return _download(url, policy)
    if not parts.scheme:
        raise MediaError(f"media URL {describe(url)} has no scheme; {_ACCEPTED}")
    raise MediaError(f"unsupported media URL scheme {parts.scheme!r}; {_ACCEPTED}")


# --- file:// -------------------------------------------------------------------------------------


def _resolve_file(url: str, parts: SplitResult, policy: MediaPolicy) -> ResolvedMedia:
    if policy.allowed_local_media_path is None:
        raise MediaError(
            "file:// media URLs are disabled: the server was started without --allowed-local-media-path"
        )
    shown = describe(url)
    if parts.netloc.lower() not in ("", "localhost"):
        raise MediaError(f"{shown} names host {parts.netloc!r}; file:// URLs must be local (file:///path)")
    if "?" in url or "#" in url:
        raise MediaError(f"{shown} contains '?' or '#'; percent-encode them in file names (%3F, %23)")
    # surrogateescape keeps non-UTF-8 file names (valid on Linux) reachable via percent-encoding.
    path = unquote(parts.path, errors="surrogateescape")
    if not path.startswith("/"):
        raise MediaError(f"{shown} is not an absolute path; use file:///absolute/path")
    if "\x00" in path:
        raise MediaError(f"{shown} contains a NUL byte")
    if ".." in path.split("/"):
        raise MediaError(f"{shown} contains a '..' path component, which is not allowed")
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)  # follows symlinks, so a link pointing outside is caught below
    if os.path.commonpath([root, real]) != root:
        raise MediaError(f"{shown} is outside the directory allowed by --allowed-local-media-path")
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise MediaError(f"media file not found: {shown}") from None
    except OSError as e:
        raise MediaError(f"cannot access media file {shown}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise MediaError(f"{shown} is not a regular file")
    return ResolvedMedia(path=real, data=None, kind_hint=None)


# --- data: ---------------------------------------------------------------------------------------


def _resolve_data(url: str, policy: MediaPolicy) -> ResolvedMedia:
    shown = describe(url)
    comma = url.find(",", 5)
    if comma < 0:
        raise MediaError(f"malformed data: URL {shown}; expected data:<mime>;base64,<payload>")
    params = url[5:comma].split(";")
    if len(params) < 2 or params[-1].lower() != "base64":
        raise MediaError(f"data: URL {shown} is not base64; only data:<mime>;base64,<payload> is supported")
    num_chars = len(url) - comma - 1
    if num_chars == 0:
        raise MediaError("data: URL has an empty payload")
    # Exact decoded size of valid base64, known before decoding (and before copying the payload).
    num_padding = len(url[-2:]) - len(url[-2:].rstrip("="))
    num_bytes = num_chars * 3 // 4 - num_padding
    limit = policy.max_media_bytes
    if num_bytes > limit:
        raise MediaError(f"data: URL payload is {num_bytes} bytes, over the server's limit of {limit} bytes")
    try:
        data = binascii.a2b_base64(url[comma + 1 :], strict_mode=True)
    except ValueError as e:  # binascii.Error, or non-ASCII characters
        raise MediaError(f"data: URL payload is not valid base64 ({e})") from None
    if not data:
        raise MediaError("data: URL has an empty payload")
    if len(data) > limit:
        raise MediaError(f"data: URL payload is {len(data)} bytes, over the server's limit of {limit} bytes")
    return ResolvedMedia(path=None, data=data, kind_hint=_mime(params[0]))


#: Declared types that say nothing about the content: accepted for images and videos alike.
_GENERIC_TYPES = frozenset({"application/octet-stream", "binary/octet-stream"})
#: Other declared types a video part may carry besides ``video/*``.
_VIDEO_APPLICATION_TYPES = frozenset({"application/mp4", "application/ogg", "application/x-matroska"})


def check_declared_type(found: ResolvedMedia, kind: str, shown: str) -> None:
    """Refuse media whose declared type (a ``data:`` URL's MIME type, a download's Content-Type) is not ``kind``:
    ``text/plain`` bytes in a ``video_url`` are the client's mistake, said as such (a download that returns an
    HTML error page too), rather than decoded as whatever the bytes happen to be. No declared type, or a
    generic one, passes: the decoder then decides.

    Raises:
        MediaError: naming the declared type and the one expected.
    """
    hint = found.kind_hint
    if hint is None or hint in _GENERIC_TYPES or hint.startswith(f"{kind}/"):
        return
    if kind == "video" and hint in _VIDEO_APPLICATION_TYPES:
        return
    raise MediaError(f"{shown} is declared {hint}, not {'an image' if kind == 'image' else 'a video'} "
                     f"({kind}/*); send it as the part that matches its type")


def _mime(content_type: str | None) -> str | None:
    """``'Video/MP4; codecs=x'`` -> ``'video/mp4'``; empty or missing -> None."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


# --- http(s):// ----------------------------------------------------------------------------------


def _check_http_url(url: str, policy: MediaPolicy) -> None:
    """Raise MediaError unless ``url`` is http(s) to an allowed host (initial URL and redirects)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise MediaError(f"malformed URL {describe(url)}") from None
    if parts.scheme not in ("http", "https"):
        raise MediaError(f"only http(s) URLs can be fetched, not {describe(url)}")
    if not policy.allowed_media_domains:
        raise MediaError(
            "http(s) media URLs are disabled: the server was started without --allowed-media-domains"
        )
    # urllib.request percent-decodes the host it connects to and does not drop user info, so a
    # netloc with either could connect somewhere other than the hostname checked below.
    if any(c in parts.netloc for c in "@%\\"):
        raise MediaError(f"{describe(url)}: user info or escapes in the host part are not supported")
    host = parts.hostname
    if not host:
        raise MediaError(f"{describe(url)} has no host")
    if host not in policy.allowed_media_domains:
        raise MediaError(f"media host {host!r} is not allowed; add it to --allowed-media-domains")


class _AllowedHostsRedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only when its target passes the same host check as the first URL."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            _check_http_url(newurl, self.policy)
        except MediaError as e:
            fp.close()
            raise MediaError(f"refused redirect from {describe(req.full_url)}: {e}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, policy: MediaPolicy) -> ResolvedMedia:
    _check_http_url(url, policy)
    shown = describe(url)
    limit = policy.max_media_bytes
    deadline = time.monotonic() + policy.download_timeout_s
    opener = urllib.request.build_opener(_AllowedHostsRedirectHandler(policy))
    request = urllib.request.Request(url, headers={"User-Agent": "unifiedserve"})
    try:
        with opener.open(request, timeout=policy.download_timeout_s) as response:
            length = response.headers.get("Content-Length", "")
            if length.strip().isdigit() and int(length) > limit:
                raise MediaError(
                    f"{shown} has Content-Length {int(length)}, over the server's limit of {limit} bytes"
                )
            chunks, num_bytes = [], 0
            while True:
                # read1 returns after one socket read, so a slowly dripping body hits the deadline.
                chunk = response.read1(min(_READ_CHUNK_BYTES, limit + 1 - num_bytes))
                if not chunk:
                    break
                chunks.append(chunk)
                num_bytes += len(chunk)
                if num_bytes > limit:
                    raise MediaError(f"{shown} is larger than the server's limit of {limit} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError
            kind_hint = _mime(response.headers.get("Content-Type"))
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        e.close()
        raise MediaError(f"fetching {shown} failed: HTTP {e.code} {_one_line(e.reason)}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise MediaError(_timed_out(shown, policy)) from None
        raise MediaError(f"could not fetch {shown}: {_one_line(e.reason)}") from None
    except TimeoutError:
        raise MediaError(_timed_out(shown, policy)) from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise MediaError(f"could not fetch {shown}: {_one_line(e) or type(e).__name__}") from None
    if num_bytes == 0:
        raise MediaError(f"{shown} returned an empty body")
    return ResolvedMedia(path=None, data=b"".join(chunks), kind_hint=kind_hint)


def _timed_out(shown: str, policy: MediaPolicy) -> str:
    return f"fetching {shown} timed out after {policy.download_timeout_s:g} s"


def _one_line(reason: object) -> str:
    return " ".join(str(reason).split())
