"""Scheduler invariants over random workloads, driven as the engine drives it (no torch, no model)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request
from unifiedserve.engine.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator


def make_request(rid, text_before, slices, text_after, max_tokens, patches_per_slice=8):
    """A prompt with one video of ``slices`` temporal slices (each 8 patch tokens -> 2 visual tokens)."""
    visual = patches_per_slice // 4 * slices
    ids = [1] * text_before + [9] * visual + [1] * text_after
    items = [EncodeItem(0, patches_per_slice, patches_per_slice // 4, (1, 2, 4)) for _ in range(slices)]
    positions = list(range(text_before, text_before + visual))
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), items, positions)


def drive(scheduler, requests, check_step=None, max_steps=10_000):
    """Run to completion, producing one fake token per sampled request; returns the outputs."""
    for r in requests:
        scheduler.add(r)
    steps = 0
    while scheduler.has_work:
        out = scheduler.schedule()
        assert not out.is_empty, "scheduler stalled with work left"
        if check_step:
            check_step(out)
        scheduler.commit(out)
        sampled = [c.request_id for c in out.prefill if c.is_last] + out.decode
        for rid in sampled:
            req = scheduler.requests[rid]
            req.output_token_ids.append(0)
            if len(req.output_token_ids) >= req.params.max_tokens:
                scheduler.finish(rid, "length")
        steps += 1
        assert steps < max_steps
    return steps


workloads = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6), st.integers(0, 20), st.integers(1, 5)),
                     min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(workload=workloads, tau=st.integers(1, 40), alpha=st.integers(1, 40), kv_blocks=st.integers(8, 40),
       pages=st.integers(3, 30), chunked=st.booleans(), policy=st.sampled_from(SCHEDULING_POLICIES))
def test_budgets_readiness_and_no_leaks(workload, tau, alpha, kv_blocks, pages, chunked, policy):
    requests = [make_request(f"r{i}", a, n, b, m) for i, (a, n, b, m) in enumerate(workload)
                if a + n * 2 + b > 0]
    if not requests:
        return
    blocks = BlockManager(kv_blocks, block_size=4)
    patch_pages, visual_pages = PageAllocator(pages, 4), PageAllocator(pages, 4)
    cfg = SchedulerConfig(prefill_token_budget=tau, encode_token_budget=alpha, enable_chunked_prefill=chunked,
                          scheduling_policy=policy)
    s = Scheduler(cfg, blocks, patch_pages, visual_pages)
    fits = [r for r in requests if r.max_total_tokens <= kv_blocks * 4 and r.num_patch_tokens <= pages * 4]
    by_id = {r.request_id: r for r in fits}

    def check(out):
        if chunked:
            assert out.num_prefill_tokens <= tau
        encode_tokens = [by_id[w.request_id].encode_items[w.item_index].num_patch_tokens for w in out.encode]
        # alpha is a threshold: items are added while the running total is below it (one item may pass it; srpt
        # lists a request's items together, so that item need not be the last)
        assert sum(encode_tokens) - max(encode_tokens, default=0) < alpha or len(encode_tokens) <= 1
        for chunk in out.prefill:
            req = by_id[chunk.request_id]
            scheduled_visual = sum(i.num_visual_tokens for i in req.encode_items[:req.num_scheduled_items])
            needed = req.visual_tokens_before(chunk.start + chunk.num_tokens)
            assert needed <= scheduled_visual, "prefill read a visual token that is not encoded"
            assert req.has_kv

    drive(s, fits, check)
    assert all(r.is_prefill_done and r.output_token_ids for r in fits)
    assert blocks.num_used_blocks == 0 and patch_pages.num_used_pages == 0 and visual_pages.num_used_pages == 0


def test_encoding_proceeds_while_prefill_waits_for_kv_blocks():
    blocks = BlockManager(4, block_size=4)  # 16 tokens of KV cache
    s = Scheduler(SchedulerConfig(prefill_token_budget=64, encode_token_budget=8), blocks,
                  PageAllocator(16, 4), PageAllocator(16, 4))
    first = make_request("a", 4, 1, 4, max_tokens=6)  # 16 tokens: takes the whole cache
    second = make_request("b", 2, 3, 2, max_tokens=2)  # needs KV that only frees when `a` finishes
    s.add(first)
    s.add(second)
    out = s.schedule()
    s.commit(out)
    assert {c.request_id for c in out.prefill} == {"a"}
    encoded_b = [w for w in out.encode if w.request_id == "b"]
    for _ in range(3):  # while `a` decodes, `b` keeps encoding though it cannot prefill
        out = s.schedule()
        s.commit(out)
        assert all(c.request_id != "b" for c in out.prefill)
        encoded_b += [w for w in out.encode if w.request_id == "b"]
        s.requests["a"].output_token_ids.append(0)
    assert len(encoded_b) == 3 and not s.requests["b"].has_kv


def test_prefill_never_overtakes_an_older_request_waiting_for_kv():
    """With budget for both, KV blocks go in admission order under either policy."""
    for policy in ("fcfs", "srpt"):
        blocks = BlockManager(6, block_size=4)
        s = Scheduler(SchedulerConfig(prefill_token_budget=100, scheduling_policy=policy), blocks,
                      PageAllocator(8, 4), PageAllocator(8, 4))
        order = []
        drive(s, [make_request("big", 20, 0, 0, max_tokens=4), make_request("small", 2, 0, 0, max_tokens=1)],
              lambda out: order.extend(c.request_id for c in out.prefill))
        assert order == ["big", "small"], policy


def test_srpt_passing_an_older_request_to_kv_counts_as_an_overtake():
    """With budget for one, srpt serves the small request first: it takes KV before the big one, which counts as one
    of the big one's overtakes; with none allowed, the big one goes first."""
    for overtakes, expected in ((64, ["small", "big"]), (0, ["big", "small"])):
        s = Scheduler(SchedulerConfig(prefill_token_budget=2, max_kv_overtakes=overtakes), BlockManager(6, 4),
                      PageAllocator(8, 4), PageAllocator(8, 4))
        s.add(make_request("big", 20, 0, 0, max_tokens=4))  # all 6 blocks
        s.add(make_request("small", 2, 0, 0, max_tokens=1))
        first = s.schedule()
        assert list(first.block_tables) == expected[:1]
        if overtakes:
            assert s.kv_overtakes == {"big": 1}


