"""NVML telemetry with a fake pynvml: aggregates, per-engine GPM values, what cannot be read, the
sampler's summary and the Prometheus gauges; on a GPU, real NVML readings."""

import types

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from flashcodec.telemetry import (
    GpuReading,
    Nvml,
    TelemetrySampler,
    TelemetryUnavailable,
    open_nvml,
    register_prometheus,
    summarize,
)


class FakeNvmlError(Exception):
    pass


class _Metric:
    def __init__(self):
        self.metricId, self.nvmlReturn, self.value = 0, 0, 0.0


class _MetricsGet:
    def __init__(self):
        self.version = self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [_Metric() for _ in range(477)]


def fake_nvml(num_gpus=1, nvdec=(90.0,) * 7, nvjpg=(0.0,) * 7, gpm=True, jpg_supported=True, init_error=None):
    """A pynvml stand-in: GPU ``g``'s NVDEC engine ``i`` reads ``nvdec[i] + step`` (step: the sample
    count), engines past ``len(nvdec)`` answer NOT_SUPPORTED, as for engines a GPU lacks."""
    state = types.SimpleNamespace(samples=0, freed=0, shutdown=0, inits=0)

    class Sample:
        def __init__(self):
            self.step = None

    def init():
        if init_error:
            raise FakeNvmlError(init_error)
        state.inits += 1

    def sample_get(handle, sample):
        state.samples += 1
        sample.step = state.samples
        return sample

    def metrics_get(req):
        assert req.version == 1 and req.sample1 is not req.sample2
        for m in req.metrics[: req.numMetrics]:
            table, base = (nvdec, 30) if m.metricId < 40 else (nvjpg, 40)
            i = m.metricId - base
            m.nvmlReturn = 0 if i < len(table) else 3
            m.value = table[i] + req.sample2.step if i < len(table) else 0.0
        return req

    def jpg(handle):
        if not jpg_supported:
            raise FakeNvmlError("Not Supported")
        return [12, 166666]

    def gpm_support(handle):
        if gpm is None:
            raise FakeNvmlError("Function Not Found")
        return types.SimpleNamespace(isSupportedDevice=int(gpm))

    module = types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=lambda: setattr(state, "shutdown", state.shutdown + 1),
        nvmlDeviceGetCount=lambda: num_gpus, nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetDecoderUtilization=lambda h: [75, 166666], nvmlDeviceGetJpgUtilization=jpg,
        nvmlGpmQueryDeviceSupport=gpm_support, nvmlGpmSampleAlloc=Sample, nvmlGpmSampleGet=sample_get,
        nvmlGpmSampleFree=lambda s: setattr(state, "freed", state.freed + 1), nvmlGpmMetricsGet=metrics_get,
        c_nvmlGpmMetricsGet_t=_MetricsGet, NVML_GPM_METRICS_GET_VERSION=1)
    return module, state


def test_readings_aggregates_and_per_engine_gpm():
    module, state = fake_nvml(nvdec=(10.0, 20.0, 30.0), nvjpg=(5.0,))
    with Nvml(module) as nvml:
        first = nvml.read()[0]
        second = nvml.read()[0]
    assert first.decoder_pct == 75.0 and first.jpeg_pct == 12.0
    assert first.nvdec_pct is None and first.nvjpg_pct is None  # GPM needs two samples
    assert second.nvdec_pct == (12.0, 22.0, 32.0)  # cut at the first engine NVML does not answer for
    assert second.nvjpg_pct == (7.0,)
    assert second.notes == ()
    assert state.freed == 2 and state.shutdown == 1


def test_engine_counts_cut_the_lists():
    module, _ = fake_nvml(nvdec=(50.0,) * 8)
    with Nvml(module, num_nvdec_engines=7, num_nvjpg_engines=2) as nvml:
        nvml.read()
        r = nvml.read()[0]
    assert len(r.nvdec_pct) == 7 and len(r.nvjpg_pct) == 2
    with pytest.raises(ValueError, match="num_nvdec_engines"):
        Nvml(module, num_nvdec_engines=9)


