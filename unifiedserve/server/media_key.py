"""Media identity: one key per (media content, everything that changes its visual tokens).

The key names what the model would see, so two requests with the same key get the same visual
tokens. It is used by the prefix cache (visual tokens in a KV block are hashed by their media's
key), the media cache (encoded visual tokens kept per key) and, past one node, the router (a
video's questions go to the replica that holds its caches).

What goes in:

* the content: for a local file its resolved path, size, modification and status-change times (ns),
  inode and device, so a file changed or replaced on disk gets a new key and is never served from a
  stale entry (the file is not read: hashing a multi-GB video per request would cost more than the
  cache saves). The status-change time catches a rewrite that kept the size and set the old
  modification time back (``touch -r``, a tool that preserves times): no call sets it but the
  kernel's own, at any change; for in-memory bytes (``data:`` URLs, downloads) a BLAKE2b digest of the bytes;
* every option that changes the tokens: kind, ``fps``, ``max_frames``, ``min_pixels``,
  ``max_pixels`` and the server's pixel ceiling;
* a server-wide ``context`` string the caller adds (the model and the resize mode).

Keys are 32 hex characters (BLAKE2b-128).
"""

from __future__ import annotations

import hashlib
import os

from unifiedserve.runtime.protocol import MediaRef

__all__ = ["media_key", "content_fingerprint"]


def content_fingerprint(path: str | None = None, data: bytes | None = None) -> str:
    """What identifies the media's bytes: a digest of ``data``, or the file's identity on disk.

    Raises:
        OSError: ``path`` cannot be stat'ed.
        ValueError: neither or both of ``path`` and ``data`` are given.
    """
    if (path is None) == (data is None):
        raise ValueError("give exactly one of path and data")
    if data is not None:
        return "bytes:" + hashlib.blake2b(data, digest_size=16).hexdigest()
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"file:{real}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"


def media_key(ref: MediaRef, context: str = "") -> str:
    """The key of ``ref``: content fingerprint + token-changing options + ``context``.

    Args:
        ref: the media as the api resolved it (``path`` or ``data`` set).
        context: server-wide facts that change the tokens (model, resize mode).

    Raises:
        OSError: a local file vanished since it was resolved.
    """
    parts = [context, ref.kind, content_fingerprint(ref.path, ref.data),
             repr((ref.fps, ref.max_frames, ref.min_pixels, ref.max_pixels, ref.pixel_ceiling))]
    return hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
