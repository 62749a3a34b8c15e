"""Media keys: a file's identity on disk, bytes' digest, and the options that change the tokens."""

import os
import time

from unifiedserve.runtime.protocol import MediaRef
from unifiedserve.server.media_key import content_fingerprint, media_key


def test_a_rewrite_that_keeps_the_size_and_the_modification_time_is_a_new_key(tmp_path):
    """Written again in place with other bytes of the same length, then its modification time set back (as a
    tool that preserves times does): the same path, size, mtime and inode, and still a new key."""
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"a" * 4096)
    before = os.stat(path)
    first = media_key(MediaRef("video", path=str(path)))
    time.sleep(0.01)
    with open(path, "r+b") as f:  # in place: the inode stays
        f.write(b"b" * 4096)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert media_key(MediaRef("video", path=str(path))) != first
    assert media_key(MediaRef("video", path=str(path))) == media_key(MediaRef("video", path=str(path)))


def test_bytes_and_options_key():
    assert content_fingerprint(data=b"x") == content_fingerprint(data=b"x") != content_fingerprint(data=b"y")
    assert media_key(MediaRef("video", data=b"x", fps=1.0)) != media_key(MediaRef("video", data=b"x", fps=2.0))
    assert media_key(MediaRef("video", data=b"x"), "model-a") != media_key(MediaRef("video", data=b"x"), "model-b")
