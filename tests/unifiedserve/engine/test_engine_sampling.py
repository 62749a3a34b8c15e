"""Sampling (seeds, temperature, top-k, top-p) and stop conditions through the engine."""

import pytest
import torch

from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.sampling import SamplerState, sample


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from unifiedserve.model.demo import write_demo_model

    path = tmp_path_factory.mktemp("demo")
    write_demo_model(path)
    return LLM(path, EngineConfig())


def prompt(engine, text="Tell me a story about the sea."):
    return engine.build_prompt([{"role": "user", "content": text}])[0]


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(stop=("",))])
def test_bad_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]])
    for seed in range(30):
        state = SamplerState.for_params(SamplingParams(temperature=1.0, seed=seed))
        assert sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=seed)], [state])[0] in (0, 1)
        state = SamplerState.for_params(SamplingParams(temperature=1.0, seed=seed))
        # softmax mass of token 0 is 0.66, of 0+1 is 0.90: top_p=0.8 keeps exactly those two
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=seed)], [state])[0] in (0, 1)
    state = SamplerState.for_params(SamplingParams(temperature=1.0, seed=0))
    assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.1)], [state])[0] == 0  # always >= 1 token


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    ids = prompt(engine)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([(ids, [], seeded)])[0].token_ids
    other = SamplingParams(max_tokens=8, temperature=1.5, seed=7, ignore_eos=True)
    together = engine.generate([(prompt(engine, "Another question?"), [], other), (ids, [], seeded)])[1].token_ids
    assert alone == together
    different = engine.generate([(ids, [], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=99,
                                                          ignore_eos=True))])[0].token_ids
    assert different != alone


def test_max_tokens_stop_token_ids_and_stop_strings(engine):
    ids = prompt(engine)
    greedy = engine.generate([(ids, [], SamplingParams(max_tokens=10, ignore_eos=True))])[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    out = engine.generate([(ids, [], SamplingParams(max_tokens=10, stop_token_ids=(stop_id,), ignore_eos=True))])[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]
    stop_text = greedy.text[len(greedy.text) // 2:][:3]
    if stop_text.strip():
        cut = engine.generate([(ids, [], SamplingParams(max_tokens=10, stop=(stop_text,), ignore_eos=True))])[0]
        assert cut.finish_reason == "stop" and stop_text not in cut.text
        assert greedy.text.startswith(cut.text)
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}


def test_streamed_deltas_add_up_to_the_text(engine):
    rid = engine.add_request(prompt(engine), [], SamplingParams(max_tokens=12, ignore_eos=True))
    pieces, final = [], None
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id == rid:
                pieces.append(o.new_text)
                final = o
    assert "".join(pieces) == final.text and len(final.token_ids) == 12


def test_abort_frees_everything(engine):
    rid = engine.add_request(prompt(engine), [], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert not engine.has_unfinished
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}
