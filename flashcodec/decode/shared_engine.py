"""The process-wide engines, one per device and kept warm, and the one-call :func:`decode_video` on them.

These are the package's ``flashcodec.default_engine`` and ``flashcodec.decode_video``; ``flashcodec``'s
``analyse_bitstream``, ``add_decoding_request`` and ``get_decoding_output`` run on :func:`default_engine` too.
"""

from __future__ import annotations

import threading

from flashcodec.decode.engine import DecodeEngine
from flashcodec.decode.request import DecodedVideo
from flashcodec.devices import parse_devices
from flashcodec.source import SourceLike

_engines: dict[str, DecodeEngine] = {}
_default_lock = threading.Lock()


def default_engine(device: str = "cpu") -> DecodeEngine:
    """The process-wide engine for ``device`` used by the module-level functions (kept warm).

    ``"cpu"``: one slot per core. Other devices as :class:`DecodeEngine` ``devices``; the
    engine, its threads and its NVDEC sessions live as long as the process.
    """
    key = ",".join(parse_devices(device))
    with _default_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = DecodeEngine(devices=device)
        return engine


def decode_video(source: SourceLike, *, device: str = "cpu", backend: str | None = None,
                 num_threads: int | None = None, output_device: str | None = None, **kwargs) -> DecodedVideo:
    """One-call decode on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``).

    The default backend and thread count use the process-wide engine for that device; other
    ``backend``/``num_threads``/``output_device`` values use a private engine for this call.
    ``kwargs`` are :meth:`DecodeEngine.decode_video`'s. Raises what it raises, and
    :class:`~flashcodec.devices.DeviceError` for a device this machine lacks.
    """
    if backend in (None, "auto") and num_threads is None and output_device is None:
        return default_engine(device).decode_video(source, **kwargs)
    with DecodeEngine(backend or "auto", num_threads, devices=device, output_device=output_device) as engine:
        return engine.decode_video(source, **kwargs)
