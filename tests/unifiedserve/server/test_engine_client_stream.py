"""Token events from core (token 0) and decode (the rest) come back in order, whatever the arrival order."""

import asyncio

from unifiedserve.runtime.protocol import TokenOutput
from unifiedserve.server.engine_client import RequestError, RequestStream


def test_tokens_are_reordered_by_index():
    async def run():
        s = RequestStream("r")
        s.push(TokenOutput("r", 2, 12))
        s.push(TokenOutput("r", 1, 11))
        assert s.queue.empty()  # token 0 has not arrived
        s.push(TokenOutput("r", 0, 10))
        s.push(TokenOutput("r", 3, 13, "length"))
        got = [s.queue.get_nowait() for _ in range(4)]
        assert [t.token_id for t in got] == [10, 11, 12, 13] and got[-1].finish_reason == "length"
        s.fail(RequestError("boom", 500))
        err = s.queue.get_nowait()
        assert isinstance(err, RequestError) and err.status_code == 500

    asyncio.run(run())


def test_failure_while_probing_fails_the_probe():
    async def run():
        s = RequestStream("r")
        s.probe = asyncio.get_running_loop().create_future()
        s.fail(RequestError("not a video", 400))
        try:
            await s.probe
        except RequestError as e:
            return e.message

    assert asyncio.run(run()) == "not a video"


def test_every_worker_found_dead_is_named():
    """A fatal fault under MPS can end several workers before the watch looks: each is named, not just the
    first in start order (a decode fault that also took core down must still say decode)."""
    from types import SimpleNamespace

    from unifiedserve.server.engine_client import EngineClient

    runtime = SimpleNamespace(config=None, stopping=False, dead_workers=lambda: {"core": -6, "decode": 1})
    client = EngineClient(runtime)
    stream = RequestStream("r")
    client.streams["r"] = stream
    asyncio.run(asyncio.wait_for(client._watch(), 5))
    assert client.fatal == ("the core worker process exited unexpectedly (exit code -6); "
                            "the decode worker process exited unexpectedly (exit code 1)")
    err = stream.queue.get_nowait()
    assert err.status_code == 500 and "decode worker process exited unexpectedly" in err.message
    assert not client.healthy and not client.streams
    client.ctx.term()
