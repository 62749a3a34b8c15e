"""Async scheduling (``EngineConfig.async_scheduling``): a decode-only step is launched before the previous
one is read back. The tokens, logprobs, finish reasons and pool usage are those of the synchronous engine;
only when the host learns them changes (one step later)."""

from __future__ import annotations

import flashcodec
import pytest
import torch

from unifiedserve.engine.core import EngineCore, SequenceState
from unifiedserve.engine.inputs import VisionInput
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.runner import ModelRunner
from unifiedserve.engine.sampling import SamplerState
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig

from json_schemas import PERSON  # noqa: F401  (tests/ on the path: the grammar case below)


@pytest.fixture(scope="module")
def engines(demo_path):
    sync = LLM(demo_path, EngineConfig(num_kv_blocks=256))
    overlapped = LLM(demo_path, EngineConfig(num_kv_blocks=256, async_scheduling=True))
    assert overlapped.core.async_scheduling and not sync.core.async_scheduling
    return sync, overlapped


@pytest.fixture(scope="module")
def prompts(engines, image_factory):
    llm = engines[0]
    image = VisionInput.from_image(flashcodec.decode_image(image_factory(".png", width=97, height=61, seed=5)))
    with_image = llm.build_prompt([{"role": "user", "content": [{"type": "image", "vision": image},
                                                                {"type": "text", "text": "What is it?"}]}])
    text = llm.build_prompt([{"role": "user", "content": "Say something."}])
    other = llm.build_prompt([{"role": "user", "content": "Count to ten, slowly."}])
    return [(*with_image, SamplingParams(max_tokens=9, ignore_eos=True)),  # M-RoPE delta != 0
            (*text, SamplingParams(max_tokens=5, ignore_eos=True)),
            (*text, SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2)),
            (*other, SamplingParams(max_tokens=11, temperature=0.9, top_p=0.9, top_k=50, seed=11,
                                    ignore_eos=True)),
            (*other, SamplingParams(max_tokens=1, ignore_eos=True)),
            # penalties: counted on the device as the overlapped steps sample, the prompt's tokens too
            (*other, SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)),
            (*text, SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=1.0)),
            # logit bias and min_p: rows of one copy and one scatter, and a per-row floor, in the overlapped steps
            (*other, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={13: 8.0, 15: -4.0}, logprobs=1)),
            (*text, SamplingParams(max_tokens=9, temperature=1.2, min_p=0.1, seed=5, ignore_eos=True,
                                   logit_bias={20: 3.0}))]


def summary(outputs):
    return [(o.token_ids, o.finish_reason, o.text, [(lp.logprob, lp.top) for lp in o.logprobs or []])
            for o in outputs]


def same(got, want) -> bool:
    """The same tokens, finish reasons, texts and top-logprob ids; log-probabilities equal up to float
    rounding: the overlapped schedule's batches hold other rows (fed ones), and a CPU GEMM of another
    shape may round the last bit differently (seen: 5e-7 on one machine, exact on another)."""
    def close(a, b):
        return abs(a - b) <= 1e-5

    if len(got) != len(want):
        return False
    for (ids, reason, text, lps), (ids2, reason2, text2, lps2) in zip(got, want):
        if (ids, reason, text) != (ids2, reason2, text2) or len(lps) != len(lps2):
            return False
        for (lp, top), (lp2, top2) in zip(lps, lps2):
            if not close(lp, lp2) or [t for t, _ in top] != [t for t, _ in top2]:
                return False
            if not all(close(v, v2) for (_, v), (_, v2) in zip(top, top2)):
                return False
    return True


def test_same_outputs_as_the_synchronous_engine(engines, prompts):
    sync, overlapped = engines
    expected = summary(sync.generate(prompts))
    assert same(summary(overlapped.generate(prompts)), expected)
    assert overlapped.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}
    assert overlapped.core._pending is None or not overlapped.scheduler.has_work
    assert not overlapped.core._ended


