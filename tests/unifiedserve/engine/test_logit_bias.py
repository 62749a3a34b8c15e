"""OpenAI's ``logit_bias`` and vLLM's ``min_p`` through the engine: against transformers, and bad ids refused."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.engine.core import SequenceState
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.sampling import SamplerState


@pytest.fixture(scope="module")
def engine(demo_path):
    return LLM(demo_path, EngineConfig())


def _tokens(engine, ids, params_list):
    return [o.token_ids for o in engine.generate([(ids, [], p) for p in params_list])]


def test_greedy_logit_bias_equals_transformers_sequence_bias(demo_path, engine, hf_generate):
    """transformers' ``sequence_bias`` with one-token sequences is the same logit bias (fp32 demo model)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_path, dtype=torch.float32).eval()
    ids, _ = engine.build_prompt([{"role": "user", "content": "Name three colours, then three more."}])
    (plain,) = _tokens(engine, ids, [SamplingParams(max_tokens=12, ignore_eos=True)])
    # push the plain answer's own tokens down and two others up: the output must change
    bias = {plain[0]: -5.0, plain[1]: -2.5, 100: 1.5, 1000: 3.0}
    (ours,) = _tokens(engine, ids, [SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=bias)])
    theirs, _ = hf_generate(reference, ids, [], 12, sequence_bias={(t,): b for t, b in bias.items()})
    assert ours == theirs
    assert ours != plain


def test_bias_of_100_forces_a_token_and_logprobs_stay_raw(engine, record_logits):
    ids, _ = engine.build_prompt([{"role": "user", "content": "Say something."}])
    params = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={42: 100.0}, logprobs=0)
    with record_logits(engine) as seen:
        (out,) = engine.generate([(ids, [], params)])
    assert out.token_ids == [42] * 4
    rows = next(iter(seen.values()))
    for row, lp in zip(rows, out.logprobs):  # the log-softmax of the model's logits, not of the biased ones
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row.float(), -1)[42]), abs=1e-5)


def test_seeded_min_p_sampling_is_the_same_whatever_the_batch(engine):
    ids, _ = engine.build_prompt([{"role": "user", "content": "Write a poem."}])
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.3, min_p=0.05, seed=9,
                            logit_bias={7: 2.0})
    (alone,) = _tokens(engine, ids, [params])
    others = [SamplingParams(max_tokens=5 + s, ignore_eos=True, temperature=1.0, seed=s, min_p=0.1 * s)
              for s in range(4)]
    batched = _tokens(engine, ids, [others[0], params, *others[1:]])
    assert batched[1] == alone


def test_ids_outside_the_vocabulary_are_refused_before_anything_is_queued(engine):
    vocab = engine.runner.model.config.text.vocab_size
    ids, _ = engine.build_prompt([{"role": "user", "content": "Hi."}])
    with pytest.raises(ValueError, match=f"token id {vocab} outside the vocabulary"):
        engine.add_request(ids, [], SamplingParams(logit_bias={vocab: 1.0, 3: 1.0}))
    assert not engine.has_unfinished and not engine.core.seqs
    # an adoption (the decode process's side of a hand-off) checks too
    params = SamplingParams(logit_bias={vocab + 5: 1.0})
    seq = SequenceState(params, SamplerState.for_params(params), frozenset(), [1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.core.adopt("x", seq, 3, 0, [0])
    assert "x" not in engine.core.seqs


@pytest.mark.cuda
def test_cuda_logit_bias_and_min_p_equal_cpu(demo_path, engine):
    """The bias pairs go to the GPU in one copy there; greedy tokens are the CPU engine's (fp32), and a seeded
    min_p request reproduces itself on the GPU's generators."""
    gpu = LLM(demo_path, EngineConfig(device="cuda", dtype="float32", num_kv_blocks=256))
    ids, _ = engine.build_prompt([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    eos = min(engine.eos_token_ids)
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={5: 4.0, 77: -3.0, 900: 6.5}),
              SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={42: 100.0}),
              # min_tokens: -inf on the stop ids in the same copy and scatter
              SamplingParams(max_tokens=12, logit_bias={eos: 100.0}, min_tokens=6, stop_token_ids=(42,))]
    assert _tokens(gpu, ids, greedy) == _tokens(engine, ids, greedy)
    assert _tokens(gpu, ids, greedy[2:])[0][6:] == [eos]
    seeded = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.2, min_p=0.1, seed=3, logit_bias={9: 2.0})
    assert _tokens(gpu, ids, [seeded]) == _tokens(gpu, ids, [seeded, greedy[0]])[:1]
