"""How busy the GPUs' video (NVDEC) and JPEG (NVJPG) engines are, read through NVML (nvidia-ml-py).

Two kinds of reading per GPU:

- the driver's aggregates over all engines of a kind, ``nvmlDeviceGetDecoderUtilization`` and
  ``nvmlDeviceGetJpgUtilization`` (percent over the driver's own sampling period);
- per engine, through GPM (GPU Performance Monitoring, Hopper and later): the metrics
  ``NVML_GPM_METRIC_NVDEC_{i}_UTIL`` / ``NVML_GPM_METRIC_NVJPG_{i}_UTIL`` between two GPM samples,
  here the previous reading and this one. The first reading of a session therefore has no
  per-engine values. Where the GPU or driver has no GPM (pre-Hopper GPUs, some VMs) the
  per-engine values stay unread and :attr:`GpuReading.notes` says why.

NVML numbers GPUs in its own order (every GPU of the machine, ``CUDA_VISIBLE_DEVICES`` ignored).
Nothing here needs CUDA or torch, and NVML is imported lazily: without nvidia-ml-py or a driver,
:func:`open_nvml` raises :class:`TelemetryUnavailable` with the reason.

:class:`TelemetrySampler` records readings in a thread during a decode and summarises them (mean
and max per engine, how many engines were busy); :func:`register_prometheus` exports the latest
reading as gauges on each scrape.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["GpuReading", "GpuSummary", "Nvml", "TelemetrySampler", "TelemetryUnavailable", "nvml_index",
           "open_nvml", "register_prometheus", "summarize"]

#: GPM metric ids of engine 0 (``pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL``, ``..._NVJPG_0_UTIL``);
#: engine ``i`` is the base plus ``i``.
_NVDEC_0, _NVJPG_0 = 30, 40
#: GPM defines eight metrics of each kind (an H100 has 7 NVDECs and 7 NVJPGs).
MAX_ENGINES = 8
#: Engines at or above this mean utilisation count as busy in a summary.
DEFAULT_BUSY_PCT = 50.0


class TelemetryUnavailable(RuntimeError):
    """NVML cannot be used here: nvidia-ml-py is missing, no driver, or no GPU. The message says which."""


def _reason(e: BaseException) -> str:
    return " ".join(str(e).split())[:160] or type(e).__name__


@dataclass(frozen=True)
class GpuReading:
    """One reading of one GPU. ``None``: not readable (see ``notes``); per-engine tuples are percents."""

    gpu: int  # NVML index
    time_s: float  # time.monotonic() of the reading
    decoder_pct: float | None
    jpeg_pct: float | None
    nvdec_pct: tuple[float, ...] | None  # per NVDEC engine, since the previous reading (GPM)
    nvjpg_pct: tuple[float, ...] | None  # per NVJPG engine, since the previous reading (GPM)
    notes: tuple[str, ...] = ()


class Nvml:
    """An NVML session over some GPUs, reading their decoder and JPEG engine utilisation.

    Args:
        nvml: the ``pynvml`` module (nvidia-ml-py), or a stand-in with the same functions.
        gpus: NVML indices to read; default every GPU.
        num_nvdec_engines: how many NVDEC engines the GPUs have (e.g. from
            :func:`flashcodec.nvcuvid.decoder_caps`); per-engine NVDEC values are cut to it.
            Default: every engine whose GPM metric NVML answers (up to 8; a GPU with fewer may
            report the missing ones as 0).
        num_nvjpg_engines: the same for NVJPG.

    Use :func:`open_nvml` to get one with the real module. Thread-safe; :meth:`close` ends it.
    """

    def __init__(self, nvml: Any, gpus: Sequence[int] | None = None, *, num_nvdec_engines: int | None = None,
                 num_nvjpg_engines: int | None = None):
        for name, n in (("num_nvdec_engines", num_nvdec_engines), ("num_nvjpg_engines", num_nvjpg_engines)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ENGINES):
                raise ValueError(f"{name} must be 1..{MAX_ENGINES}, got {n!r}")
        self._nvml = nvml
        self._lock = threading.Lock()
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise TelemetryUnavailable(f"NVML cannot start ({_reason(e)})") from e
        self._open = True
        try:
            count = nvml.nvmlDeviceGetCount()
            self.gpus = tuple(range(count)) if gpus is None else tuple(gpus)
            if not self.gpus or any(not 0 <= g < count for g in self.gpus):
                raise TelemetryUnavailable(f"NVML sees {count} GPU(s); asked for {list(self.gpus)}")
            self._handles = {g: nvml.nvmlDeviceGetHandleByIndex(g) for g in self.gpus}
        except BaseException:
            self.close()
            raise
        self._engines = {_NVDEC_0: num_nvdec_engines or MAX_ENGINES, _NVJPG_0: num_nvjpg_engines or MAX_ENGINES}
        self._gpm: dict[int, list] = {}  # gpu -> [previous sample or None, spare sample]
        self.gpm_reasons: dict[int, str] = {}  # gpu -> why per-engine values cannot be read
        for g, h in self._handles.items():
            self._start_gpm(g, h)

    def _start_gpm(self, gpu: int, handle) -> None:
        nvml = self._nvml
        try:
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                self.gpm_reasons[gpu] = "per-engine values need GPM, which this GPU does not support"
                return
            self._gpm[gpu] = [None, nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        except Exception as e:  # an older driver lacks the GPM functions altogether
            self.gpm_reasons[gpu] = f"per-engine values need GPM, which cannot be queried here ({_reason(e)})"

    def _engine_values(self, gpu: int, handle) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """Per-engine NVDEC and NVJPG percents since the previous call (None on the first call)."""
        nvml = self._nvml
        prev, a, b = self._gpm[gpu]
        current = b if prev is a else a
        nvml.nvmlGpmSampleGet(handle, current)
        self._gpm[gpu][0] = current
        if prev is None:
            return None, None
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        ids = [base + i for base in (_NVDEC_0, _NVJPG_0) for i in range(self._engines[base])]
        request.numMetrics = len(ids)
        request.sample1, request.sample2 = prev, current
        for slot, metric_id in enumerate(ids):
            request.metrics[slot].metricId = metric_id
        nvml.nvmlGpmMetricsGet(request)
        values: dict[int, list[float]] = {_NVDEC_0: [], _NVJPG_0: []}
        for slot, metric_id in enumerate(ids):
            m = request.metrics[slot]
            base = _NVDEC_0 if metric_id < _NVJPG_0 else _NVJPG_0
            # an engine the GPU lacks answers with an error: the list ends at the first one
            if m.nvmlReturn == 0 and len(values[base]) == metric_id - base:
                values[base].append(float(m.value))
        return tuple(values[_NVDEC_0]) or None, tuple(values[_NVJPG_0]) or None

    def read(self) -> list[GpuReading]:
        """One reading per GPU, now. Errors of single calls become ``None`` values with a note."""
        with self._lock:
            if not self._open:
                raise RuntimeError("this NVML session is closed")
            readings = []
            for g, h in self._handles.items():
                notes: list[str] = []
                aggregate = {}
                for key, fn in (("decoder", "nvmlDeviceGetDecoderUtilization"),
                                ("jpeg", "nvmlDeviceGetJpgUtilization")):
                    try:
                        aggregate[key] = float(getattr(self._nvml, fn)(h)[0])
                    except Exception as e:  # NOT_SUPPORTED on GPUs without that engine kind
                        aggregate[key] = None
                        notes.append(f"{key} utilisation cannot be read ({_reason(e)})")
                nvdec = nvjpg = None
                if g in self._gpm:
                    try:
                        nvdec, nvjpg = self._engine_values(g, h)
                    except Exception as e:
                        notes.append(f"per-engine GPM metrics cannot be read ({_reason(e)})")
                else:
                    notes.append(self.gpm_reasons[g])
                readings.append(GpuReading(g, time.monotonic(), aggregate["decoder"], aggregate["jpeg"],
                                           nvdec, nvjpg, tuple(notes)))
            return readings

    def close(self) -> None:
        """Free the GPM samples and shut NVML down (once; later calls do nothing)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            for _, *samples in getattr(self, "_gpm", {}).values():
                for s in samples:
                    try:
                        self._nvml.nvmlGpmSampleFree(s)
                    except Exception:  # freeing at shutdown: nothing useful to do with an error
                        pass
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def __enter__(self) -> "Nvml":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_nvml(gpus: Sequence[int] | None = None, **engines) -> Nvml:
    """An :class:`Nvml` session with nvidia-ml-py's ``pynvml``.

    Raises:
        TelemetryUnavailable: nvidia-ml-py is not installed, NVML cannot start, or no GPU.
    """
    try:
        import pynvml
    except ImportError as e:
        raise TelemetryUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from e
    return Nvml(pynvml, gpus, **engines)