@pytest.mark.parametrize("gpm, expected", [(False, "does not support"), (None, "cannot be queried")])
def test_without_gpm_the_reason_is_noted(gpm, expected):
    module, _ = fake_nvml(gpm=gpm, jpg_supported=False)
    with Nvml(module) as nvml:
        nvml.read()
        r = nvml.read()[0]
    assert r.decoder_pct == 75.0 and r.jpeg_pct is None and r.nvdec_pct is None
    assert any(expected in n for n in r.notes) and any("jpeg utilisation cannot be read" in n for n in r.notes)


def test_nvml_that_cannot_start_is_telemetry_unavailable():
    module, _ = fake_nvml(init_error="NVML Shared Library Not Found")
    with pytest.raises(TelemetryUnavailable, match="Library Not Found"):
        Nvml(module)
    module, state = fake_nvml(num_gpus=1)
    with pytest.raises(TelemetryUnavailable, match="asked for"):
        Nvml(module, gpus=[3])
    assert state.shutdown == 1  # a failed constructor leaves NVML shut


def test_open_nvml_without_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(TelemetryUnavailable, match="nvidia-ml-py is not installed"):
        open_nvml()


def test_summarize_means_maxima_and_busy_engines():
    rows = [GpuReading(0, 0.0, 40.0, 0.0, None, None),
            GpuReading(0, 1.0, 80.0, 10.0, (90.0, 40.0, 70.0), (0.0,)),
            GpuReading(0, 2.0, 90.0, 20.0, (100.0, 60.0, 30.0), (4.0,), ("a note",)),
            GpuReading(1, 0.5, None, None, None, None, ("no GPM",))]
    s0, s1 = summarize(rows, busy_pct=50.0)
    assert s0.num_samples == 3 and s0.duration_s == 2.0
    assert s0.decoder_pct == (70.0, 90.0) and s0.jpeg_pct == (10.0, 20.0)
    assert s0.nvdec_mean_pct == (95.0, 50.0, 50.0) and s0.nvdec_max_pct == (100.0, 60.0, 70.0)
    assert s0.num_nvdec_busy == 3 and s0.num_nvjpg_busy == 0
    assert s0.notes == ("a note",)
    assert s1.decoder_pct is None and s1.num_nvdec_busy is None
    text = "\n".join(s0.lines() + s1.lines())
    assert "3 of 3 engines busy >= 50%" in text and "gpu 1: decoder not readable" in text and "no GPM" in text
    assert s0.as_dict()["nvdec_mean_pct"] == [95.0, 50.0, 50.0]


def test_sampler_records_a_time_series():
    module, state = fake_nvml(nvdec=(60.0,) * 7)
    with TelemetrySampler(interval_s=0.01, nvml=lambda: Nvml(module, num_nvdec_engines=7)) as sampler:
        while len(sampler.readings) < 4:
            pass
    (summary,) = sampler.summary()
    assert summary.num_samples >= 5  # baseline + >= 3 in the thread + the last one
    assert len(summary.nvdec_mean_pct) == 7 and summary.num_nvdec_busy == 7
    assert state.shutdown == 1  # the sampler opened the session, so it closed it
    times = [r.time_s for r in sampler.readings]
    assert times == sorted(times)


def test_sampler_without_nvml_is_empty_and_says_why():
    module, _ = fake_nvml(init_error="Driver Not Loaded")
    sampler = TelemetrySampler(nvml=lambda: Nvml(module))
    with sampler:
        pass
    assert sampler.summary() == [] and "Driver Not Loaded" in sampler.unavailable
    with pytest.raises(ValueError, match="interval_s"):
        TelemetrySampler(interval_s=0)


def test_prometheus_gauges():
    module, _ = fake_nvml(nvdec=(30.0, 40.0), nvjpg=(1.0,))
    registry = CollectorRegistry()
    assert register_prometheus(registry, Nvml(module), prefix="unifiedserve")
    text = generate_latest(registry).decode()  # the second reading: GPM values are there
    assert 'unifiedserve_decoder_utilization_percent{gpu="0"} 75.0' in text
    assert 'unifiedserve_jpeg_utilization_percent{gpu="0"} 12.0' in text
    assert 'unifiedserve_nvdec_engine_utilization_percent{engine="1",gpu="0"}' in text
    assert 'unifiedserve_nvjpg_engine_utilization_percent{engine="0",gpu="0"}' in text
    broken, _ = fake_nvml(init_error="Driver Not Loaded")
    empty = CollectorRegistry()
    assert not register_prometheus(empty, lambda: Nvml(broken))
    assert b"utilization" not in generate_latest(empty)


