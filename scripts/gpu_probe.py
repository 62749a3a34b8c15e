"""Print (and save as JSON) what the GPU machine offers the project: driver, NVDEC caps, NVML, packages.

Run by scripts/gpu_check.sh; safe on a machine without a GPU (every probe records why it failed).
Usage: python scripts/gpu_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CAPS = [("h264", "420", 8), ("h264", "444", 8), ("hevc", "420", 8), ("hevc", "420", 10), ("hevc", "444", 8),
        ("vp9", "420", 8), ("av1", "420", 8), ("mpeg4", "420", 8)]


def _try(fn):
    try:
        return fn()
    except Exception as e:  # a probe records its failure instead of stopping the others
        return {"error": f"{type(e).__name__}: {e}"}


def torch_info() -> dict:
    import torch
    info = {"version": torch.__version__, "cuda": torch.version.cuda, "is_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), name=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
    return info


def nvdec_caps() -> dict:
    from flashcodec import nvcuvid
    out = {"num_gpus": nvcuvid.num_gpus()}
    for codec, chroma, depth in CAPS:
        caps = nvcuvid.decoder_caps(codec, chroma, depth, 0)
        out[f"{codec} {chroma} {depth}-bit"] = (
            {"engines": caps.num_engines, "max": f"{caps.max_width}x{caps.max_height}"} if caps.is_supported
            else "unsupported")
    return out


def nvml_info() -> dict:
    import pynvml as nv
    nv.nvmlInit()
    try:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        dec, _ = nv.nvmlDeviceGetDecoderUtilization(h)
        out = {"driver": nv.nvmlSystemGetDriverVersion(), "decoder_util": dec}
        out["jpg_util"] = _try(lambda: nv.nvmlDeviceGetJpgUtilization(h)[0])
        out["gpm_supported"] = _try(lambda: bool(nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice))
        return out
    finally:
        nv.nvmlShutdown()


def flashcodec_decode() -> dict:
    """flashcodec's CPU path on this machine's PyAV, which every video request takes first: a seeded clip with a
    display matrix, made, probed and decoded. On 2026-11-28 two PyAV 19 changes broke it (every video request got a
    400), which cost two calls of the `policies` group before the first request told."""
    import tempfile
    import time

    import av

    import flashcodec

    sys.path.insert(0, str(ROOT / "datasets"))
    import frame_code
    import synthetic_video

    with tempfile.TemporaryDirectory() as folder:
        path = synthetic_video.make_video(Path(folder) / "probe.mp4", rotation=90)
        began = time.perf_counter()
        info = flashcodec.probe(str(path))
        result = flashcodec.decode_video(str(path), backend="pyav", num_frames=4)
        seconds = time.perf_counter() - began
    # flashcodec reads the display matrix's angle anticlockwise, as FFmpeg does: the generator's 90 is 270
    shown = [frame_code.try_read_frame_index(frame.permute(1, 2, 0).numpy(), rotation=90)
             for frame in result.frames[:len(result.frame_indices)]]
    if info.rotation != 270 or result.failed_frame_indices or shown != list(result.frame_indices):
        raise RuntimeError(f"read rotation {info.rotation} (made 270 anticlockwise), frames {result.frame_indices} "
                           f"shown as {shown}, failed {result.failed_frame_indices}")
    return {"ok": True, "pyav": av.__version__, "seconds": round(seconds, 3)}


def package(name: str) -> dict:
    mod = importlib.import_module(name)
    return {"version": getattr(mod, "__version__", "?"), "file": getattr(mod, "__file__", None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {
        "python": platform.python_version(),
        "torch": _try(torch_info),
        "nvdec": _try(nvdec_caps),
        "nvml": _try(nvml_info),
        "packages": {name: _try(lambda name=name: package(name))
                     for name in ("av", "torchcodec", "torchvision", "flashinfer", "transformers", "triton")},
        "mps_control": shutil.which("nvidia-cuda-mps-control"),
        "flashcodec_decode": _try(flashcodec_decode),
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
