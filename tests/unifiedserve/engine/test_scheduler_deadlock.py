"""No request waits forever: random workloads on small pools, media arriving late (streaming ingest), prefixes
shared through the prefix cache, items of mixed sizes. A step may run nothing only while some media is still on
its way; otherwise the scheduler has work it can never run (a deadlock over KV blocks and visual pages)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request
from unifiedserve.engine.scheduler import SCHEDULING_POLICIES, Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator

IMAGE = 9  # placeholder token id of a visual token

#: a request: (shared prefix (one of 3), text before its media, visual tokens per media, text after, max_tokens,
#: steps after admission each media arrives)
requests = st.tuples(st.integers(0, 2), st.integers(0, 6), st.lists(st.integers(1, 12), min_size=0, max_size=3),
                     st.integers(0, 4), st.integers(1, 6), st.lists(st.integers(0, 6), min_size=3, max_size=3))


def make(rid, prefix, before, media, after, max_tokens):
    ids = [100 + prefix] * 8 + [1] * before  # 8 tokens: two full blocks of 4 shared by requests of that prefix
    items, positions = [], []
    for index, visual in enumerate(media):
        positions += range(len(ids), len(ids) + visual)
        ids += [IMAGE] * visual + [2]
        items.append(EncodeItem(index, 4 * visual, visual, (1, 2, 2 * visual)))
    ids += [3] * after
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), items, positions)


@settings(max_examples=300, deadline=None)
@given(workload=st.lists(requests, min_size=1, max_size=8), kv_blocks=st.integers(6, 24),
       visual_pages=st.integers(3, 8), encode_budget=st.integers(4, 64), prefill_budget=st.integers(2, 32),
       overtakes=st.integers(0, 3), seats=st.integers(1, 8), policy=st.sampled_from(SCHEDULING_POLICIES),
       passed_steps=st.integers(0, 4))
def test_every_request_finishes(workload, kv_blocks, visual_pages, encode_budget, prefill_budget, overtakes, seats,
                                policy, passed_steps):
    blocks = BlockManager(kv_blocks, block_size=4, enable_prefix_caching=True)
    config = SchedulerConfig(prefill_token_budget=prefill_budget, encode_token_budget=encode_budget,
                             max_kv_overtakes=overtakes, max_num_seqs=seats, patches_ready_on_admit=False,
                             scheduling_policy=policy, max_passed_steps=passed_steps)
    scheduler = Scheduler(config, blocks, PageAllocator(64, 4), PageAllocator(visual_pages, 4))
    arrivals: dict[str, list[int]] = {}
    accepted = []
    for i, (prefix, before, media, after, max_tokens, delays) in enumerate(workload):
        request = make(f"r{i}", prefix, before, media, after, max_tokens)
        try:
            scheduler.add(request)
        except ValueError:  # can never run here (too big for a pool): refused up front, not left to stall
            continue
        accepted.append(request)
        arrivals[request.request_id] = delays[:len(media)]
    due: list[tuple[int, str, int]] = []  # (step, request, media) still to arrive
    for step in range(3000):
        for when, rid, media in [d for d in due if d[0] <= step]:
            due.remove((when, rid, media))
            scheduler.mark_media_ready(rid, media)
        if not scheduler.has_work:
            break
        out = scheduler.schedule()
        for rid in out.admitted:  # vision starts now; media arrive one after another
            for media in range(len(arrivals[rid])):
                due.append((step + 1 + sum(arrivals[rid][:media + 1]), rid, media))
        assert not out.is_empty or due, (
            "stalled with nothing on its way: "
            f"{[(r.request_id, r.has_kv, r.num_scheduled_items) for r in scheduler.running]}"
            f", waiting {[r.request_id for r in scheduler.waiting]}, free blocks {blocks.num_free_blocks}, "
            f"free visual pages {scheduler.visual_pages.num_free_pages}")
        scheduler.commit(out)  # frees the pages the step's reads consumed
        for rid in [c.request_id for c in out.prefill if c.is_last] + out.decode:
            request = scheduler.requests[rid]
            request.output_token_ids.append(0)
            if len(request.output_token_ids) >= request.params.max_tokens:
                scheduler.finish(rid, "length")
    assert not scheduler.has_work, "did not finish in 3000 steps"
    assert scheduler.visual_pages.num_free_pages == visual_pages and blocks.num_used_blocks == 0
