"""The core process in-process: patch pages go to vision only after the work that may still read them.

On CUDA, vision writes into the pages from another process with nothing ordering its stream after core's,
so core waits for its own queued work (an encode step reading pages freed a moment ago) before it names
pages in ``WritePatches``. Here the barrier is recorded instead of waited for.
"""

from __future__ import annotations

import pytest
import torch

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.scheduler import SchedulerConfig
from unifiedserve.runtime import protocol
from unifiedserve.runtime.core_worker import CoreWorker


class RecordingCore(CoreWorker):
    """Core with its outgoing messages recorded (by type) instead of sent; ``WeightsLoaded`` also with its peer and
    whether the model's weights, in the shared pool, equal the checkpoint's when it goes out."""

    def send(self, peer, message):
        self.events.append(type(message).__name__)
        if isinstance(message, protocol.WeightsLoaded):
            self.weights_sent.append((peer, weights_equal_checkpoint(self)))


def weights_equal_checkpoint(core) -> bool:
    from unifiedserve.model.loader import load_model

    model = getattr(core, "model", None)
    if model is None:
        return False
    ref, _ = load_model(core.config.model)  # read again into memory of its own
    mine = dict(model.named_parameters())
    return all(torch.equal(mine[name], p) for name, p in ref.named_parameters())


def make_core(make_runtime, policy: str = "unified") -> RecordingCore:
    engine = EngineConfig(device="cpu", scheduler=SchedulerConfig(patches_ready_on_admit=False))  # as serve's
    worker = RecordingCore(make_runtime(policy, engine).config)
    worker.events, worker.weights_sent = [], []
    return worker


@pytest.fixture
def core(make_runtime):
    worker = make_core(make_runtime)
    try:
        worker.setup()
        worker.setup_events, worker.events = worker.events, []
        worker._pages_barrier = lambda: worker.events.append("barrier")
        yield worker
    finally:
        worker.close()


def add(core, rid: str, num_images: int) -> None:
    cfg = core.model_config
    ids = [11, 12]
    for _ in range(num_images):  # a 4x4-patch image is 4 visual tokens
        ids += [cfg.image_token_id] * 4 + [13]
    core.handle(protocol.AddRequest(rid, ids, [protocol.MediaPlan("image", (1, 4, 4))] * num_images,
                                    SamplingParams(max_tokens=2), []))


def test_pages_are_named_to_vision_only_after_a_barrier(core):
    add(core, "r1", 1)
    add(core, "r2", 2)
    core.step()  # admits both: one barrier, then their pages
    assert core.events == ["barrier", "WritePatches", "WritePatches"]
    core.events.clear()
    core.step()  # nothing admitted (media not written yet): no barrier, no pages
    assert "WritePatches" not in core.events and "barrier" not in core.events


def test_a_text_only_request_needs_no_barrier(core):
    core.handle(protocol.AddRequest("t", [11, 12, 13], [], SamplingParams(max_tokens=2), []))
    core.step()
    assert "barrier" not in core.events and "WritePatches" not in core.events


def test_core_tells_decode_once_the_weights_are_in_the_shared_pool(core):
    # decode maps the pool and runs nothing on it (the GEMM tune's checks, graph warm-up) before this message,
    # which goes out once the pool holds the checkpoint's values
    assert core.setup_events == ["WeightsLoaded"] and core.weights_sent == [("decode", True)]


def test_a_monolithic_core_has_no_decode_process_to_tell(make_runtime):
    worker = make_core(make_runtime, policy="monolithic")
    try:
        worker.setup()
        assert worker.weights_sent == [] and "WeightsLoaded" not in worker.events
    finally:
        worker.close()


def test_an_async_read_back_that_frees_a_seat_does_not_stall_the_waiting_request(make_runtime):
    """Monolithic, async scheduling, one seat: r2 arrives while the pending step holds r1's last token, so the next
    step runs nothing (r1 still holds the seat) and only reads that token back. Core used to mark itself stalled
    before the read-back finished r1, so r2 waited for some unrelated message; now it is served without one."""
    engine = EngineConfig(device="cpu", async_scheduling=True,
                          scheduler=SchedulerConfig(patches_ready_on_admit=False, max_num_seqs=1))
    worker = RecordingCore(make_runtime("monolithic", engine).config)
    finished = []
    worker.send = lambda peer, message: finished.extend(
        o.request_id for o in getattr(message, "outputs", []) if o.finish_reason)
    try:
        worker.setup()
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        worker.handle(protocol.AddRequest("r1", [11, 12, 13], [], params, []))
        r1 = worker.scheduler.requests["r1"]
        for _ in range(20):
            worker.step()
            if worker.core._pending is not None and len(r1.output_token_ids) == 3:
                break
        assert worker.core._pending is not None and len(r1.output_token_ids) == 3 and not finished
        worker.handle(protocol.AddRequest("r2", [11, 12, 13], [], params, []))
        for _ in range(50):  # the run loop: step while there is work, no message in between
            if not worker.has_work():
                break
            worker.step()
        assert finished == ["r1", "r2"] and not worker.scheduler.has_work
    finally:
        worker.close()