def test_tokens_come_out_one_step_later_and_the_overlap_really_happens(engines, prompts, monkeypatch):
    _, overlapped = engines
    launched, read = [], []
    execute, read_back = overlapped.runner.execute, overlapped.core._read_back

    def spy_execute(out, requests, pending=None):
        launched.append((list(out.decode), pending is not None))
        return execute(out, requests, pending)

    def spy_read_back():
        got = read_back()
        read.append([r for r, _ in got])
        return got

    monkeypatch.setattr(overlapped.runner, "execute", spy_execute)
    monkeypatch.setattr(overlapped.core, "_read_back", spy_read_back)
    p, v, params = prompts[1]  # 5 tokens, text only
    rid = overlapped.add_request(p, v, params)
    steps = []
    while overlapped.has_unfinished:
        steps.append([(r.request_id, len(r.token_ids)) for r in overlapped.step()])
    assert steps[0] == [(rid, 1)]  # the prefill step samples synchronously
    assert steps[1] == []  # the first decode step is launched, nothing read back yet
    assert steps[2:] == [[(rid, n)] for n in range(2, 6)]  # each call reads the previous step back
    # every decode step after the first fed its token from the device; the last one is the extra row of a
    # request that ended in the step read back (its token dropped)
    assert [fed for _, fed in launched[1:]] == [False, True, True, True, True]
    assert len(launched) == 1 + 5 and read[-1] == [rid]


def test_a_new_request_reads_back_first_then_joins(engines, prompts):
    sync, overlapped = engines
    expected = summary(sync.generate(prompts[:2]))
    first = overlapped.add_request(*prompts[0])
    outs = {}
    added = None
    while overlapped.has_unfinished:
        for o in overlapped.step():
            outs[o.request_id] = o
        if added is None and len(outs.get(first).token_ids if first in outs else []) >= 3:
            added = overlapped.add_request(*prompts[1])  # arrives while the first decodes: a prefill step
    assert same(summary([outs[first], outs[added]]), expected)


def test_abort_while_a_step_is_pending(engines, prompts):
    sync, overlapped = engines
    keep_expected = summary(sync.generate([prompts[0]]))
    keep = overlapped.add_request(*prompts[0])
    drop = overlapped.add_request(*prompts[3])
    outs = {}
    steps = 0
    while overlapped.has_unfinished:
        for o in overlapped.step():
            outs[o.request_id] = o
        steps += 1
        if steps == 4:
            assert overlapped.core._pending is not None and drop in overlapped.core._pending.request_ids
            overlapped.abort(drop)
    assert same(summary([outs[keep]]), keep_expected)
    assert outs[drop].finish_reason is None and len(outs[drop].token_ids) < 11  # never finished: aborted
    assert overlapped.pool_usage()["kv_blocks_used"] == 0


def test_stop_tokens_end_requests_the_same_way(engines, prompts):
    """A request that stops on an EOS/stop id mid-way (not at max_tokens): the step launched behind that
    token computes one row too many, which is dropped."""
    sync, overlapped = engines
    p, v, _ = prompts[2]
    probe = sync.generate([(p, v, SamplingParams(max_tokens=12, ignore_eos=True))])[0].token_ids
    stop = SamplingParams(max_tokens=12, stop_token_ids=[probe[4]])  # ends at its 5th token (or sooner)
    batch = [(p, v, stop), prompts[0]]
    expected = summary(sync.generate(batch))
    assert expected[0][1] == "stop" and len(expected[0][0]) <= 5
    assert same(summary(overlapped.generate(batch)), expected)


def test_min_tokens_count_the_token_not_yet_read_back(engines, prompts):
    """min_tokens at the index where the stop id first comes (allowed there) and one past it (banned there): an
    overlapped step samples before the previous step's token is recorded, and must count it anyway."""
    sync, overlapped = engines
    p, v, _ = prompts[0]
    probe = sync.generate([(p, v, SamplingParams(max_tokens=12, ignore_eos=True))])[0].token_ids
    at = next(k for k in range(3, 12) if probe[k] not in probe[:k])  # decoded in overlapped steps
    batch = [(p, v, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[probe[at]], min_tokens=m))
             for m in (at, at + 1)] + [prompts[1]]
    expected = summary(sync.generate(batch))
    assert expected[0][0] == probe[:at + 1] and expected[0][1] == "stop"
    assert expected[1][0][:at + 1] != probe[:at + 1]
    assert same(summary(overlapped.generate(batch)), expected)


