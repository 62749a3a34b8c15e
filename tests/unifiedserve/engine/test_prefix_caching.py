"""Prefix cache and media cache in the in-process engine: a follow-up question skips the video's
encode and prefill, and caching never changes a token (same tokens, logits within float noise)."""

from __future__ import annotations

import pytest
import torch

import flashcodec
from unifiedserve.engine.inputs import VisionInput
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.scheduler import SchedulerConfig

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def video(video_factory):
    clip = video_factory(codec="h264", suffix=".mp4", width=128, height=96, duration_s=2.0, fps=24.0, gop=12)
    return VisionInput.from_video(flashcodec.decode_video(clip, num_frames=6, height=56, width=84, output="patches"))


def _engine(demo_path, caching: bool) -> LLM:
    cfg = EngineConfig(num_kv_blocks=256, block_size=4, enable_prefix_caching=caching,
                       media_cache_gb=0.01 if caching else 0.0,
                       scheduler=SchedulerConfig(prefill_token_budget=32, encode_token_budget=64))
    return LLM(demo_path, cfg)


def _ask(engine: LLM, video: VisionInput, question: str, video_first: bool = True):
    parts = [{"type": "video", "vision": video}, {"type": "text", "text": question}]
    ids, vision = engine.build_prompt([{"role": "user", "content": parts if video_first else parts[::-1]}])
    seen = []
    real = engine.runner.model.compute_logits

    def recording(hidden):
        logits = real(hidden)
        seen.append(logits.clone())
        return logits

    encodes = []
    real_encode = engine.runner.model.encode_vision
    engine.runner.model.compute_logits = recording
    engine.runner.model.encode_vision = lambda p, g: encodes.append(len(g)) or real_encode(p, g)
    try:
        out = engine.generate([(ids, vision, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))])[0]
    finally:
        engine.runner.model.compute_logits = real
        engine.runner.model.encode_vision = real_encode
    return out, torch.cat(seen), sum(encodes)


QUESTIONS = [("What happens in this video?", True), ("Which colours are on screen?", True),
             ("What happens in this video?", True), ("Describe the motion.", False)]


def test_follow_ups_reuse_the_video_and_give_the_same_tokens(demo_path, video):
    cached, plain = _engine(demo_path, True), _engine(demo_path, False)
    slices = video.grid_thw[0]
    for n, (question, video_first) in enumerate(QUESTIONS):
        before = cached.scheduler.prefix_hit_tokens
        a, logits_a, encoded_a = _ask(cached, video, question, video_first)
        b, logits_b, encoded_b = _ask(plain, video, question, video_first)
        assert a.token_ids == b.token_ids, f"question {n}: caching changed the output"
        torch.testing.assert_close(logits_a, logits_b, atol=1e-4, rtol=1e-4)
        assert encoded_b == slices  # without caches every slice is encoded every time
        hit = cached.scheduler.prefix_hit_tokens - before
        if n == 0:
            assert hit == 0 and encoded_a == slices
        elif video_first:
            # the template's system text and the whole video come from the prefix cache: nothing to encode
            assert hit > video.num_visual_tokens(2) and encoded_a == 0
        else:
            # the question comes first: the prefix differs, the media cache still spares the encoder
            assert encoded_a == 0
    assert cached.scheduler.media_hit_tokens >= video.num_visual_tokens(2)  # question first: all of it
    assert cached.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}
    assert not cached.runner.media_cache._pins


def test_a_repeated_question_reuses_all_but_the_last_block(demo_path, video):
    engine = _engine(demo_path, True)
    first, _, _ = _ask(engine, video, "Again?")
    hits = engine.scheduler.prefix_hit_tokens
    again, _, encoded = _ask(engine, video, "Again?")
    assert again.token_ids == first.token_ids and encoded == 0
    assert engine.scheduler.prefix_hit_tokens - hits == (first.prompt_len - 1) // 4 * 4


def test_other_pixels_are_never_served_from_the_cache(demo_path, video):
    engine = _engine(demo_path, True)
    _ask(engine, video, "What is this?")
    other = VisionInput("video", video.patches.flip(0).contiguous(), video.grid_thw, video.second_per_grid_t)
    hits = engine.scheduler.media_hit_tokens
    _, _, encoded = _ask(engine, other, "What is this?")
    assert encoded == video.grid_thw[0] and engine.scheduler.media_hit_tokens == hits


