"""Presence, frequency and repetition penalties: the arithmetic, the count table, and the engine against
transformers."""

from __future__ import annotations

import random

import pytest
import torch

from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.penalties import PenaltyBatch, PenaltyTable, apply_penalties, count_tokens
from unifiedserve.engine.sampling import SamplerState, sample, sample_tensor


def reference_penalties(logits: torch.Tensor, prompt, output, params: SamplingParams) -> torch.Tensor:
    """One row by the definitions, token by token: transformers' repetition penalty over prompt + output, then
    OpenAI's frequency and presence penalties over the output."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            v = out[token]
            out[token] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    for token in set(output):
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


ROWS = [
    (SamplingParams(repetition_penalty=1.3), [1, 2, 2, 7], [3, 3, 9]),
    (SamplingParams(), [], []),  # no penalty: the row is left alone
    (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [5, 6], [6, 6, 6, 11, 0]),
    (SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0), [4], [4, 8, 8]),
]


def test_apply_penalties_follows_the_definitions():
    torch.manual_seed(0)
    vocab = 13
    logits = torch.randn(len(ROWS), vocab) * 3
    raw = logits.clone()
    table = PenaltyTable(vocab)
    rows = [i for i, (p, _, _) in enumerate(ROWS) if p.has_penalties]
    handles = [table.open(ROWS[i][1] if ROWS[i][0].penalizes_prompt else (), ROWS[i][2]) for i in rows]
    got = apply_penalties(logits, PenaltyBatch.of(rows, handles, logits.device), [ROWS[i][0] for i in rows])
    assert torch.equal(logits, raw)  # the caller's logits stay raw (logprobs are read from them)
    for i, (params, prompt, output) in enumerate(ROWS):
        want = reference_penalties(raw[i], prompt if params.penalizes_prompt else [], output, params)
        assert torch.allclose(got[i], want, atol=1e-6), (i, got[i] - want)
    assert torch.equal(got[1], raw[1])


def test_presence_and_frequency_leave_the_prompt_alone():
    table = PenaltyTable(8)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    assert not params.penalizes_prompt
    row = table.open((), [])  # as the engine opens it: no prompt for these two
    logits = torch.zeros(1, 8)
    assert torch.equal(apply_penalties(logits, PenaltyBatch.of([0], [row], logits.device), [params]), logits)


def test_counts_follow_the_sampled_tokens_and_rows_come_back_clean():
    table = PenaltyTable(10)
    a, b = table.open((1, 2), [4]), table.open((), [])
    cpu = torch.device("cpu")
    count_tokens(torch.tensor([7, 4, 4]), PenaltyBatch.of([0, 2], [a, b], cpu))  # batch rows 0 and 2 carry penalties
    count_tokens(torch.tensor([7, 5]), PenaltyBatch.of([0, 1], [a, b], cpu))
    assert table.counts[a.index].tolist() == [0, 0, 0, 0, 1, 0, 0, 2, 0, 0]
    assert table.counts[b.index].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert table.in_prompt[a.index].nonzero().flatten().tolist() == [1, 2]
    a.release()
    a.release()  # twice is harmless
    c = table.open((3,), [])
    assert table.counts[c.index].sum() == 0 and table.in_prompt[c.index].nonzero().flatten().tolist() == [3]
    assert table.num_in_use == 2


def test_the_table_grows_and_keeps_every_row():
    table = PenaltyTable(6)
    handles = [table.open((), [i % 6]) for i in range(20)]
    assert table.rows >= 20 and table.num_in_use == 20
    for i, h in enumerate(handles):
        assert table.counts[h.index].tolist() == [1 if t == i % 6 else 0 for t in range(6)]
    assert table.nbytes == table.rows * 6 * 5


def test_table_refuses_ids_outside_the_vocabulary_and_past_its_capacity():
    table = PenaltyTable(5, capacity=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        table.open((5,), [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        table.open((), [-1])
    table.open(), table.open()
    with pytest.raises(ValueError, match="all 2 penalty rows are in use"):
        table.open()


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                    dict(presence_penalty=float("nan")), dict(repetition_penalty=0.0),
                                    dict(repetition_penalty=2.5), dict(repetition_penalty=-1.0),
                                    dict(frequency_penalty=True), dict(repetition_penalty="1.1")])
def test_bad_penalties_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_greedy_sampling_takes_the_penalized_argmax_and_counts_it():
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    params = SamplingParams(frequency_penalty=0.2)
    table = PenaltyTable(4)
    state = SamplerState(penalty=table.open((), [1]))
    # 3.0 - 0.2 = 2.8 < 2.9: token 2 wins; then 2.9 - 0.2 = 2.7 < 2.8: token 1 again
    assert sample(logits, [params], [state]) == [2]
    assert sample(logits, [params], [state]) == [1]
    assert table.counts[state.penalty.index].tolist() == [0, 2, 1, 0]


@pytest.fixture(scope="module")
def engine(demo_path):
    return LLM(demo_path, EngineConfig())


def _run(engine, ids, params_list):
    outs = engine.generate([(ids, [], p) for p in params_list])
    return [o.token_ids for o in outs]


def test_engine_tokens_follow_the_definitions_at_every_step(engine, record_logits):
    """Each greedy token is the argmax of the raw logits penalized by the definitions, with the history so far."""
    ids, _ = engine.build_prompt([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    cases = [SamplingParams(max_tokens=20, ignore_eos=True, **kw) for kw in
             (dict(repetition_penalty=1.4), dict(frequency_penalty=0.8), dict(presence_penalty=1.5),
              dict(repetition_penalty=0.9, frequency_penalty=0.3, presence_penalty=-0.2))]
    with record_logits(engine) as seen:
        rids = [engine.add_request(ids, [], p) for p in cases]
        final = {}
        while engine.has_unfinished:
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o.token_ids
    plain = _run(engine, ids, [SamplingParams(max_tokens=20, ignore_eos=True)])[0]
    differs = 0
    for rid, params in zip(rids, cases):
        tokens = final[rid]
        assert len(tokens) == 20
        for step, row in enumerate(seen[rid]):
            want = reference_penalties(row, ids if params.penalizes_prompt else [], tokens[:step], params)
            assert tokens[step] == int(want.argmax()), (params, step)
        differs += tokens != plain
    assert differs >= 2  # the penalties changed what the model says (the unpenalized output repeats itself)
    assert engine.core.penalties.num_in_use == 0


def test_engine_repetition_penalty_equals_transformers(demo_path, engine, hf_generate):
    from transformers import Qwen2_5_VLForConditionalGeneration

    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_path, dtype=torch.float32).eval()
    ids, _ = engine.build_prompt([{"role": "user", "content": "Name three colours, then three more."}])
    for penalty in (1.3, 0.85):
        (ours,) = _run(engine, ids, [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=penalty)])
        theirs, _ = hf_generate(reference, ids, [], 12, repetition_penalty=penalty)
        assert ours == theirs, penalty


def test_seeded_penalized_sampling_is_the_same_whatever_the_batch(engine):
    ids, _ = engine.build_prompt([{"role": "user", "content": "Write a poem."}])
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=11, frequency_penalty=0.6,
                            repetition_penalty=1.2)
    (alone,) = _run(engine, ids, [params])
    rng = random.Random(0)
    others = [SamplingParams(max_tokens=rng.randint(3, 20), ignore_eos=True, temperature=1.0, seed=s,
                             presence_penalty=0.5 * (s % 3)) for s in range(5)]
    batched = _run(engine, ids, [others[0], params, *others[1:]])
    assert batched[1] == alone


def test_sampler_tensor_path_counts_on_the_device_rows_it_samples():
    """sample_tensor (the async path) counts the tokens it picks, only for the rows with a penalty row."""
    table = PenaltyTable(5)
    states = [SamplerState(penalty=table.open()), SamplerState(), SamplerState(penalty=table.open())]
    params = [SamplingParams(presence_penalty=1.0), SamplingParams(), SamplingParams(repetition_penalty=1.1)]
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0, 0.0]])
    tokens = sample_tensor(logits, params, states)
    assert tokens.tolist() == [1, 2, 3]
    assert table.counts[states[0].penalty.index].tolist() == [0, 1, 0, 0, 0]
    assert table.counts[states[2].penalty.index].tolist() == [0, 0, 0, 1, 0]


@pytest.mark.cuda
def test_cuda_penalized_greedy_equals_cpu(demo_path, engine):
    """The counts live on the GPU there; the tokens are the CPU engine's (fp32 greedy)."""
    gpu = LLM(demo_path, EngineConfig(device="cuda", dtype="float32", num_kv_blocks=256))
    ids, _ = engine.build_prompt([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    params = [SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.5)]
    assert _run(gpu, ids, params) == _run(engine, ids, params)
    assert gpu.core.penalties.counts.is_cuda and gpu.core.penalties.num_in_use == 0