def nvml_index(cuda_device: int, nvml: Any = None, uuid: str | None = None) -> int:
    """NVML's index of the GPU that this process calls ``cuda:<cuda_device>``.

    The two numberings differ whenever ``CUDA_VISIBLE_DEVICES`` or ``CUDA_DEVICE_ORDER`` (CUDA's default
    order is fastest first, NVML's is PCI bus order) picks or reorders GPUs: NVML ignores both. The
    GPU's UUID is the same in both, so it is matched by UUID.

    Args:
        nvml: the ``pynvml`` module or a stand-in (default: nvidia-ml-py's).
        uuid: the device's UUID (default: torch's ``get_device_properties(cuda_device).uuid``).
    Raises:
        TelemetryUnavailable: no NVML, or NVML does not know the UUID.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:
            raise TelemetryUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from e
    if uuid is None:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_device).uuid)
    name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise TelemetryUnavailable(f"NVML cannot start ({_reason(e)})") from e
    try:
        return int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(name)))
    except Exception as e:
        raise TelemetryUnavailable(f"NVML does not know cuda:{cuda_device} ({name}: {_reason(e)})") from e
    finally:
        nvml.nvmlShutdown()


@dataclass(frozen=True)
class GpuSummary:
    """A GPU's engine use over a sampled interval."""

    gpu: int
    num_samples: int
    duration_s: float
    decoder_pct: tuple[float, float] | None  # (mean, max)
    jpeg_pct: tuple[float, float] | None
    nvdec_mean_pct: tuple[float, ...] | None  # per engine
    nvdec_max_pct: tuple[float, ...] | None
    nvjpg_mean_pct: tuple[float, ...] | None
    nvjpg_max_pct: tuple[float, ...] | None
    busy_pct: float  # the threshold of num_*_busy
    num_nvdec_busy: int | None  # engines whose mean is >= busy_pct
    num_nvjpg_busy: int | None
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    def lines(self) -> list[str]:
        """Human-readable lines, e.g. for ``flashcodec bench``."""
        def pair(v):
            return f"mean {v[0]:.0f}% max {v[1]:.0f}%" if v else "not readable"

        out = [f"gpu {self.gpu}: decoder {pair(self.decoder_pct)}, jpeg {pair(self.jpeg_pct)} "
               f"({self.num_samples} samples over {self.duration_s:.1f} s)"]
        for kind, means, busy in (("NVDEC", self.nvdec_mean_pct, self.num_nvdec_busy),
                                  ("NVJPG", self.nvjpg_mean_pct, self.num_nvjpg_busy)):
            if means:
                out.append(f"gpu {self.gpu}: {kind} per engine (mean %): " + " ".join(f"{v:.0f}" for v in means)
                           + f"; {busy} of {len(means)} engines busy >= {self.busy_pct:.0f}%")
        out += [f"gpu {self.gpu}: {note}" for note in self.notes]
        return out