def test_grammar_rows_overlap_too_and_match(engines, prompts, monkeypatch):
    """A grammar row beside free ones (greedy and seeded): the same outputs, and its decode steps are launched
    from the device before the previous step is read back (the read-back then comes before the sampling)."""
    import json

    sync, overlapped = engines
    p, v = sync.build_prompt([{"role": "user", "content": "A person as JSON."}])
    params = SamplingParams(max_tokens=40, response_format="json_schema", json_schema=json.dumps(PERSON))
    alone = [(p, v, params)]
    assert same(summary(overlapped.generate(alone)), summary(sync.generate(alone)))
    batch = [(p, v, params), prompts[1], prompts[3]]
    expected = summary(sync.generate(batch))
    fed = []
    execute = overlapped.runner.execute

    def spy_execute(out, requests, pending=None):
        fed.append(pending is not None)
        return execute(out, requests, pending)

    monkeypatch.setattr(overlapped.runner, "execute", spy_execute)
    assert same(summary(overlapped.generate(batch)), expected)
    assert sum(fed) >= len(expected[0][0]) - 2  # every decode step of the grammar row but the first
    if expected[0][1] == "stop":  # the grammar closed: valid JSON
        json.loads(expected[0][2])


def test_decode_only_core_overlaps_and_matches(engines, prompts):
    """The decode process's engine core (adopted requests, decode rows only) with async scheduling."""
    sync, _ = engines
    expected = [o.token_ids for o in sync.generate(prompts[:3])]
    ids = [sync.add_request(p, v, s) for p, v, s in prompts[:3]]
    handed = {}
    while len(handed) < len(ids):
        for rid, r in sync.core.step()[1]:
            request, seq, table, delta = sync.core.hand_off(rid)
            del sync._live[rid]
            handed[rid] = (request.prompt_len, delta, table, seq)
    cfg = sync.config
    runner = ModelRunner(sync.model, num_kv_blocks=cfg.num_kv_blocks, block_size=cfg.block_size, num_patch_pages=0,
                         num_visual_pages=0, page_size=cfg.page_size, kv_storage=sync.runner.kv_cache.tensor)
    decode = EngineCore(Scheduler.decode_only(SchedulerConfig(max_decode_batch=2)), runner, async_scheduling=True)
    for rid in ids:
        prompt_len, delta, table, seq = handed[rid]
        decode.adopt(rid, SequenceState(seq.params, SamplerState.from_bytes(seq.sampler.to_bytes()), seq.stop_ids,
                                        list(seq.output_token_ids)), prompt_len, delta, table)
    tokens = {rid: list(handed[rid][3].output_token_ids) for rid in ids}
    overlapped_steps = 0
    while decode.scheduler.has_work:
        out, sampled = decode.step()
        overlapped_steps += decode._pending is not None
        for rid, r in sampled:
            tokens[rid].append(r.token_id)
            if r.finish_reason is not None:
                decode.finish(rid, r.finish_reason)
    assert [tokens[rid] for rid in ids] == expected
    assert overlapped_steps > 5
    for rid in ids:
        assert sync.scheduler.release(rid)


def test_logprobs_rows_overlap_too(engines, prompts):
    """A row asking for logprobs: computed on the device at launch, copied with the ids, the same values."""
    sync, overlapped = engines
    launched = []
    execute = overlapped.runner.execute

    def spy(out, requests, pending=None):
        launched.append(pending is not None)
        return execute(out, requests, pending)

    overlapped.runner.execute = spy
    batch = [prompts[2], prompts[3], prompts[1]]  # logprobs=2 beside a seeded and a greedy row
    try:
        got = overlapped.generate(batch)
    finally:
        del overlapped.runner.execute
    assert same(summary(got), summary(sync.generate(batch)))
    assert sum(launched) >= 5
    assert len(got[0].logprobs) == 7 and all(len(lp.top) == 2 for lp in got[0].logprobs)


