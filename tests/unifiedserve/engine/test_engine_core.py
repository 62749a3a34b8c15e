"""The decode side of the engine core: a request handed off by one EngineCore and adopted by a
decode-only one (the decode process's) decodes exactly the tokens the in-process LLM gives."""

import flashcodec
import pytest

from unifiedserve.engine.core import SequenceState
from unifiedserve.engine.inputs import VisionInput
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.request import Request
from unifiedserve.engine.sampling import SamplerState

from engine_helpers import decode_side


@pytest.fixture(scope="module")
def llm(demo_path):
    return LLM(demo_path, EngineConfig(num_kv_blocks=128))


@pytest.fixture(scope="module")
def prompts(llm, image_factory):
    image = VisionInput.from_image(flashcodec.decode_image(image_factory(".png", width=97, height=61, seed=5)))
    with_image = llm.build_prompt([{"role": "user", "content": [{"type": "image", "vision": image},
                                                                {"type": "text", "text": "What is it?"}]}])
    text = llm.build_prompt([{"role": "user", "content": "Say something."}])
    # the image moves the M-RoPE positions of generated tokens (delta != 0); different lengths end apart
    return [(*with_image, SamplingParams(max_tokens=9, ignore_eos=True)),
            (*text, SamplingParams(max_tokens=5, ignore_eos=True)),
            (*text, SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2))]


def test_handed_off_requests_decode_the_llms_tokens(llm, prompts):
    expected = [o.token_ids for o in llm.generate(prompts)]
    assert llm.pool_usage()["kv_blocks_used"] == 0
    # prefill on the LLM's core, then hand each request off as core does, sampler state through bytes
    ids = [llm.add_request(p, v, s) for p, v, s in prompts]
    handed = {}
    while len(handed) < len(ids):
        _, sampled = llm.core.step()
        for rid, r in sampled:
            assert r.index == 0 and r.finish_reason is None
            request, seq, table, delta = llm.core.hand_off(rid)
            del llm._live[rid]
            handed[rid] = (request.prompt_len, delta, table, seq)
    assert set(llm.scheduler.handed_off) == set(ids) and not llm.scheduler.has_work
    used = llm.pool_usage()["kv_blocks_used"]
    assert handed[ids[0]][1] != 0

    decode = decode_side(llm, max_decode_batch=2)
    for rid in ids:
        prompt_len, delta, table, seq = handed[rid]
        sampler = SamplerState.from_bytes(seq.sampler.to_bytes())
        decode.adopt(rid, SequenceState(seq.params, sampler, seq.stop_ids, list(seq.output_token_ids)),
                     prompt_len, delta, table)
    tokens = {rid: list(handed[rid][3].output_token_ids) for rid in ids}
    logprobs = []
    batches = []
    while decode.scheduler.has_work:
        out, sampled = decode.step()
        assert not (out.admitted or out.encode or out.prefill)  # decode rows only
        batches.append(list(out.decode))
        for rid, r in sampled:
            tokens[rid].append(r.token_id)
            if rid == ids[2]:
                logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                assert r.finish_reason == "length"
                decode.finish(rid, r.finish_reason)
    assert [tokens[rid] for rid in ids] == expected
    # at most two at once, oldest first: the third joins when the 5-token request finishes
    assert max(len(b) for b in batches) == 2 and batches[0] == ids[:2] and ids[2] in batches[4]
    assert ids[2] not in batches[3]
    assert len(logprobs) == 6 and all(lp is not None for lp in logprobs)
    # the blocks were lent: decode frees none, core frees them on release
    assert llm.pool_usage()["kv_blocks_used"] == used
    for rid in ids:
        assert llm.scheduler.release(rid)
    assert llm.pool_usage()["kv_blocks_used"] == 0