def _mean_max(values: list[float]) -> tuple[float, float] | None:
    return (sum(values) / len(values), max(values)) if values else None


def _per_engine(rows: list[tuple[float, ...]]) -> tuple[tuple[float, ...], tuple[float, ...]] | tuple[None, None]:
    if not rows:
        return None, None
    n = min(len(r) for r in rows)
    cols = [[r[i] for r in rows] for i in range(n)]
    return tuple(sum(c) / len(c) for c in cols), tuple(max(c) for c in cols)


def summarize(readings: Sequence[GpuReading], busy_pct: float = DEFAULT_BUSY_PCT) -> list[GpuSummary]:
    """Summarise readings per GPU: mean and max of each value, engines busy >= ``busy_pct`` on average."""
    by_gpu: dict[int, list[GpuReading]] = {}
    for r in readings:
        by_gpu.setdefault(r.gpu, []).append(r)
    out = []
    for gpu, rows in sorted(by_gpu.items()):
        nvdec_mean, nvdec_max = _per_engine([r.nvdec_pct for r in rows if r.nvdec_pct])
        nvjpg_mean, nvjpg_max = _per_engine([r.nvjpg_pct for r in rows if r.nvjpg_pct])
        notes = tuple(dict.fromkeys(n for r in rows for n in r.notes))
        out.append(GpuSummary(
            gpu, len(rows), rows[-1].time_s - rows[0].time_s,
            _mean_max([r.decoder_pct for r in rows if r.decoder_pct is not None]),
            _mean_max([r.jpeg_pct for r in rows if r.jpeg_pct is not None]),
            nvdec_mean, nvdec_max, nvjpg_mean, nvjpg_max, busy_pct,
            None if nvdec_mean is None else sum(v >= busy_pct for v in nvdec_mean),
            None if nvjpg_mean is None else sum(v >= busy_pct for v in nvjpg_mean), notes))
    return out