def test_pending_step_on_the_cpu_needs_no_copy():
    from unifiedserve.engine.core import PendingStep

    tokens = torch.tensor([3, 1, 4])
    logits = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    params = [SamplingParams(), SamplingParams(logprobs=1), SamplingParams()]
    pending = PendingStep.launch(["a", "b", "c"], tokens, logits, params)
    assert pending.host[0] is tokens and pending.ready is None and pending.rows == {"a": 0, "b": 1, "c": 2}
    ids, lps = pending.results()
    assert ids == [3, 1, 4] and lps[0] is None and lps[2] is None
    assert lps[1].logprob == pytest.approx(float(logits[1, 1])) and lps[1].top[0][0] == int(logits[1].argmax())
    plain = PendingStep.launch(["a"], tokens[:1], logits[:1], [SamplingParams()])
    assert plain.params is None and plain.results() == ([3], [None])


def test_runner_feeds_pending_tokens_from_the_device(engines, prompts):
    """The runner's half on its own: a decode row whose token is pending takes it from the pending step's
    tensor (at that step's row), one position further than its output list says."""
    from unifiedserve.engine.core import PendingStep

    sync, _ = engines
    p, v, params = prompts[1]
    rid = sync.add_request(p, v, params)
    while not sync.scheduler.requests[rid].output_token_ids:
        sync.step()
    req = sync.scheduler.requests[rid]
    out = sync.scheduler.schedule()
    assert out.decode == [rid]
    plain = sync.runner.execute(out, sync.scheduler.requests)[rid]
    sync.scheduler.commit(out)
    token = int(plain.argmax())
    req.output_token_ids.append(token)  # what the sync step records
    out = sync.scheduler.schedule()
    after_sync = sync.runner.execute(out, sync.scheduler.requests)[rid]
    sync.scheduler.commit(out)
    req.output_token_ids.pop()  # as if the token were still on the device
    pending = PendingStep.launch(["other", rid], torch.tensor([5, token]), torch.zeros(2, 8),
                                 [SamplingParams(), SamplingParams()])
    out = sync.scheduler.schedule()
    fed = sync.runner.execute(out, sync.scheduler.requests, pending)[rid]
    sync.scheduler.commit(out)
    torch.testing.assert_close(fed, after_sync, rtol=0, atol=0)
    sync.abort(rid)


def test_fed_rows_in_order_are_one_slice_and_others_an_index(engines, prompts, monkeypatch):
    """Rows fed from the pending step in its order (the usual async step) are written as one slice copy; rows in
    another order go by index. Both give the logits of the same step run with the tokens on the host."""
    import unifiedserve.engine.runner as runner_module
    from unifiedserve.engine.core import PendingStep

    sync, _ = engines
    kinds = []
    real_feed = runner_module.feed
    monkeypatch.setattr(runner_module, "feed", lambda ids, fed: (kinds.append(type(fed[0]).__name__),
                                                                 real_feed(ids, fed)))
    rids = [sync.add_request(*prompts[i]) for i in (1, 2)]
    reqs = sync.scheduler.requests
    while not all(reqs[r].output_token_ids for r in rids):
        sync.step()
    out = sync.scheduler.schedule()
    assert out.decode == rids
    first = sync.runner.execute(out, reqs)
    sync.scheduler.commit(out)
    tokens = [int(first[r].argmax()) for r in rids]
    for r, t in zip(rids, tokens):
        reqs[r].output_token_ids.append(t)
    out = sync.scheduler.schedule()
    step = sync.runner.execute(out, reqs)
    expected = {r: step[r].clone() for r in rids}
    sync.scheduler.commit(out)
    for r in rids:
        reqs[r].output_token_ids.pop()  # as if the tokens were still on the device
    for order in (rids, rids[::-1]):  # the pending step's rows: as this step's, then reversed
        pending = PendingStep.launch(order, torch.tensor([tokens[rids.index(r)] for r in order]),
                                     torch.zeros(2, 8), [SamplingParams()] * 2)
        out = sync.scheduler.schedule()
        fed = sync.runner.execute(out, reqs, pending)
        sync.scheduler.commit(out)
        for r in rids:
            torch.testing.assert_close(fed[r], expected[r], rtol=0, atol=0)
    assert kinds == ["slice", "Tensor"]
    for r in rids:
        sync.abort(r)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_async_equals_sync_with_graphs(demo_path, dtype):
    """On the GPU: decode steps replay CUDA graphs fed from the device, the ids come back through pinned
    memory behind an event; the tokens equal the synchronous engine's (greedy and seeded)."""
    cfg = dict(device="cuda", dtype=dtype, num_kv_blocks=256, max_cuda_graph_batch=8)
    sync = LLM(demo_path, EngineConfig(**cfg))
    overlapped = LLM(demo_path, EngineConfig(**cfg, async_scheduling=True))
    assert overlapped.runner.graphs is not None
    texts = ["Tell me a story about the sea.", "What is two plus two?", "Describe a red square."]
    prompts = [sync.build_prompt([{"role": "user", "content": t}]) for t in texts]
    batch = [(*prompts[0], SamplingParams(max_tokens=12, ignore_eos=True)),
             (*prompts[1], SamplingParams(max_tokens=7, ignore_eos=True)),
             (*prompts[2], SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)),
             (*prompts[0], SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=1.3,
                                          frequency_penalty=0.4))]
    launched = []
    orig = overlapped.core._read_back

    def spy():
        launched.append(overlapped.core._pending is not None and overlapped.core._pending.ready is not None)
        return orig()

    overlapped.core._read_back = spy
    assert [o.token_ids for o in overlapped.generate(batch)] == [o.token_ids for o in sync.generate(batch)]
    assert sum(launched) >= 5  # steps read back through the pinned copy's event
    assert overlapped.pool_usage()["kv_blocks_used"] == 0