def _turn_two(engine: LLM, video: VisionInput, answer: list[int]):
    """Turn one's prompt, its answer's tokens as they were generated, then more text: a chat's next turn."""
    ids, vision = engine.build_prompt([{"role": "user", "content": [{"type": "video", "vision": video},
                                                                    {"type": "text", "text": "What happens?"}]}])
    return ids, vision, [*ids, *answer, *ids[-6:]]


def test_a_later_turn_reuses_the_blocks_the_answer_filled(demo_path, video):
    cached, plain = _engine(demo_path, True), _engine(demo_path, False)
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    ids, vision, _ = _turn_two(cached, video, [])
    answer = cached.generate([(ids, vision, params)])[0].token_ids
    assert answer == plain.generate([(ids, vision, params)])[0].token_ids
    _, _, ids2 = _turn_two(cached, video, answer)
    before = cached.scheduler.prefix_hit_tokens
    scored = SamplingParams(max_tokens=11, ignore_eos=True, logprobs=3)
    a = cached.generate([(ids2, vision, scored)])[0]
    # every full block of the prompt and the answer but its last token (whose K/V nothing computed)
    assert cached.scheduler.prefix_hit_tokens - before == (len(ids) + len(answer) - 1) // 4 * 4 > len(ids) // 4 * 4
    b = plain.generate([(ids2, vision, scored)])[0]
    assert a.token_ids == b.token_ids  # the answer's K/V, read from the cache, are the ones a prefill computes
    for la, lb in zip(a.logprobs, b.logprobs):
        assert [t for t, _ in la.top] == [t for t, _ in lb.top]
        assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    assert cached.pool_usage()["kv_blocks_used"] == 0


def test_a_handed_off_requests_answer_is_cached_when_decode_releases_it(demo_path, video):
    from engine_helpers import decode_side
    from unifiedserve.engine.core import SequenceState
    from unifiedserve.engine.sampling import SamplerState

    engine = _engine(demo_path, True)
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    ids, vision, _ = _turn_two(engine, video, [])
    rid = engine.add_request(ids, vision, params)
    while not engine.scheduler.requests[rid].output_token_ids:
        engine.core.step()
    request, seq, table, delta = engine.core.hand_off(rid)
    del engine._live[rid]
    decode = decode_side(engine)  # the decode process's core on the same KV cache, as in the runtime
    decode.adopt(rid, SequenceState(params, SamplerState.from_bytes(seq.sampler.to_bytes()), seq.stop_ids,
                                    list(seq.output_token_ids)), request.prompt_len, delta, table)
    answer = None
    while answer is None:
        for r, token in decode.step()[1]:
            if token.finish_reason is not None:
                answer = list(decode.seqs[r].output_token_ids)
                decode.finish(r, token.finish_reason)
    assert engine.scheduler.release(rid, answer)  # what ReleaseBlocks carries from the decode process
    _, _, ids2 = _turn_two(engine, video, answer)
    before = engine.scheduler.prefix_hit_tokens
    engine.generate([(ids2, vision, params)])
    assert engine.scheduler.prefix_hit_tokens - before == (len(ids) + len(answer) - 1) // 4 * 4
    assert engine.pool_usage()["kv_blocks_used"] == 0


def test_a_media_key_is_hashed_once_per_tensor_and_again_after_a_write(video, monkeypatch):
    import dataclasses
    import hashlib

    from unifiedserve.engine import llm as llm_module

    calls = []
    real = hashlib.blake2b
    monkeypatch.setattr(llm_module.hashlib, "blake2b", lambda **kw: calls.append(1) or real(**kw))
    mine = dataclasses.replace(video, patches=video.patches.clone())
    key = llm_module._content_key(mine)
    assert llm_module._content_key(mine) == key and len(calls) == 1  # a later turn: no second pass over the pixels
    assert llm_module._content_key(dataclasses.replace(mine, patches=mine.patches.clone())) == key  # equal pixels
    mine.patches[0, 0] += 1  # written in place: the version counter moves, the key follows the pixels
    assert llm_module._content_key(mine) != key and len(calls) == 3
    ident = id(mine.patches)
    del mine
    import gc
    gc.collect()
    assert ident not in llm_module._CONTENT_KEYS  # entries go with their tensors