class TelemetrySampler:
    """Reads NVML every ``interval_s`` in a thread while a workload runs; summarises at the end.

    Usage::

        with TelemetrySampler() as sampler:
            engine.decode_video(...)
        for s in sampler.summary():
            print("\\n".join(s.lines()))

    Args:
        interval_s: seconds between readings (GPM values cover each interval; >= 0.1 s keeps
            them meaningful).
        nvml: an open :class:`Nvml`, used and left open; or a zero-argument factory (default
            :func:`open_nvml`) whose session the sampler closes when it stops.

    Without NVML the sampler does not fail: :attr:`unavailable` says why and the summary is empty.
    """

    def __init__(self, interval_s: float = 0.25, nvml: Nvml | Callable[[], Nvml] | None = None):
        if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self.readings: list[GpuReading] = []
        self.unavailable: str | None = None
        self._owned = not isinstance(nvml, Nvml)
        try:
            self._nvml = nvml if isinstance(nvml, Nvml) else (nvml or open_nvml)()
        except TelemetryUnavailable as e:
            self._nvml, self.unavailable = None, str(e)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TelemetrySampler":
        """Take a first reading (the GPM baseline) and start the sampling thread."""
        if self._thread is not None:
            raise RuntimeError("the sampler was already started")
        if self._nvml is not None:
            self.readings += self._nvml.read()
            self._thread = threading.Thread(target=self._run, name="flashcodec-telemetry", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.readings += self._nvml.read()

    def stop(self) -> list[GpuSummary]:
        """Take a last reading, stop the thread and return :meth:`summary`."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.readings += self._nvml.read()
        if self._nvml is not None and self._owned:
            self._nvml.close()
        return self.summary()

    def summary(self, busy_pct: float = DEFAULT_BUSY_PCT) -> list[GpuSummary]:
        """Per-GPU summary of the readings so far (empty without NVML)."""
        return summarize(self.readings, busy_pct)

    def __enter__(self) -> "TelemetrySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def register_prometheus(registry, nvml: Nvml | Callable[[], Nvml] | None = None, prefix: str = "flashcodec") -> bool:
    """Export GPU engine utilisation as gauges of ``registry``, read from NVML at each scrape.

    Gauges (label ``gpu``, and ``engine`` for the per-engine ones): ``{prefix}_decoder_utilization_percent``,
    ``{prefix}_jpeg_utilization_percent``, ``{prefix}_nvdec_engine_utilization_percent`` and
    ``{prefix}_nvjpg_engine_utilization_percent`` (GPM, over the time since the previous scrape).

    Returns:
        True when registered; False, registering nothing, when NVML cannot be used here.
    """
    try:
        session = nvml if isinstance(nvml, Nvml) else (nvml or open_nvml)()
    except TelemetryUnavailable:
        return False
    from prometheus_client.core import GaugeMetricFamily

    session.read()  # the GPM baseline: the first scrape then has per-engine values too

    class _Collector:
        def collect(self):
            families = {
                "decoder": GaugeMetricFamily(f"{prefix}_decoder_utilization_percent",
                                             "NVDEC utilisation over all engines (NVML).", labels=["gpu"]),
                "jpeg": GaugeMetricFamily(f"{prefix}_jpeg_utilization_percent",
                                          "NVJPG utilisation over all engines (NVML).", labels=["gpu"]),
                "nvdec": GaugeMetricFamily(f"{prefix}_nvdec_engine_utilization_percent",
                                           "Utilisation of each NVDEC engine since the previous scrape (NVML GPM).",
                                           labels=["gpu", "engine"]),
                "nvjpg": GaugeMetricFamily(f"{prefix}_nvjpg_engine_utilization_percent",
                                           "Utilisation of each NVJPG engine since the previous scrape (NVML GPM).",
                                           labels=["gpu", "engine"]),
            }
            try:
                readings = session.read()
            except Exception:  # a lost GPU must not break the rest of /metrics
                readings = []
            for r in readings:
                for key, value in (("decoder", r.decoder_pct), ("jpeg", r.jpeg_pct)):
                    if value is not None:
                        families[key].add_metric([str(r.gpu)], value)
                for key, values in (("nvdec", r.nvdec_pct), ("nvjpg", r.nvjpg_pct)):
                    for engine, value in enumerate(values or ()):
                        families[key].add_metric([str(r.gpu), str(engine)], value)
            yield from families.values()

    registry.register(_Collector())
    return True