def test_blocks_go_back_to_core_only_after_the_last_write(engines, prompts):
    """The decode process holds a finished request's ReleaseBlocks while a launched step still computes a row
    of it (that row's K/V lands in the request's blocks, and core's next writes there are not ordered after
    this process's stream)."""
    from unifiedserve.runtime.decode_worker import BlockReleases

    _, overlapped = engines
    releases = BlockReleases(overlapped.core)
    short = overlapped.add_request(*prompts[4])  # 1 token: ends at its prefill, synchronously
    longer = overlapped.add_request(*prompts[1])  # 5 tokens
    sent, held_after_end = [], None
    while overlapped.has_unfinished or releases.held:
        finished = [o.request_id for o in overlapped.step() if o.finished]
        if longer in finished:
            assert overlapped.core.writes_pending(longer)  # the extra row launched before its end was known
        sent += releases.ready(finished)
        if longer in finished:
            held_after_end = list(releases.held)
        if not overlapped.has_unfinished and releases.held:
            overlapped.step()  # what the decode worker's has_work does: a step reads the pending one back
    assert held_after_end == [longer] and sent == [short, longer]
    assert not overlapped.core.writes_pending(longer) and overlapped.core._pending is None


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_async_decode_steps_never_wait_for_the_device(demo_path, graphs):
    """Issue 13: an async decode step waits for nothing but the event behind its previous step's pinned copy of
    the sampled ids (an event wait, which torch's sync debug mode does not count). Under
    ``set_sync_debug_mode("error")`` any other wait (a ``.item()``, a ``.tolist()`` of a device tensor, a blocking
    copy in an attention plan or the sampler) raises and names itself in the traceback."""
    engine = LLM(demo_path, EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=256, max_cuda_graph_batch=8,
                                         enforce_eager=not graphs, async_scheduling=True))
    texts = ["Tell me a story about the sea.", "What is two plus two?", "Describe a red square."]
    prompts = [engine.build_prompt([{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=5, ignore_eos=True,
                             repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)]
    engine.generate([(*p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts])  # warm every path
    for p, sp in zip(prompts, params):
        engine.add_request(*p, sp)
    while any(len(r.output_token_ids) < 2 for r in engine.scheduler.requests.values()):
        engine.step()  # prefills, and the first overlapped decode steps
    torch.cuda.synchronize()
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while steps < 8:  # every request still has tokens to make: only decode steps, no finish
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(len(r.output_token_ids) < 16 for r in engine.scheduler.requests.values())
    while engine.has_unfinished:
        engine.step()
    assert engine.pool_usage()["kv_blocks_used"] == 0
