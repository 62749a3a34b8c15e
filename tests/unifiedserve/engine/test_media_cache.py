"""The media cache's bound and pins; the scheduler with both caches over random workloads (no model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unifiedserve.engine.media_cache import MediaCache
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator


def _t(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 4)  # 16 bytes a row


def test_bound_lru_and_pins():
    cache = MediaCache(capacity_bytes=160)
    assert cache.put("a", _t(4)) and cache.put("b", _t(4)) and cache.num_bytes == 128
    assert cache.pin("a")  # a is now the most recently used, and held
    assert cache.put("c", _t(4))  # evicts b (unpinned, least recently used), not the pinned a
    assert "b" not in cache and "a" in cache and cache.num_bytes == 128
    assert not cache.put("d", _t(9))  # 144 bytes: only 32 can be freed (c) besides the pinned 64
    assert "c" in cache and cache.num_bytes <= cache.capacity_bytes
    cache.unpin("a")
    assert cache.put("d", _t(9)) and list(cache._entries) == ["d"]
    assert not cache.pin("zzz")
    with pytest.raises(KeyError):
        cache.unpin("d")
    with pytest.raises(ValueError):
        MediaCache(-1)


class FakeMediaCache:
    """Membership and pins only, as the scheduler sees a media cache."""

    def __init__(self, keys):
        self.keys, self.pins = set(keys), {}

    def pin(self, key):
        if key not in self.keys:
            return False
        self.pins[key] = self.pins.get(key, 0) + 1
        return True

    def unpin(self, key):
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]


def _request(rid, question, video, slices, max_tokens, video_first):
    """A prompt [1,1] + video (2 visual tokens a slice) + question tokens, or the question first."""
    visual = [9] * (2 * slices)
    text = [1, 1]
    ids = text + (visual + question if video_first else question + visual)
    start = 2 if video_first else 2 + len(question)
    items = [EncodeItem(0, 8, 2, (1, 2, 4)) for _ in range(slices)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens), items, list(range(start, start + 2 * slices)),
                   media_keys=[f"video-{video}"])


@settings(max_examples=100, deadline=None)
@given(workload=st.lists(st.tuples(st.lists(st.integers(2, 5), min_size=1, max_size=6), st.integers(0, 2),
                                   st.booleans(), st.integers(1, 4)), min_size=1, max_size=10),
       tau=st.integers(1, 24), kv_blocks=st.integers(12, 40), cached_videos=st.sets(st.integers(0, 2)),
       ready_on_admit=st.booleans())
def test_caches_keep_reads_exact_and_leak_nothing(workload, tau, kv_blocks, cached_videos, ready_on_admit):
    blocks = BlockManager(kv_blocks, block_size=2)
    patch, visual = PageAllocator(16, 4), PageAllocator(16, 4)
    media = FakeMediaCache({f"video-{v}" for v in cached_videos})
    s = Scheduler(SchedulerConfig(prefill_token_budget=tau, encode_token_budget=8,
                                  patches_ready_on_admit=ready_on_admit), blocks, patch, visual, media)
    reqs = [_request(f"r{i}", q, v, 3, m, first) for i, (q, v, first, m) in enumerate(workload)]
    reqs = [r for r in reqs if r.max_total_tokens <= kv_blocks * 2]
    pending = list(reqs)
    steps = 0
    while pending or s.has_work:
        if pending:  # one arrival per step: later ones find the earlier ones' blocks cached
            s.add(pending.pop(0))
        out = s.schedule()
        for rid in out.admitted:
            req = s.requests[rid]
            assert req.num_cached_tokens % 2 == 0 and req.num_cached_tokens < req.prompt_len
            # no encode item is partly inside the cached prefix, and a media only when the media cache has it
            n = req.num_cached_tokens
            first, last = req.visual_positions[0], req.visual_positions[-1]
            assert not first < n <= last or 0 in req.cached_media
            straddling = [i for i, (f, l) in enumerate(req.item_position_spans()) if f < n <= l]
            assert not straddling or 0 in req.cached_media  # only a copy can start inside an item
            assert req.num_skipped_visual == (req.visual_tokens_before(n) - 2 * req.num_covered_items)
            assert (0 in req.skipped_media) == (last < n)
            assert req.num_covered_items == sum(1 for _, l in req.item_position_spans() if l < n)
            if not ready_on_admit:  # vision writes what is not skipped, whole
                for m in range(req.num_media):
                    if m not in req.media_without_patches:
                        s.mark_media_ready(rid, m)
        for w in out.encode:
            req = s.requests[w.request_id]
            assert req.encode_items[w.item_index].media_index not in req.skipped_media
            assert w.item_index >= req.num_covered_items
            assert w.from_cache == (0 in req.cached_media)
        for c in out.prefill:
            req = s.requests[c.request_id]
            assert c.start >= req.num_cached_tokens and req.has_kv
            scheduled = sum(i.num_visual_tokens for i in req.encode_items[:req.num_scheduled_items])
            assert req.visual_tokens_before(c.start + c.num_tokens) <= scheduled
        s.commit(out)
        for rid in [c.request_id for c in out.prefill if c.is_last] + out.decode:
            req = s.requests[rid]
            req.output_token_ids.append(0)
            if len(req.output_token_ids) >= req.params.max_tokens:
                s.finish(rid, "length")
        steps += 1
        assert steps < 5000
    assert blocks.num_used_blocks == 0 and patch.num_used_pages == 0 and visual.num_used_pages == 0
    assert media.pins == {}, "a media-cache pin leaked"
    assert s.prefix_hit_tokens <= s.prefix_queried_tokens


def test_streaming_rows_release_items_in_order():
    s = Scheduler(SchedulerConfig(patches_ready_on_admit=False), BlockManager(32, 4), PageAllocator(16, 4),
                  PageAllocator(16, 4))
    s.add(_request("r", [3, 3], 0, 3, 1, True))

    def encoded():
        out = s.schedule()
        s.commit(out)
        return [w.item_index for w in out.encode]

    assert encoded() == []
    s.mark_media_ready("r", 0, num_rows=8)  # the first slice (8 patch rows) is written
    assert encoded() == [0]
    s.mark_media_ready("r", 0, num_rows=12)  # half a slice more: nothing new
    assert encoded() == []
    s.mark_media_ready("r", 0)  # the whole media
    assert encoded() == [1, 2]


@pytest.mark.parametrize("capacity_gb,stored", [(2e-6, False), (1.0, True)])
def test_a_media_larger_than_the_cache_is_not_kept_while_it_is_encoded(demo_path, capacity_gb, stored):
    """A media's pieces are kept until its last item is encoded, then offered to the cache: one larger than the
    whole cache would be refused then, so its pieces are not kept at all (a long video's visual tokens, held per
    request outside the bound); one that fits is kept as copies of its pieces, not views of each step's output."""
    from unifiedserve.engine.inputs import VisionInput
    from unifiedserve.engine.llm import LLM, EngineConfig

    llm = LLM(demo_path, EngineConfig(num_kv_blocks=512, block_size=4, media_cache_gb=capacity_gb,
                                      scheduler=SchedulerConfig(prefill_token_budget=8, encode_token_budget=16)))
    t, h, w = 12, 4, 4
    video = VisionInput("video", torch.randn(t * h * w, llm.model_config.vision.patch_dim), (t, h, w))
    ids, vision = llm.build_prompt([{"role": "user", "content": [{"type": "video", "vision": video},
                                                                 {"type": "text", "text": "hi"}]}])
    rid = llm.add_request(ids, vision, SamplingParams(max_tokens=2, ignore_eos=True))
    kept = []
    while llm.has_unfinished:
        tensors = llm.runner._tensors.get(rid)
        for pieces in (tensors.encoded or {}).values() if tensors is not None else ():
            kept += [p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in pieces]  # own storage
        llm.step()
    assert (len(llm.runner.media_cache) == 1) == stored
    assert kept if stored else not kept
    assert all(kept)
