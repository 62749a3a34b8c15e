"""Which devices decode: the ``device`` knob, the visible GPUs, and whether NVDEC can take a video.

Device names: ``"cpu"``, ``"cuda:N"`` (one GPU's NVDEC engines), ``"cuda"`` (every visible GPU)
and ``"auto"`` (every GPU whose NVDEC works here, else none; the CPU always). Lists mix them.

Whether NVDEC works is decided once per process and GPU (:func:`nvdec_unavailable_reason`):
torch must be a CUDA build that sees the GPU, the driver must ship ``libnvcuvid.so.1``, and
torchcodec must be a CUDA build (0.16 is the first on PyPI). Asking for a GPU that does not
exist is an error; a GPU whose NVDEC is unusable hands its work to the CPU rank, with one log line
saying why. Whether NVDEC can take a given video is decided per video from the driver's decoder
caps (:func:`nvdec_reject_reason`): codec, chroma format, bit depth and coded size. H100/A100/H200
have no AV1 and no H.264 4:4:4; such videos go to the CPU rank with one log line saying why.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping, NamedTuple, Sequence

log = logging.getLogger("flashcodec.devices")

__all__ = [
    "CPU_THREAD_FPS", "DEFAULT_NVDEC_SESSIONS", "DEVICE_KINDS", "NVDEC_RANK_FPS", "DeviceError", "RankLayout",
    "ResolvedDevices", "canonical_codec", "log_once", "make_layout", "num_visible_gpus", "nvdec_reject_reason",
    "nvdec_unavailable_reason", "parse_device", "parse_devices", "pix_fmt_layout", "resolve_devices",
    "resolve_output_device", "video_nvdec_engines", "video_nvdec_reason",
]

#: What the device knob accepts besides ``cuda:N``.
DEVICE_KINDS = ("cpu", "cuda", "auto")

_CUDA_N = re.compile(r"cuda:(\d+)")

# Cost model: a rank's speed in 1080p H.264 frames/s. Only ratios matter (the planner splits a
# video's decode cost in proportion; cross-rank steals compare finish times). Replace them with
# measured speeds through ``rank_speeds``.
#: One GPU's NVDEC rank: 14 sessions of one process decoded 3617 fps on the H100 (docs/gpu.md, 2026-11-23).
NVDEC_RANK_FPS = 3617.0
#: One CPU decoder thread: an estimate, not a measurement on the GPU machine. This project's 2-core
#: CI machine decodes 720p H.264 at ~520 frames/s per thread with conversion (docs/benchmarks.md,
#: dense h264: 9000 frames in 8.66 s on 2 threads), scaled by pixel count to 1080p.
CPU_THREAD_FPS = 230.0
#: NVDEC sessions per GPU rank by default: 2 per engine on a 7-engine H100 (14 threads measured
#: at 3617 fps with every engine 92 % busy, 7 threads at 3083; docs/gpu.md, 2026-11-23).
DEFAULT_NVDEC_SESSIONS = 14


class DeviceError(ValueError):
    """A device was asked for that this machine does not have, or a device name is malformed."""


def parse_device(name: str) -> str:
    """Canonical form of one device name: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.

    Raises:
        DeviceError: anything else (the message lists what is accepted).
    """
    if not isinstance(name, str):
        raise DeviceError(f"a device must be a string such as 'cpu' or 'cuda:0', got {type(name).__name__}")
    text = name.strip().lower()
    if text in DEVICE_KINDS or _CUDA_N.fullmatch(text):
        return text if not text.startswith("cuda:") else f"cuda:{int(text[5:])}"
    raise DeviceError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto (or a comma-separated list)")


def parse_devices(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Parse ``"cuda:0,cuda:1"``, ``["cpu", "cuda"]`` or one name into canonical names, in order.

    Duplicates are dropped. Raises :class:`DeviceError` on an empty list or a bad name.
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in parts:
        name = parse_device(part)
        if name not in names:
            names.append(name)
    if not names:
        raise DeviceError("no device given; use cpu, cuda, cuda:N or auto")
    return tuple(names)


def num_visible_gpus() -> int:
    """CUDA devices torch can use here (0 with a CPU-only torch or no driver)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install reports errors of its own kinds; it means no GPU
        return 0


_lock = threading.Lock()
_logged: set[str] = set()


