"""--scheduling-policy: srpt gives the budgets to the request with the least prompt left (a short question is not
held behind a long video), fcfs to the oldest; a request srpt passes over is served after max_passed_steps."""

import pytest

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import EncodeItem, Request
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig
from unifiedserve.memory.block_manager import BlockManager
from unifiedserve.memory.pages import PageAllocator


def video_request(rid, slices, text_before=4, text_after=4):
    """A video of ``slices`` items of 16 patch tokens (4 visual tokens) each."""
    ids = [1] * text_before + [9] * (4 * slices) + [2] * text_after
    items = [EncodeItem(0, 16, 4, (1, 2, 8)) for _ in range(slices)]
    return Request(rid, ids, SamplingParams(max_tokens=2), items, list(range(text_before, text_before + 4 * slices)))


def run(policy, max_passed_steps=64, late=("short", 2)):
    """A 40-slice video, then after two steps a ``late`` one; the step at which each request samples its first token."""
    s = Scheduler(SchedulerConfig(prefill_token_budget=16, encode_token_budget=32, scheduling_policy=policy,
                                  max_passed_steps=max_passed_steps),
                  BlockManager(256, block_size=4), PageAllocator(256, 4), PageAllocator(256, 4))
    return first_tokens(s, {0: [video_request("long", 40)], 2: [video_request(*late)]})


def test_srpt_serves_a_short_request_first_and_the_long_one_little_later():
    fcfs, srpt = run("fcfs"), run("srpt")
    assert fcfs["short"] > fcfs["long"]  # fcfs: behind the long video's last token
    assert srpt["short"] < fcfs["long"] // 4  # srpt: within a few steps of its arrival
    assert srpt["long"] <= fcfs["long"] + 3  # the long one pays the short one's few steps


def test_a_request_passed_over_max_passed_steps_in_a_row_goes_first():
    """A late request with a little less left than the first one is served first (the first one waits 15 steps);
    with max_passed_steps 0 the first one is never passed over, as under fcfs."""
    lengths = []
    for bound in (0, 64):
        firsts = run("srpt", max_passed_steps=bound, late=("other", 30))
        lengths.append(firsts["long"])
    assert lengths[0] == run("fcfs", late=("other", 30))["long"] < lengths[1]


def test_the_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy must be one of srpt, fcfs"):
        SchedulerConfig(scheduling_policy="lifo")


def test_a_request_waiting_for_kv_is_not_passed_over_so_srpt_holds_for_the_others():
    """A request that cannot take its KV blocks gets no share, and is not counted as passed over: it does not turn
    overdue and take the shares of those that can run (srpt then fell back to fcfs after 64 steps)."""
    s = Scheduler(SchedulerConfig(prefill_token_budget=8, scheduling_policy="srpt"), BlockManager(30, 4),
                  PageAllocator(64, 4), PageAllocator(64, 4))
    decoding = Request("d", [1] * 4, SamplingParams(max_tokens=96), [], [])  # holds 100 of 120 KV tokens
    waiting = Request("w", [1] * 40, SamplingParams(max_tokens=60), [], [])  # needs 100: waits for d
    s.add(decoding)
    first = s.schedule()
    s.commit(first)
    decoding.output_token_ids.append(0)
    s.add(waiting)
    for _ in range(90):  # more than max_passed_steps
        out = s.schedule()
        s.commit(out)
        for rid in [c.request_id for c in out.prefill if c.is_last] + out.decode:
            s.requests[rid].output_token_ids.append(0)
        assert not s.requests["w"].has_kv
    assert "w" not in s.passed_steps  # never given a share it could use, never passed over
    s.add(Request("m", [1] * 40, SamplingParams(max_tokens=1), [], []))
    s.add(Request("q", [1] * 4, SamplingParams(max_tokens=1), [], []))
    out = s.schedule()
    assert [c.request_id for c in out.prefill][:1] == ["q"]  # the shortest goes first


