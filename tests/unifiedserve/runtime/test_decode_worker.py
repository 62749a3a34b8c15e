"""The decode process's start-up: it maps core's weights pool and runs nothing on it before core says it is full.

On the H100 (2026-11-27) decode tuned its decode GEMMs on a pool core was still writing: the tune's output checks
compared against all-zero and half-written layers. Here the message is sent from the test, as core would.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from unifiedserve.runtime import decode_worker, protocol


@pytest.fixture
def runtime(make_runtime):
    return make_runtime()


def send_later(address: str, messages: list, delay_s: float, sent: list) -> threading.Thread:
    def run():
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        time.sleep(delay_s)
        for message in messages:
            if isinstance(message, protocol.WeightsLoaded):
                sent.append(time.monotonic())
            sock.send(protocol.encode(message))
        sock.close()
        ctx.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_decode_warms_up_only_after_core_says_the_weights_are_in(runtime, monkeypatch):
    warmed, sent, handled = [], [], []
    monkeypatch.setattr(decode_worker.ModelRunner, "warmup", lambda self, sizes=None: warmed.append(time.monotonic()))
    worker = decode_worker.DecodeWorker(runtime.config)
    try:
        # an abort that comes first is kept for the loop, not dropped and not taken for the signal
        thread = send_later(runtime.config.address("decode"),
                            [protocol.AbortRequest("early"), protocol.WeightsLoaded(), protocol.Shutdown()], 0.3, sent)
        worker.setup()
        assert len(warmed) == 1 and len(sent) == 1 and warmed[0] > sent[0]
        monkeypatch.setattr(worker, "handle", handled.append)
        worker.run()  # the early abort, then the Shutdown ends the loop
        thread.join(5)
        assert handled == [protocol.AbortRequest("early")]
    finally:
        worker.close()


def test_a_shutdown_while_decode_waits_ends_the_worker(runtime, monkeypatch):
    monkeypatch.setattr(decode_worker.ModelRunner, "warmup", lambda self, sizes=None: pytest.fail("warmed up"))
    worker = decode_worker.DecodeWorker(runtime.config)
    try:
        thread = send_later(runtime.config.address("decode"), [protocol.Shutdown()], 0.1, [])
        with pytest.raises(SystemExit):
            worker.setup()
        thread.join(5)
    finally:
        worker.close()