@pytest.mark.cuda
def test_real_nvml_reads_this_gpu():
    pytest.importorskip("pynvml")
    with Nvml(__import__("pynvml"), gpus=[0]) as nvml:
        nvml.read()
        torch.cuda.synchronize()
        (r,) = nvml.read()
    assert r.decoder_pct is not None and 0.0 <= r.decoder_pct <= 100.0
    assert r.nvdec_pct is None or all(0.0 <= v <= 100.0 for v in r.nvdec_pct)
    assert r.nvdec_pct is not None or r.notes  # per-engine values, or the reason they are missing


def test_server_metrics_export_the_gauges_and_skip_them_without_nvml(monkeypatch):
    import flashcodec.telemetry as telemetry
    from unifiedserve.server.metrics import Metrics

    module, _ = fake_nvml(nvdec=(80.0,) * 7)
    monkeypatch.setattr(telemetry, "open_nvml", lambda: Nvml(module))
    metrics = Metrics("m")
    assert metrics.has_gpu_telemetry
    assert b'unifiedserve_nvdec_engine_utilization_percent{engine="6",gpu="0"}' in metrics.render()
    broken, _ = fake_nvml(init_error="Driver Not Loaded")
    monkeypatch.setattr(telemetry, "open_nvml", lambda: Nvml(broken))
    plain = Metrics("m")
    assert not plain.has_gpu_telemetry
    assert b"unifiedserve_healthy" in plain.render() and b"utilization" not in plain.render()


def test_bench_prints_engine_use_when_a_gpu_is_present(monkeypatch, capsys, tiny_h264):
    import flashcodec.devices as devices
    import flashcodec.telemetry as telemetry
    from flashcodec.benchmark import run_file_benchmark

    module, _ = fake_nvml(nvdec=(70.0,) * 7)
    monkeypatch.setattr(devices, "num_visible_gpus", lambda: 1)
    monkeypatch.setattr(telemetry, "open_nvml", lambda: Nvml(module, num_nvdec_engines=7))
    summary = run_file_benchmark(str(tiny_h264), sampling="sparse", peers="", num_threads=1)
    (gpu,) = summary["gpu_telemetry"]["gpus"]
    assert gpu["num_samples"] >= 2 and gpu["num_nvdec_busy"] == 7
    assert "7 of 7 engines busy" in capsys.readouterr().out


def test_nvml_index_matches_the_cuda_device_by_uuid():
    """CUDA numbers GPUs as CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say, NVML by PCI bus: the UUID links them."""
    from flashcodec.telemetry import nvml_index

    module, state = fake_nvml(num_gpus=4)
    uuids = {"GPU-aaaa": 0, "GPU-bbbb": 1, "GPU-cccc": 2, "GPU-dddd": 3}

    def by_uuid(name):
        if name not in uuids:
            raise FakeNvmlError("Not Found")
        return f"handle{uuids[name]}"

    module.nvmlDeviceGetHandleByUUID = by_uuid
    module.nvmlDeviceGetIndex = lambda handle: int(handle[len("handle"):])
    assert nvml_index(0, module, uuid="cccc") == 2  # cuda:0 of CUDA_VISIBLE_DEVICES=2 is NVML's GPU 2
    assert nvml_index(1, module, uuid="GPU-dddd") == 3  # torch may give the prefix too
    assert state.inits == state.shutdown == 2  # each lookup closes its NVML session
    with pytest.raises(TelemetryUnavailable, match="NVML does not know cuda:5 .*GPU-eeee"):
        nvml_index(5, module, uuid="eeee")
    assert state.shutdown == 3
    broken, _ = fake_nvml(init_error="Driver Not Loaded")
    with pytest.raises(TelemetryUnavailable, match="NVML cannot start"):
        nvml_index(0, broken, uuid="aaaa")