def log_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time it is seen in this process (one line per reason)."""
    with _lock:
        if message in _logged:
            return
        _logged.add(message)
    log.log(level, "flashcodec: %s", message)


def _torchcodec_cuda_reason() -> str | None:
    from flashcodec.decode import fast_open

    fast_open.install()  # before torchcodec loads FFmpeg
    try:
        import torchcodec
        import torchcodec.decoders  # noqa: F401  (loads FFmpeg: fails here when its libraries are missing)
    except ImportError:
        return "torchcodec >= 0.16 (a CUDA build) is not installed"
    except Exception as e:  # torchcodec raises OSError/RuntimeError when FFmpeg's libraries are missing
        from flashcodec._errors import first_line

        return f"torchcodec cannot load ({first_line(e)})"
    version = getattr(torchcodec, "__version__", "")
    if "+cpu" in version:
        return f"torchcodec {version} is a CPU-only build"
    # torchcodec >= 0.16 imports without FFmpeg (its image decoders need none) and stubs its FFmpeg ops, which
    # then raise when called: an NVDEC session would fail at its first call instead of here
    if hasattr(torchcodec, "ffmpeg_major_version") and torchcodec.ffmpeg_major_version is None:
        return f"torchcodec {version} finds no FFmpeg libraries it can load (it decodes video through them)"
    return None


def gpu_unavailable_reason(device_index: int) -> str | None:
    """Why torch cannot use GPU ``device_index`` here (a CPU-only build, no GPU, no such index), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    count = num_visible_gpus()
    if count == 0:
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    if not 0 <= device_index < count:
        return f"there is no cuda:{device_index} ({count} GPU{'s' if count > 1 else ''} visible)"
    return None


@lru_cache(maxsize=None)
def nvdec_unavailable_reason(device_index: int) -> str | None:
    """Why NVDEC cannot be used on GPU ``device_index`` in this process, or None when it can.

    Checks, in order: a CUDA build of torch that sees the GPU, ``libnvcuvid.so.1`` (the driver's
    video decoder), a CUDA build of torchcodec. Cached: the answer does not change in a process.
    """
    reason = gpu_unavailable_reason(device_index)
    if reason is not None:
        return reason
    from flashcodec.nvcuvid import NvcuvidError, num_gpus

    try:
        if num_gpus() == 0:
            return "the NVIDIA driver reports no GPU"
    except NvcuvidError as e:
        return str(e)
    return _torchcodec_cuda_reason()


class ResolvedDevices(NamedTuple):
    gpus: list[int]  # GPUs whose NVDEC decodes, ascending
    cpu_named: bool  # "cpu" or "auto" was given: the CPU rank shares every video
    asked_gpus: list[int]  # every GPU named, NVDEC usable or not (outputs may live there)


def resolve_devices(spec: str | Sequence[str], *,
                    unavailable_reason: Callable[[int], str | None] = nvdec_unavailable_reason,
                    gpu_count: Callable[[], int] = num_visible_gpus) -> ResolvedDevices:
    """Turn a device spec into the GPUs whose NVDEC to use.

    ``"cuda"`` is every visible GPU, ``"cuda:N"`` one, ``"auto"`` every GPU where NVDEC works.
    A named GPU whose NVDEC is unusable (no ``libnvcuvid``, a CPU-only torchcodec) is no error:
    its work goes to the CPU rank, and the reason is logged once (so is ``auto``'s, at INFO).
    ``unavailable_reason`` and ``gpu_count`` are the probes (replaced by fakes in tests).

    Raises:
        DeviceError: ``cuda`` / ``cuda:N`` was asked for and there is no such GPU (none visible,
            a CPU-only torch, or an ordinal past the last GPU); the message says why.
    """
    names = parse_devices(spec)
    count = gpu_count()
    gpus: list[int] = []
    asked: list[int] = []
    for name in names:
        if name == "cpu":
            continue
        if name == "auto":
            working = [i for i in range(count) if unavailable_reason(i) is None]
            if not working:
                reason = unavailable_reason(0) if count else "no CUDA GPU is visible"
                log_once(f"device auto decodes on the CPU: NVDEC is not usable ({reason})", logging.INFO)
            gpus += working
            continue
        indices = list(range(count)) if name == "cuda" else [int(name[5:])]
        missing = [i for i in indices if i >= count]
        if not indices or missing:
            why = unavailable_reason(missing[0] if missing else 0) or f"only {count} GPUs are visible"
            raise DeviceError(f"device {name} was asked for, but {why}; use device cpu or auto")
        for i in indices:
            asked.append(i)
            reason = unavailable_reason(i)
            if reason is None:
                gpus.append(i)
            else:
                log_once(f"cuda:{i}'s share goes to the CPU rank: NVDEC is not usable there ({reason})")
    return ResolvedDevices(sorted(set(gpus)), "cpu" in names or "auto" in names, sorted(set(asked)))