def test_decode_only_scheduler_refuses_new_requests_and_aborts_free_nothing(llm, prompts):
    decode = decode_side(llm, max_decode_batch=4)
    with pytest.raises(ValueError, match="decode-only"):
        decode.scheduler.add(Request("n", [1, 2, 3], SamplingParams()))
    params = SamplingParams(max_tokens=3)
    seq = SequenceState(params, SamplerState.for_params(params), frozenset(), [])
    with pytest.raises(ValueError, match="first token"):
        decode.adopt("a", seq, 4, 0, [0])
    seq.output_token_ids.append(7)
    decode.adopt("a", seq, 4, 0, [0])
    with pytest.raises(ValueError, match="duplicate"):
        decode.adopt("a", seq, 4, 0, [0])
    decode.finish("a", "abort")
    assert not decode.scheduler.has_work and not decode.seqs and decode.scheduler.adopted == set()


def test_penalized_requests_decode_the_llms_tokens_after_the_hand_off(llm):
    """The adopter rebuilds a request's counts from the hand-off: the prompt's distinct ids (repetition penalty)
    and the first token. A penalty below 1 draws the output to the prompt's tokens, so the ids are needed."""
    ids, _ = llm.build_prompt([{"role": "user", "content": "Say something."}])
    params = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=0.5, frequency_penalty=0.4)
    (expected,) = [o.token_ids for o in llm.generate([(ids, [], params)])]
    outputs = {}
    for prompt_ids in (sorted(set(ids)), []):
        rid = llm.add_request(ids, [], params)
        while not llm.scheduler.requests[rid].output_token_ids:
            llm.core.step()
        request, seq, table, delta = llm.core.hand_off(rid)
        del llm._live[rid]
        assert seq.sampler.penalty is None and llm.core.penalties.num_in_use == 0
        decode = decode_side(llm)
        decode.adopt(rid, SequenceState(params, SamplerState.from_bytes(seq.sampler.to_bytes()), seq.stop_ids,
                                        list(seq.output_token_ids)), request.prompt_len, delta, table, prompt_ids)
        tokens = list(seq.output_token_ids)
        while decode.scheduler.has_work:
            for _, r in decode.step()[1]:
                tokens.append(r.token_id)
                if r.finish_reason is not None:
                    decode.finish(rid, r.finish_reason)
        assert decode.penalties.num_in_use == 0
        assert llm.scheduler.release(rid)
        outputs[bool(prompt_ids)] = tokens
    assert outputs[True] == expected
    assert outputs[False] != expected
    # a refused adoption gives its penalty row back
    decode = decode_side(llm)
    seq = SequenceState(params, SamplerState.for_params(params), frozenset(), [])
    with pytest.raises(ValueError, match="first token"):
        decode.adopt("x", seq, 4, 0, [0], [1, 2])
    assert decode.penalties.num_in_use == 0 and seq.sampler.penalty is None


def test_a_request_the_runner_refuses_leaves_nothing_queued(demo_path, prompts, monkeypatch):
    """The runner builds a request's tensors after the scheduler queued it; when that fails (media that do not
    match the prompt), the request and its penalty row are undone, and the engine serves the next one (every
    later step used to fail on the request without tensors)."""
    llm = LLM(demo_path, EngineConfig(num_kv_blocks=64))
    ids, vision, _ = prompts[1]
    real = llm.runner.add_request

    def refuse(request, vision):
        raise ValueError("the media do not match the prompt")

    monkeypatch.setattr(llm.runner, "add_request", refuse)
    with pytest.raises(ValueError, match="do not match"):
        llm.add_request(ids, vision, SamplingParams(max_tokens=3, repetition_penalty=1.2), request_id="bad")
    assert not llm.scheduler.has_work and "bad" not in llm.scheduler.requests and not llm.core.seqs
    assert llm.core.penalties.num_in_use == 0
    monkeypatch.setattr(llm.runner, "add_request", real)
    (out,) = llm.generate([(ids, vision, SamplingParams(max_tokens=3, ignore_eos=True))])
    assert out.finish_reason == "length" and len(out.token_ids) == 3
