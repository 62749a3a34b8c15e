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


def test_a_prefix_of_text_only_is_taken_with_the_kv_so_a_request_holds_nothing_before():
    """With a system prompt cached every request is a prefix hit: a hit of text only is admitted holding no KV
    (its media decode first), and matched again when it takes its KV; short requests pass it as they pass any
    request short of blocks (taken at admission, its whole KV stopped the queue or held KV through the decode)."""
    system = [7] * 8  # two full blocks of 4, cached by the first request

    def request(rid, n, max_tokens):
        return Request(rid, system + [1] * n, SamplingParams(max_tokens=max_tokens), [], [])

    for cap in (64, 1):
        s = make_scheduler(num_blocks=20, max_kv_overtakes=cap)
        s.add(request("warm", 2, 1))
        step(s)
        s.finish("warm", "length")
        s.add(request("long-1", 2, 50))
        out = step(s)
        assert s.requests["long-1"].num_cached_tokens == 8 and s.blocks.block_table("long-1")[:2] == \
            s.blocks.match(s.requests["long-1"].block_hashes(4))[:2]  # the system prompt's blocks, matched at KV
        s.add(request("long-2", 2, 50))  # needs 13 more blocks, 5 are free: waits, holding nothing
        s.add(request("short-1", 2, 2))
        s.add(request("short-2", 2, 2))
        out = step(s)
        assert out.admitted == ["long-2", "short-1", "short-2"] and s.blocks.block_table("long-2") == []
        assert [c.request_id for c in out.prefill] == ["short-1", "short-2"][:cap]
        assert s.kv_overtakes["long-2"] == min(cap, 2)


def test_a_follow_up_whose_media_the_prefix_holds_waits_in_the_queue_holding_nothing():
    """A prefix hit that covers media takes its whole KV at admission (its media are neither decoded nor encoded,
    so holding it costs no wait), or stays queued holding nothing: two requests each holding part of their KV
    could each wait for the other's blocks. Later requests pass it, at most max_kv_overtakes of them."""
    from unifiedserve.engine.request import EncodeItem

    def follow_up(rid, tail, max_tokens):
        ids = [7] * 8 + [9] * 12 + [2] * 4 + tail
        r = Request(rid, ids, SamplingParams(max_tokens=max_tokens), [EncodeItem(0, 48, 12, (1, 4, 12))],
                    list(range(8, 20)))
        r.media_keys = ["k"]
        return r

    for cap in (64, 1):
        s = Scheduler(SchedulerConfig(prefill_token_budget=100, max_kv_overtakes=cap), BlockManager(20, 4),
                      PageAllocator(64, 4), PageAllocator(8, 4))
        s.add(follow_up("first", [3] * 4, 1))
        while s.has_work:
            out = step(s)
            for rid in [c.request_id for c in out.prefill if c.is_last]:
                s.finish(rid, "length")
        s.add(text_request("long", 4, 40))  # holds 11 of the 20 blocks
        step(s)
        s.add(follow_up("again", [3] * 4, 40))  # 6 of its 17 blocks cached (evictable): 11 more, 3 others free
        s.add(text_request("short-1", 2, 2))
        s.add(text_request("short-2", 2, 2))
        out = step(s)
        assert out.admitted == ["short-1", "short-2"][:cap] and s.waiting[0].request_id == "again"
        assert "again" not in s.blocks and s.kv_overtakes["again"] == min(cap, 2)


def test_a_request_short_of_visual_pages_is_passed_a_bounded_number_of_times():
    """One whose image needs most of the visual buffer waits without KV while others hold pages; it counts as
    passed, like one short of KV blocks, so a stream of small-image requests cannot pass it forever."""
    from unifiedserve.engine.request import EncodeItem

    def image_request(rid, visual):
        ids = [1, 1] + [9] * visual + [2, 3]
        return Request(rid, ids, SamplingParams(max_tokens=3), [EncodeItem(0, 4 * visual, visual, (1, 2, 2 * visual))],
                       list(range(2, 2 + visual)))

    s = Scheduler(SchedulerConfig(prefill_token_budget=16, encode_token_budget=1000, max_num_seqs=64,
                                  max_kv_overtakes=4),
                  BlockManager(4000, 4, enable_prefix_caching=False), PageAllocator(2000, 4), PageAllocator(4, 4))
    done = {}
    for n in range(400):
        if n == 1:
            s.add(image_request("R", 13))  # needs all 4 pages at once
        if n < 300:
            for j in range(3):
                s.add(image_request(f"L{n}_{j}", 5))
        out = s.schedule()
        s.commit(out)
        for rid in [c.request_id for c in out.prefill if c.is_last] + out.decode:
            r = s.requests[rid]
            r.output_token_ids.append(0)
            if len(r.output_token_ids) >= 3:
                s.finish(rid, "length")
                done[rid] = n
        if "R" in done:
            break
    assert done.get("R", 10**9) < 60  # it waited 723 steps, behind all 900 later requests


def test_a_follow_up_whose_media_the_prefix_holds_needs_no_visual_pages_to_take_its_kv():
    """Its image lies wholly in the cached prefix: nothing of it is encoded, so busy visual pages do not hold it
    (the check counted the covered image's pages, and the request waited at the head of the queue)."""
    from unifiedserve.engine.request import EncodeItem

    def follow_up(rid, tail):
        ids = [7] * 8 + [9] * 12 + [2] * 4 + tail
        r = Request(rid, ids, SamplingParams(max_tokens=2), [EncodeItem(0, 48, 12, (1, 4, 12))], list(range(8, 20)))
        r.media_keys = ["k"]
        return r

    s = Scheduler(SchedulerConfig(prefill_token_budget=100), BlockManager(100, 4), PageAllocator(64, 4),
                  PageAllocator(4, 4))
    s.add(follow_up("first", [3] * 4))
    while s.has_work:
        out = step(s)
        for rid in out.decode:
            s.finish(rid, "length")
    held = s.visual_pages.allocate_pages(2)  # other requests' encodes hold half the buffer
    s.add(follow_up("again", [3] * 4 + [5] * 4))
    out = step(s)
    assert out.admitted == ["again"] and s.requests["again"].skipped_media == {0} and s.requests["again"].has_kv
    s.visual_pages.free(held)