#: ``pix_fmt`` prefixes -> chroma format (NVDEC's names).
_CHROMA = (("gray", "400"), ("yuvj420", "420"), ("yuvj422", "422"), ("yuvj444", "444"), ("yuv420", "420"),
           ("yuv422", "422"), ("yuv444", "444"), ("nv12", "420"), ("nv21", "420"), ("p010", "420"),
           ("p016", "420"), ("nv16", "422"), ("p210", "422"), ("p410", "444"))


def pix_fmt_layout(pix_fmt: str | None) -> tuple[str, int] | None:
    """``(chroma_format, bit_depth)`` of an FFmpeg pixel format, or None for one NVDEC never outputs.

    ``"yuv420p"`` -> ``("420", 8)``, ``"yuv420p10le"`` -> ``("420", 10)``, ``"yuvj444p"`` ->
    ``("444", 8)``, ``"gray10le"`` -> ``("400", 10)``; RGB and other packed formats -> None.
    """
    if not pix_fmt:
        return None
    for prefix, chroma in _CHROMA:
        if pix_fmt.startswith(prefix):
            rest = pix_fmt[len(prefix):]
            if prefix in ("p010", "p210", "p410"):
                return chroma, 10
            if prefix == "p016":
                return chroma, 16
            depth = re.match(r"p?(\d+)", rest)
            return chroma, int(depth.group(1)) if depth else 8
    return None


def nvdec_reject_reason(codec: str, pix_fmt: str | None, width: int, height: int,
                        caps: Callable[[str, str, int], object]) -> str | None:
    """Why NVDEC cannot decode a stream, or None when the driver's caps say it can.

    Args:
        codec: FFmpeg's codec name (``VideoInfo.codec``).
        pix_fmt: the stream's pixel format (``VideoInfo.pix_fmt``).
        width, height: the coded (stored) size.
        caps: ``caps(codec, chroma_format, bit_depth)`` -> an object with ``is_supported``,
            ``num_engines`` and ``fits(width, height)`` (:func:`flashcodec.nvcuvid.decoder_caps`
            for one GPU, or a fake in tests).

    Returns:
        a short reason such as ``"NVDEC has no av1 420 8-bit decoder"``, or None.
    """
    layout = pix_fmt_layout(pix_fmt)
    if layout is None:
        return f"pixel format {pix_fmt or 'unknown'} is not a YUV format NVDEC decodes"
    chroma, depth = layout
    c = caps(codec, chroma, depth)
    if not c.is_supported or not c.num_engines:
        return f"NVDEC has no {codec} {chroma} {depth}-bit decoder"
    if not c.fits(width, height):
        return (f"{width}x{height} is outside NVDEC's {codec} limits "
                f"({c.min_width}x{c.min_height} to {c.max_width}x{c.max_height})")
    return None


def canonical_codec(decoder_name: str) -> str:
    """The codec a decoder decodes: ``VideoInfo.codec`` names FFmpeg's decoder (``libdav1d`` for AV1)."""
    try:
        import av

        return av.Codec(decoder_name, "r").canonical_name
    except Exception:  # an unknown name stays as it is (and NVDEC has no entry for it)
        return decoder_name


def video_nvdec_engines(info, device_index: int) -> int | None:
    """NVDEC engines of GPU ``device_index`` that decode this video's configuration; None when the driver
    cannot say (no driver, or a configuration :func:`video_nvdec_reason` rejects)."""
    from flashcodec.nvcuvid import decoder_caps

    layout = pix_fmt_layout(info.pix_fmt)
    if layout is None:
        return None
    try:
        return decoder_caps(canonical_codec(info.codec), layout[0], layout[1], device_index).num_engines or None
    except Exception:  # an estimate's input: unknown is an answer
        return None


