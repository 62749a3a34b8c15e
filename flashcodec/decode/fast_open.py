"""torchcodec's H.264 opens without FFmpeg's stream-info decode.

Every segment decoder opens the video: each NVDEC session of a GPU rank, each thread of a CPU rank. For H.264,
FFmpeg's stream-info pass decodes the first 7 or more pictures in software at every open, only to guess the
reorder depth: 70 ms per 1080p open through torchcodec on the development machine, about 0.1 s per NVDEC session
on the H100 machine's host, where it was the whole of issue 12's gap to the static GOP split (docs/gpu.md). PyAV's
opens skip it with an option (``pyav.FAST_OPEN_OPTIONS``); torchcodec takes no FFmpeg options.

So this module builds and loads, before torchcodec is imported, a small library (``fast_open.c``) that sits in
front of FFmpeg's ``avformat_find_stream_info`` in the process's global symbol scope. Around one decoder's
constructor, :func:`opening` arms it in that thread, and that open's pass decodes nothing for the video stream;
every other call passes through unchanged. Such a pass leaves the stream's pixel format unset, and torchcodec
0.16's NVDEC interface checks NVDEC's capabilities against it before decoding (with none, it decodes on the CPU),
so the library also sits in front of ``avcodec_parameters_to_context`` and gives the codec context the constructor
makes next the pixel format the probe read off a decoded keyframe (``VideoInfo.pix_fmt``).

An open that decodes nothing leaves the decoder the reorder depth FFmpeg learns without decoding (for MP4, its
demuxer reads it off the composition offsets; the probe records it: ``VideoInfo.open_reorder_depth``). A decoder
holding back fewer frames than the stream reorders would drop pictures, so a video is opened this way only when
that depth covers the one our probe measured over the whole stream (:func:`backends.reorder_depth`). Other
codecs' passes decode nothing already.

Off with ``FLASHCODEC_FAST_OPEN=0``; without a C compiler, or when torchcodec was imported before flashcodec could
load the library, opens are full ones and the reason is logged once. The build is cached under
``$FLASHCODEC_CACHE/native`` (or ``~/.cache/flashcodec/native``), keyed by the source's hash.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Iterator

from flashcodec.devices import log_once

if TYPE_CHECKING:
    from flashcodec._probe import VideoInfo

ENV = "FLASHCODEC_FAST_OPEN"
SOURCE = pathlib.Path(__file__).with_name("fast_open.c")
#: the only codec whose stream-info pass decodes pictures (measured: HEVC's open takes 0.4-0.8 ms)
CODECS = ("h264",)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why opens are full ones; None while unknown or when the library is in effect
_installed = False


def cache_dir() -> pathlib.Path:
    root = os.environ.get("FLASHCODEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flashcodec")
    return pathlib.Path(root) / "native"


def _torchcodec_loaded() -> bool:
    return any(name == "torchcodec" or name.startswith("torchcodec.") for name in sys.modules)


def _build() -> pathlib.Path:
    """The library's path, compiled first if this source has not been (flock-serialised across processes)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"libflashcodec_fast_open-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build it")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-o", tmp, str(SOURCE),
                                   "-ldl"], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def install() -> bool:
    """Load the library into the global symbol scope (once per process; call before importing torchcodec).

    Returns whether torchcodec's opens can skip the decode. Never raises: a failure leaves full opens, and the
    reason is logged once by the first open it slows (:func:`opening`).
    """
    global _lib, _reason, _installed
    with _lock:
        if _installed:
            return _lib is not None
        _installed = True
        if os.environ.get(ENV, "1") == "0":
            _reason = f"{ENV}=0"
        elif not sys.platform.startswith("linux"):
            _reason = f"not built for {sys.platform}"
        elif _torchcodec_loaded():
            _reason = "torchcodec was imported before flashcodec could load its library"
        else:
            try:
                lib = ctypes.CDLL(str(_build()), mode=os.RTLD_GLOBAL | os.RTLD_NOW)
            except Exception as e:  # no compiler, a failed build, a library that will not load
                _reason = " ".join(str(e).split())[:200] or type(e).__name__
            else:
                lib.flashcodec_fast_open_arm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
                lib.flashcodec_fast_open_pending.restype = ctypes.c_int
                lib.flashcodec_fast_open_count.restype = ctypes.c_long
                lib.flashcodec_fast_open_formats_set.restype = ctypes.c_long
                _lib = lib
        return _lib is not None


def _say_full_opens(reason: str) -> None:
    level = logging.INFO if reason.startswith(ENV) else logging.WARNING  # asked for: no warning
    log_once(f"torchcodec's H.264 opens decode pictures in FFmpeg's stream-info pass (~0.1 s each): {reason}", level)


def fast_opens() -> int:
    """Opens in this process whose stream-info pass decoded nothing (0 when the library is not loaded)."""
    return int(_lib.flashcodec_fast_open_count()) if _lib is not None else 0


def formats_set() -> int:
    """Codec contexts in this process given the probe's pixel format after such an open (0 when not loaded)."""
    return int(_lib.flashcodec_fast_open_formats_set()) if _lib is not None else 0


def usable(info: VideoInfo, needed_depth: int) -> bool:
    """Whether a decoder of this video may open without the decode: an H.264 stream whose reorder depth as FFmpeg
    learns it without decoding (``info.open_reorder_depth``, None when unknown) is at least ``needed_depth``, the
    one measured over the whole stream, and whose pixel format the probe knows (the open's pass learns none)."""
    return (info.codec in CODECS and info.open_reorder_depth is not None and info.open_reorder_depth >= needed_depth
            and 0 <= info.stream_index < info.num_streams and bool(info.pix_fmt) and info.pix_fmt.isascii())


@contextlib.contextmanager
def opening(info: VideoInfo, needed_depth: int) -> Iterator[bool]:
    """Around one torchcodec decoder's constructor, in the thread that runs it; yields whether it was armed.

    The arm is consumed by that thread's next ``avformat_find_stream_info`` and dropped on the way out, so it
    never reaches a later open. A constructor that returns with its arm unused means torchcodec's calls do not
    reach the library (bound before it loaded): logged once, and no later open is armed.
    """
    global _lib, _reason
    lib = _lib
    wanted = usable(info, needed_depth)
    if lib is None and _reason is not None and wanted:
        _say_full_opens(_reason)
    armed = lib is not None and wanted
    if armed:
        lib.flashcodec_fast_open_arm(info.stream_index, info.num_streams, info.pix_fmt.encode())
    returned = False
    try:
        yield armed
        returned = True
    finally:
        if armed:
            missed = returned and bool(lib.flashcodec_fast_open_pending())  # a failed open may fail before the pass
            lib.flashcodec_fast_open_disarm()
            if missed:
                with _lock:
                    _lib, _reason = None, "torchcodec's open did not reach flashcodec's library"
                _say_full_opens(_reason)


def give_up(reason: str) -> None:
    """No open in this process skips the decode from now on (an open that skipped it misbehaved); logged once."""
    global _lib, _reason
    with _lock:
        if _lib is None:
            return
        _lib, _reason = None, reason
    _say_full_opens(reason)


@contextlib.contextmanager
def full_opens() -> Iterator[None]:
    """Every open made inside (in any thread) a full one: for measuring what the fast open saves, and for tests."""
    global CODECS
    kept, CODECS = CODECS, ()
    try:
        yield
    finally:
        CODECS = kept


def reason() -> str | None:
    """Why opens are full ones (None when the library is in effect or not yet loaded)."""
    return _reason
