"""Helpers shared by the vision process's tests: the worker in-process, its outgoing messages recorded, on a
CPU patch pool with small pages and slow decoders; a request run through it, and the patches it should write."""

from __future__ import annotations

import time

import torch

from flashcodec import DecodeEngine
from flashcodec.image import decode_image
from slow_decoding import SlowBackend
from unifiedserve.runtime import protocol
from unifiedserve.engine.config import EngineConfig
from unifiedserve.runtime.config import RuntimeConfig
from unifiedserve.runtime.shm import create_cpu_pool
from unifiedserve.runtime.vision_worker import VisionWorker

PAGE_SIZE = 16  # small pages: slices and media cross page boundaries
NUM_PAGES = 64
SENTINEL = -7.0  # what rows nobody wrote hold


class RecordingVision(VisionWorker):
    """The vision worker with its outgoing messages recorded instead of sent."""

    def send(self, peer, message):
        self.sent.append((peer, message))


def make_worker(tmp_path, model, streaming: bool, delay_s: float = 0.06, dtype: torch.dtype = torch.float32):
    spec = create_cpu_pool(str(tmp_path), "t", "patch", (NUM_PAGES, PAGE_SIZE, 1176), dtype)
    config = RuntimeConfig(model=model, served_model_name="demo", ipc_dir=str(tmp_path), instance="t",
                           engine=EngineConfig(page_size=PAGE_SIZE, num_patch_pages=NUM_PAGES), pools={"patch": spec},
                           streaming_ingest=streaming, vision_threads=2)
    worker = RecordingVision(config)
    worker.sent = []
    worker.setup()
    worker.engine.close()
    worker.engine = DecodeEngine(SlowBackend(delay_s), 2)
    worker.patch_buffer.tensor.fill_(SENTINEL)
    return worker


def pump(worker, until, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the vision worker did not get there in time"
        if worker.has_work():
            worker.step()
        else:
            time.sleep(0.002)


def reference_patches(worker, media):
    out = []
    with DecodeEngine("pyav", 1) as engine:
        for ref in media:
            if ref.kind == "image":
                image = decode_image(ref.path, min_pixels=worker.image_pixels[0], max_pixels=worker.image_pixels[1])
                out.append(image.to_patches(worker.spec)[0])
            else:
                out.append(engine.decode_video(ref.path, output="patches", patch_spec=worker.spec,
                                               min_pixels=ref.min_pixels, max_pixels=ref.max_pixels).patches)
    return out


def stream_rows(worker, pages):
    """The request's patch stream: its pages' rows, in page-list order."""
    return worker.patch_buffer.tensor[pages].reshape(-1, worker.patch_buffer.tensor.shape[-1])


def messages(worker, kind):
    return [m for _, m in worker.sent if isinstance(m, kind)]


def run_request(worker, media, *, pages, skip=(), write_after_first_part=True):
    worker.handle(protocol.ProbeMedia("r1", media))
    pump(worker, lambda: messages(worker, protocol.MediaProbed))
    job = worker.jobs["r1"]
    if write_after_first_part and worker.config.streaming_ingest:  # slices decoded before the pages come
        pump(worker, lambda: job.rows_decoded)
    worker.handle(protocol.WritePatches("r1", pages, list(skip)))
    pump(worker, lambda: "r1" not in worker.jobs and worker.in_flight == 0)
    assert not messages(worker, protocol.MediaFailed)
    return messages(worker, protocol.MediaProbed)[0].plans
