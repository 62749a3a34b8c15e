"""KV admission without starvation: short requests pass one waiting for blocks, a bounded number of times."""

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import Request
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator


def text_request(rid, prompt_len, max_tokens):
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), [], [])


def make_scheduler(num_blocks, max_kv_overtakes=64):
    cfg = SchedulerConfig(prefill_token_budget=1000, max_kv_overtakes=max_kv_overtakes)
    return Scheduler(cfg, BlockManager(num_blocks, block_size=4), PageAllocator(8, 4), PageAllocator(8, 4))


def step(s):
    out = s.schedule()
    s.commit(out)
    for chunk in out.prefill:
        if chunk.is_last:
            s.requests[chunk.request_id].output_token_ids.append(0)
    return out


def test_a_short_request_passes_one_that_waits_for_kv_blocks():
    s = make_scheduler(num_blocks=10)  # 40 tokens of KV
    s.add(text_request("long-1", 4, 28))  # holds 8 blocks
    step(s)
    s.add(text_request("long-2", 4, 28))  # needs 8 more: must wait for long-1
    s.add(text_request("short", 2, 2))  # needs 1 block: fits now
    out = step(s)
    assert [c.request_id for c in out.prefill] == ["short"] and not s.requests["long-2"].has_kv
    assert s.num_waiting == 1  # long-2: admitted, but its prefill has not started
    assert s.kv_overtakes == {"long-2": 1}
    s.finish("long-1", "length")
    out = step(s)
    assert "long-2" in out.block_tables and s.kv_overtakes == {} and s.num_waiting == 0


def test_overtaking_is_bounded_so_a_long_request_cannot_starve():
    s = make_scheduler(num_blocks=10, max_kv_overtakes=2)
    s.add(text_request("holder", 4, 24))  # 7 blocks
    step(s)
    s.add(text_request("long", 4, 28))  # 8 blocks: waits for holder
    for i in range(4):
        s.add(text_request(f"short-{i}", 2, 2))
    first = step(s)
    assert [c.request_id for c in first.prefill] == ["short-0", "short-1"]  # 2 overtakes allowed
    assert s.kv_overtakes["long"] == 2
    assert step(s).prefill == []  # short-2 and short-3 now queue behind "long"
    assert s.num_waiting == 3
    s.finish("holder", "length")
    s.finish("short-0", "length")
    s.finish("short-1", "length")
    out = step(s)
    assert list(out.block_tables)[0] == "long"  # the freed blocks went to the starved request first


def test_finishing_a_waiting_request_forgets_its_count():
    s = make_scheduler(num_blocks=10)
    s.add(text_request("holder", 4, 28))
    step(s)
    s.add(text_request("long", 4, 28))
    s.add(text_request("short", 2, 2))
    step(s)
    assert s.kv_overtakes == {"long": 1}
    s.finish("long", "abort")
    assert s.kv_overtakes == {}
