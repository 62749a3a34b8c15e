"""The scheduler as the multi-process runtime drives it: media readiness, deferred frees, hand-off."""

import pytest

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator


def two_media_request(rid="r"):
    """An image (8 patch tokens) then a 2-slice video (8 each): 2 + 4 visual tokens between text."""
    items = [EncodeItem(0, 8, 2, (1, 2, 4)), EncodeItem(1, 8, 2, (1, 2, 4)), EncodeItem(1, 8, 2, (1, 2, 4))]
    ids = [1, 9, 9, 1, 9, 9, 9, 9, 1]
    return Request(rid, ids, SamplingParams(max_tokens=3), items, [1, 2, 4, 5, 6, 7])


def make_scheduler(**kw):
    cfg = SchedulerConfig(prefill_token_budget=100, encode_token_budget=100, patches_ready_on_admit=False, **kw)
    return Scheduler(cfg, BlockManager(16, 4), PageAllocator(16, 4), PageAllocator(16, 4))


def test_encode_waits_for_each_media_to_be_written():
    s = make_scheduler()
    s.add(two_media_request())
    out = s.schedule()
    assert out.admitted == ["r"] and out.patch_write is not None and out.encode == []
    assert out.prefill[0].num_tokens == 1  # text before the first visual token only
    s.commit(out)
    assert s.mark_media_ready("r", 1)  # the video is ready first: the image still blocks it (encode order)
    out = s.schedule()
    assert out.encode == [] and out.prefill == []
    s.commit(out)
    s.mark_media_ready("r", 0)
    out = s.schedule()
    assert [w.item_index for w in out.encode] == [0, 1, 2]
    assert out.prefill[0].is_last
    with pytest.raises(ValueError):
        s.mark_media_ready("r", 2)
    assert not s.mark_media_ready("gone", 0)


def test_consumed_pages_are_freed_at_commit_not_before():
    s = make_scheduler()
    s.add(two_media_request())
    s.commit(s.schedule())
    s.mark_media_ready("r", 0)
    s.mark_media_ready("r", 1)
    used = s.patch_pages.num_used_pages
    out = s.schedule()
    assert out.freed_patch_pages and s.patch_pages.num_used_pages == used  # the gather has not run yet
    s.commit(out)
    assert s.patch_pages.num_used_pages == 0 and s.visual_pages.num_used_pages == 0


def test_hand_off_keeps_kv_blocks_until_release():
    s = make_scheduler()
    s.add(two_media_request())
    for _ in range(3):
        out = s.schedule()
        s.commit(out)
        s.mark_media_ready("r", 0)
        s.mark_media_ready("r", 1)
    req = s.requests["r"]
    assert req.is_prefill_done
    req.output_token_ids.append(5)
    blocks = s.blocks.num_used_blocks
    s.hand_off("r")
    assert not s.has_work and "r" not in s.requests and blocks == s.blocks.num_used_blocks > 0
    assert s.schedule().is_empty  # core no longer decodes it
    assert s.release("r") and s.blocks.num_used_blocks == 0
    assert not s.release("r")


def test_hand_off_before_prefill_is_done_is_refused():
    s = make_scheduler()
    s.add(two_media_request())
    s.commit(s.schedule())
    with pytest.raises(ValueError, match="before its prefill"):
        s.hand_off("r")


def test_abort_between_schedule_and_commit_frees_everything_once():
    s = make_scheduler()
    s.add(two_media_request())
    s.commit(s.schedule())
    s.mark_media_ready("r", 0)
    out = s.schedule()  # reads the image's pages
    s.finish("r", "abort")
    s.commit(out)
    assert s.patch_pages.num_used_pages == 0 and s.visual_pages.num_used_pages == 0 and s.blocks.num_used_blocks == 0


def test_ingesting_while_an_admitted_request_waits_for_its_media():
    """Core's worker gives vision cores while this holds (``core_threads_shared``)."""
    s = make_scheduler()
    assert not s.ingesting
    s.add(two_media_request())
    assert not s.ingesting  # waiting, not admitted: vision has not started it
    s.commit(s.schedule())
    assert s.ingesting
    s.mark_media_ready("r", 0)
    assert s.ingesting  # the video is still being written
    s.mark_media_ready("r", 1, num_rows=8)  # its first slice only (streaming)
    assert s.ingesting
    s.mark_media_ready("r", 1)
    assert not s.ingesting