def test_chunking_off_prefills_whole_prompt_once_ready():
    s = Scheduler(SchedulerConfig(prefill_token_budget=3, encode_token_budget=8, enable_chunked_prefill=False),
                  BlockManager(64, 4), PageAllocator(16, 4), PageAllocator(16, 4))
    s.add(make_request("v", 3, 2, 3, max_tokens=1))
    sizes = []
    while s.has_work:
        out = s.schedule()
        s.commit(out)
        sizes += [c.num_tokens for c in out.prefill]
        for c in out.prefill:
            s.finish(c.request_id, "length")
    assert sizes == [10]


def test_rejects_requests_that_can_never_fit():
    import pytest

    s = Scheduler(SchedulerConfig(), BlockManager(2, 4), PageAllocator(1, 4), PageAllocator(1, 4))
    with pytest.raises(ValueError, match="KV cache"):
        s.add(make_request("x", 10, 0, 0, max_tokens=1))
    with pytest.raises(ValueError, match="patch"):
        s.add(make_request("y", 0, 1, 0, max_tokens=1, patches_per_slice=8))


def test_an_empty_prompt_or_an_item_the_visual_buffer_cannot_hold_is_refused_not_left_to_stall():
    """An item is written whole into the visual buffer, after the partly read last page of the item before it
    (prefill frees only pages it read to the end): 12 visual tokens at offset 1 of 4-row pages need 4 pages. With
    3 it used to be admitted and then never encoded, nor refused."""
    import pytest

    s = Scheduler(SchedulerConfig(), BlockManager(100, 4), PageAllocator(100, 4), PageAllocator(3, 4))
    with pytest.raises(ValueError, match="the prompt is empty"):
        s.add(Request("e", [], SamplingParams(max_tokens=1)))
    two = Request("a", [1, 9] + [9] * 12 + [1], SamplingParams(max_tokens=2),
                  [EncodeItem(0, 4, 1, (1, 2, 2)), EncodeItem(1, 48, 12, (1, 4, 12))], list(range(1, 14)))
    with pytest.raises(ValueError, match=r"makes 12 visual tokens, more than the visual buffer holds at once \(9\); "
                                         r".*--visual-buffer-gb"):
        s.add(two)
    assert not s.has_work
    fits = Request("b", [1, 9] + [9] * 9 + [1], SamplingParams(max_tokens=2),
                   [EncodeItem(0, 4, 1, (1, 2, 2)), EncodeItem(1, 36, 9, (1, 4, 9))], list(range(1, 11)))
    drive(s, [fits])  # 9 tokens fit after any partial page: it runs to the end


def test_server_token_budgets_take_the_papers_values_on_a_gpu():
    from unifiedserve.engine.scheduler import GPU_TOKEN_BUDGETS, server_token_budgets

    assert GPU_TOKEN_BUDGETS == {"prefill_token_budget": 2048, "encode_token_budget": 10240}  # paper, section 7
    assert server_token_budgets("cpu", {}, None) == {}  # SchedulerConfig's CPU defaults apply
    assert server_token_budgets("cpu", {"prefill_token_budget": 64}, None) == {"prefill_token_budget": 64}
    assert server_token_budgets("cuda", {}, None) == GPU_TOKEN_BUDGETS
    assert server_token_budgets("cuda", {"encode_token_budget": 999}, None) == {
        "prefill_token_budget": 2048, "encode_token_budget": 999}  # a flag wins
    assert server_token_budgets("cuda", {}, 50.0) == {}  # the SLO's profile derives them
    assert server_token_budgets("cuda", {"prefill_token_budget": 128}, 50.0) == {"prefill_token_budget": 128}


def test_a_request_that_can_never_run_is_told_what_to_change():
    """Over the whole KV cache or patch buffer: the sizes, and what lowers them (no internal request id)."""
    import pytest

    s = Scheduler(SchedulerConfig(), BlockManager(4, block_size=4), PageAllocator(2, 4), PageAllocator(2, 4))
    with pytest.raises(ValueError, match=r"^the request needs 21 tokens of KV cache \(prompt \+ max_tokens\), more "
                                         r"than the whole cache holds \(16\); lower max_tokens"):
        s.add(make_request("r1", 1, 0, 0, 20))
    with pytest.raises(ValueError, match=r"^the request's media make 24 patch rows, more than the patch buffer holds "
                                         r"\(8\); send smaller media \(max_pixels, fps, max_frames\)"):
        s.add(make_request("r2", 0, 3, 0, 1))