def video_nvdec_reason(info, device_index: int) -> str | None:
    """:func:`nvdec_reject_reason` for a probed video on GPU ``device_index`` (asks the driver)."""
    from flashcodec.nvcuvid import NvcuvidError, decoder_caps

    if info.shared_pts:  # torchcodec (NVDEC's front end) seeks by pts: it returns the frame next to the one asked for
        return "its frames share timestamps, which NVDEC's torchcodec sessions misplace"
    try:
        return nvdec_reject_reason(canonical_codec(info.codec), info.pix_fmt, info.width, info.height,
                                   lambda codec, chroma, depth: decoder_caps(codec, chroma, depth, device_index))
    except (NvcuvidError, ValueError) as e:
        return f"the driver's decoder caps could not be read ({e})"


@dataclass(frozen=True)
class RankLayout:
    """An engine's ranks: one per GPU (NVDEC sessions), then the CPU rank, and who takes which video.

    ``cpu_shares`` says whether the CPU rank decodes alongside NVDEC (``"cpu"`` or ``"auto"`` was
    among the devices) or only takes what NVDEC cannot (``"cuda"`` / ``"cuda:N"`` alone).
    """

    gpus: tuple[int, ...]
    nvdec_sessions: int
    cpu_threads: int  # 0: no CPU rank
    cpu_shares: bool
    speeds: tuple[float, ...]  # frames/s per rank, GPU ranks first
    output_gpu: int | None = None  # where outputs live by default: the first GPU named (or used)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"cuda:{i}" for i in self.gpus) + (("cpu",) if self.cpu_threads else ())

    def shares(self, nvdec_reason: Callable[[int], str | None]) -> tuple[list[float], frozenset[int], str | None]:
        """Each rank's planning speed for one video, the ranks allowed to decode it, and why not NVDEC.

        Args:
            nvdec_reason: ``nvdec_reason(gpu_ordinal)`` -> why NVDEC there cannot take this video, or None.

        Returns:
            ``(speeds, allowed_ranks, reason)``: speed 0 for a rank that gets no share; ``reason``
            is the first GPU's rejection (None when every GPU takes the video or there is none).

        Raises:
            DeviceError: no rank can decode the video (NVDEC cannot and ``cpu_threads`` is 0).
        """
        speeds, allowed, reason = [], set(), None
        for rank, gpu in enumerate(self.gpus):
            why = nvdec_reason(gpu)
            reason = reason or why
            speeds.append(0.0 if why else self.speeds[rank])
            if not why:
                allowed.add(rank)
        if self.cpu_threads:
            cpu = len(self.gpus)
            if self.cpu_shares or not allowed:
                speeds.append(self.speeds[cpu])
                allowed.add(cpu)
            else:
                speeds.append(0.0)
        if not allowed:
            raise DeviceError(f"NVDEC cannot decode this video ({reason}) and the engine has no CPU rank; "
                              "give it cpu_threads > 0")
        return speeds, frozenset(allowed), reason

    def fallback_ranks(self, allowed: frozenset[int] | None) -> frozenset[int]:
        """Ranks that take a video only once every rank in ``allowed`` (:meth:`shares`; None: all) has failed it
        (a session that cannot be created): the CPU rank, when the GPUs alone take the video."""
        cpu = len(self.gpus)
        return frozenset({cpu}) if allowed is not None and self.cpu_threads and cpu not in allowed else frozenset()

    def slot_speeds(self, speeds: Sequence[float], nvdec_engines: Callable[[int], int | None]) -> list[float]:
        """One decoder slot's speed per rank while it runs, for the planner's finish times.

        A CPU thread has a core: the rank's speed over its threads. NVDEC sessions share the GPU's
        engines (two per engine by default), and a session left running alone has an engine to itself,
        so it runs at the rank's speed over ``min(sessions, engines)`` (on the H100, 2026-11-23: one
        session 498-529 frames/s, 14 sessions 3617 together).

        Args:
            speeds: each rank's planning speed (:meth:`shares`).
            nvdec_engines: ``nvdec_engines(gpu_ordinal)`` -> engines that decode this video there, or None
                when unknown (then the sessions are taken as sharing nothing: the rank's speed over them).
        """
        out = []
        for rank, gpu in enumerate(self.gpus):
            engines = nvdec_engines(gpu) if speeds[rank] > 0 else None
            units = min(self.nvdec_sessions, engines) if engines else self.nvdec_sessions
            out.append(speeds[rank] / units)
        if self.cpu_threads:
            out.append(speeds[len(self.gpus)] / self.cpu_threads)
        return out