def test_with_chunking_off_a_short_prompt_is_not_held_behind_a_long_one():
    s = Scheduler(SchedulerConfig(prefill_token_budget=16, enable_chunked_prefill=False, scheduling_policy="srpt"),
                  BlockManager(64, 4), PageAllocator(16, 4), PageAllocator(16, 4))
    s.add(Request("long", [1] * 100, SamplingParams(max_tokens=1), [], []))
    s.add(Request("short", [2] * 10, SamplingParams(max_tokens=1), [], []))  # (no prefix shared with the long one)
    first = s.schedule()
    assert [(c.request_id, c.num_tokens) for c in first.prefill] == [("short", 10)]
    assert list(first.block_tables) == ["short"]  # the long one takes no KV before its step
    s.commit(first)
    assert [(c.request_id, c.num_tokens) for c in s.schedule().prefill] == [("long", 100)]


def first_tokens(s, arrivals, steps=400):
    """Drive ``s`` (``arrivals``: step -> requests added then); the step of each request's first token."""
    first = {}
    for step in range(steps):
        for r in arrivals.get(step, ()):
            s.add(r)
        if not s.has_work:
            break
        out = s.schedule()
        s.commit(out)
        for rid in [c.request_id for c in out.prefill if c.is_last] + out.decode:
            req = s.requests[rid]
            req.output_token_ids.append(0)
            first.setdefault(rid, step)
            if len(req.output_token_ids) >= req.params.max_tokens:
                s.finish(rid, "length")
    return first


def text(rid, n, max_tokens=1, token=1):
    return Request(rid, [token] * n, SamplingParams(max_tokens=max_tokens), [], [])


def test_a_request_that_may_not_take_kv_gets_no_share():
    """R fits its KV blocks but may not take them (B, waiting for KV, was passed max_kv_overtakes times): a share
    given to R would go unused and the step's budget to the oldest, as under fcfs."""
    def run(with_r):
        s = Scheduler(SchedulerConfig(prefill_token_budget=4, max_kv_overtakes=0), BlockManager(60, 4),
                      PageAllocator(64, 4), PageAllocator(64, 4))
        arrivals = {0: [text("D", 4, 90)], 1: [text("long", 80, token=2), text("mid", 40, token=3)],
                    3: [text("B", 60, token=4)] + ([text("R", 4, token=5)] if with_r else [])}
        return first_tokens(s, arrivals)["mid"]

    assert run(True) == run(False)


def image(rid, before, visual, after):
    ids = [1] * before + [9] * visual + [1] * after
    return Request(rid, ids, SamplingParams(max_tokens=1), [EncodeItem(0, 4 * visual, visual, (1, 2, 2 * visual))],
                   list(range(before, before + visual)))


def test_a_request_the_visual_pages_stop_gets_no_encode_share():
    """L's image needs more visual pages than are free: it is not passed over (it would turn overdue and take the
    first encode share every step, unused), so a short image asked while a long video encodes still goes first."""
    def run(policy, with_l):
        s = Scheduler(SchedulerConfig(prefill_token_budget=64, encode_token_budget=8, scheduling_policy=policy,
                                      max_passed_steps=4),
                      BlockManager(400, 4), PageAllocator(512, 4), PageAllocator(6, 4))
        arrivals = {0: [video_request("long", 60)], 10: [image("short", 1, 4, 1)],
                    **({3: [image("stuck", 500, 21, 1)]} if with_l else {})}  # more left than the video: passed
        first = first_tokens(s, arrivals, steps=120)
        return first["short"] - 10

    assert run("srpt", True) <= run("srpt", False) + 1 < run("fcfs", False)


def test_requests_within_one_prefill_budget_of_each_other_go_oldest_first():
    """srpt counts what is left in whole prefill budgets: on the H200, 64 videos of 23,088-23,098 tokens were served
    by their last digits (one waited 21.8 s while later ones took 2.7 s). A newer request one token shorter no
    longer overtakes; one a whole budget shorter still does."""
    def firsts(later_len):
        s = Scheduler(SchedulerConfig(prefill_token_budget=16, scheduling_policy="srpt"), BlockManager(256, 4),
                      PageAllocator(256, 4), PageAllocator(256, 4))
        return first_tokens(s, {0: [text("old", 64, token=1), text("new", later_len, token=2)]})

    near = firsts(63)
    assert near["old"] < near["new"]
    shorter = firsts(32)
    assert shorter["new"] < shorter["old"]