#: Host cores one GPU's NVDEC rank keeps busy (its session threads feed packets and launch the colour conversion and
#: resize): 2.48 measured on the H100, 14 sessions of 1080p H.264 at 3071 frames/s (docs/gpu.md, third session).
#: The CPU rank's default thread count leaves them free: there, with a CPU decoder thread on each of the 16 cores
#: beside it, the GPU rank decoded at 2630 frames/s instead of 3071.
NVDEC_HOST_CORES = 3


def default_cpu_threads(num_gpus: int = 0, cores: int | None = None) -> int:
    """The CPU rank's decoder threads when none are given: one per core, less :data:`NVDEC_HOST_CORES` per GPU
    rank, at least one."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, cores - NVDEC_HOST_CORES * num_gpus)


#: Decoder threads of a CPU rank at most: each is an OS thread with its own decoder; past a few per core
#: they only add memory (asking for 100,000 used to fail inside thread creation).
MAX_CPU_THREADS = 1024


def make_layout(devices: str | Sequence[str] = "cpu", cpu_threads: int | None = None,
                nvdec_sessions: int = DEFAULT_NVDEC_SESSIONS, rank_speeds: Mapping[str, float] | None = None,
                **probes) -> RankLayout:
    """Resolve an engine's device options into a :class:`RankLayout`.

    Args:
        devices: the device knob (see :func:`resolve_devices`).
        cpu_threads: decoder threads of the CPU rank (default: :func:`default_cpu_threads`, one per core less
            :data:`NVDEC_HOST_CORES` per GPU rank); 0 leaves no CPU
            rank, allowed only with GPUs (videos NVDEC cannot take then fail with a clear error).
        nvdec_sessions: concurrent NVDEC sessions (slots) per GPU rank.
        rank_speeds: frames/s per rank name (``"cpu"``, ``"cuda:0"``) replacing the cost model's
            defaults (:data:`NVDEC_RANK_FPS`, ``cpu_threads x`` :data:`CPU_THREAD_FPS`).
        probes: fakes for :func:`resolve_devices` in tests.

    Raises:
        DeviceError: a device that is not here or a bad name; ValueError: bad counts or speeds.
    """
    gpus, cpu_named, asked = resolve_devices(devices, **probes)
    threads = default_cpu_threads(len(gpus)) if cpu_threads is None else cpu_threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0 or (threads == 0 and not gpus):
        raise ValueError(f"cpu_threads must be a positive integer (0 only with GPUs whose NVDEC works), "
                         f"got {cpu_threads!r}")
    if threads > MAX_CPU_THREADS:
        raise ValueError(f"cpu_threads must be at most {MAX_CPU_THREADS} (one decoder thread each; this machine has "
                         f"{os.cpu_count()} cores), got {threads}")
    if isinstance(nvdec_sessions, bool) or not isinstance(nvdec_sessions, int) or nvdec_sessions < 1:
        raise ValueError(f"nvdec_sessions must be a positive integer, got {nvdec_sessions!r}")
    layout = RankLayout(tuple(gpus), nvdec_sessions, threads, cpu_named or not gpus, ())
    defaults = {name: NVDEC_RANK_FPS for name in layout.names if name != "cpu"}
    defaults["cpu"] = threads * CPU_THREAD_FPS
    given = dict(rank_speeds or {})
    unknown = sorted(set(given) - set(layout.names))
    if unknown or any(not float(v) > 0 for v in given.values()):
        raise ValueError(f"rank_speeds must map some of {', '.join(layout.names)} to positive frames/s, got {given}")
    speeds = tuple(float(given.get(name, defaults[name])) for name in layout.names)
    output_gpu = (asked or gpus or [None])[0]
    return RankLayout(layout.gpus, nvdec_sessions, threads, layout.cpu_shares, speeds, output_gpu)


def resolve_output_device(device, default_gpu: int | None):
    """The ``torch.device`` outputs live on: ``device`` if given, else ``cuda:default_gpu``, else the CPU.

    Raises:
        ValueError: not ``cpu`` / ``cuda`` / ``cuda:N``; DeviceError: a CUDA device that is not visible.
    """
    import torch

    if device is None:
        return torch.device("cuda", default_gpu) if default_gpu is not None else torch.device("cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"output_device must be cpu or cuda:N, got {device!r}") from None
    if out.type == "cuda":
        index = out.index if out.index is not None else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise DeviceError(f"output_device {device} is not a visible CUDA device")
        return torch.device("cuda", index)
    if out.type != "cpu":
        raise ValueError(f"output_device must be cpu or cuda:N, got {device!r}")
    return out
