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
                                    dict(top_k=-1), dict(stop=("",)), dict(min_p=-0.1), dict(min_p=1.5),
                                    dict(min_p=True), dict(logit_bias={3: 101}), dict(logit_bias={-1: 1.0}),
                                    dict(logit_bias={3: float("nan")}), dict(logit_bias=[(3, 1.0), (3, 2.0)]),
                                    dict(logit_bias=[(3,)]), dict(logit_bias={"3": 1.0}),
                                    dict(logit_bias={i: 1.0 for i in range(1025)}), dict(repetition_penalty=1e-300),
                                    dict(repetition_penalty=0.009)])
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


@pytest.mark.parametrize("knobs", [dict(temperature=1e-300), dict(temperature=1e-40), dict(temperature=9e-6),
                                   dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=1e-46)])
def test_knobs_below_float32s_range_give_the_most_likely_token(knobs):
    """A temperature under 1e-5 is greedy (in float32 the logits divided by 1e-40 or by 1e-300, which is 0 there,
    are inf or NaN, and the argmax of a NaN row is token 0); a top_p that is 0 in float32 still keeps the most
    likely token."""
    logits = torch.tensor([[-3.0, 4.0, 5.0, 0.0, -1.0]])
    params = SamplingParams(seed=3, **knobs)
    assert params.is_greedy == (knobs["temperature"] < 1e-5)
    for seed in range(5):
        params = SamplingParams(seed=seed, **knobs)
        assert sample(logits, [params], [SamplerState.for_params(params)])[0] == 2
    assert not SamplingParams(temperature=1e-5).is_greedy


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


def _reference_row(row_logits, p, generator):
    """The per-request sampler the batched one must match: one row, token by token, vLLM's order (logit bias,
    then temperature, transformers' min-p warper, top-k, top-p), and torch.multinomial."""
    from transformers.generation.logits_process import MinPLogitsWarper

    row_logits = row_logits.float().clone()
    for token, bias in p.logit_bias:
        row_logits[token] += bias
    if p.is_greedy:
        return int(row_logits.argmax())
    row_logits = row_logits / p.temperature
    if p.min_p > 0:
        row_logits = MinPLogitsWarper(p.min_p)(None, row_logits[None])[0]
    if p.top_k and p.top_k < row_logits.shape[0]:
        kth = torch.topk(row_logits, p.top_k).values[-1]
        row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
    probs = torch.softmax(row_logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


MIXED = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
         SamplingParams(temperature=1.0, top_p=0.6, seed=3), SamplingParams(),
         SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=4), SamplingParams(temperature=2.0, seed=5),
         SamplingParams(temperature=1.5, min_p=0.05, seed=6),
         SamplingParams(temperature=1.0, min_p=0.2, top_k=30, seed=7),
         SamplingParams(logit_bias={7: 100.0, 8: -3.5}), SamplingParams(logit_bias={0: -100.0, 299: 12.0}),
         SamplingParams(temperature=0.8, min_p=0.1, top_p=0.95, logit_bias={3: 9.0, 5: -9.0, 11: 4.0}, seed=8)]


def test_batched_sampler_matches_per_request_sampling():
    torch.manual_seed(0)
    for step in range(5):
        logits = torch.randn(len(MIXED), 300) * 4  # [B, vocab]
        batched = sample(logits, MIXED, [SamplerState.for_params(p) for p in MIXED])
        alone = [sample(logits[i:i + 1], [p], [SamplerState.for_params(p)])[0] for i, p in enumerate(MIXED)]
        reference = [_reference_row(logits[i], p, SamplerState.for_params(p).generator) for i, p in enumerate(MIXED)]
        assert batched == alone == reference
        assert batched[0] == int(logits[0].argmax()) and batched[4] == int(logits[4].argmax())
        assert batched[9] == 7  # a bias of 100 on a greedy row wins


def test_64_bit_seeds_draw_differently_on_the_cpu():
    """torch's CPU generator keeps a seed's low 32 bits: seeds that differ only above them drew the same tokens. They
    are mixed into 32 bits first; seeds below 2**32 keep their draws, and CUDA's generator gets the seed as it is."""
    from unifiedserve.engine.sampling import generator_seed

    logits = torch.zeros(1, 1000)  # uniform: the draw is the generator's alone

    def draws(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        state = SamplerState.for_params(params)
        return [sample(logits, [params], [state])[0] for _ in range(8)]

    for a, b in ((5, 5 + 2**32), (0, -2**63), (0, 2**63), (-1, 2**64 - 1 - 2**32), (2**40, 2**40 + 2**33)):
        assert draws(a) != draws(b), (a, b)
    assert draws(-1) == draws(2**64 - 1)  # the same 64-bit seed, signed or not
    g = torch.Generator()
    g.manual_seed(7)
    assert draws(7)[0] == int(torch.empty(1000).exponential_(1.0, generator=g).reciprocal().argmax())  # unchanged
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert generator_seed(5, cpu) == 5 and generator_seed(5 + 2**32, cpu) < 2**32
    assert generator_seed(5 + 2**32, cuda) == 5 + 2**32 and generator_seed(-1, cuda) == 2**64 - 1


def test_min_p_keeps_the_tokens_near_the_most_likely():
    """Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.35 keeps the first two (>= 0.175), 0.05 keeps all four."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for min_p, allowed in ((0.35, {0, 1}), (0.05, {0, 1, 2, 3}), (1.0, {0})):
        seen = {sample(logits, [p], [SamplerState.for_params(p)])[0]
                for p in (SamplingParams(temperature=1.0, min_p=min_p, seed=s) for s in range(300))}
        assert seen == allowed, min_p
    # after temperature: at 0.5 the probabilities are 0.69, 0.25, 0.06, 0.007 (token 2 is 0.09x the first)
    seen = {sample(logits, [p], [SamplerState.for_params(p)])[0]
            for p in (SamplingParams(temperature=0.5, min_p=0.1, seed=s) for s in range(300))}
    assert seen == {0, 1}


def test_logit_bias_leaves_the_callers_logits_raw():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(logit_bias={4: 2.0}), SamplingParams(logit_bias={1: 1.0, 5: 3.0})]
    assert sample(logits, params, [SamplerState.for_params(p) for p in params]) == [4, 5]
    assert not logits.any()


def test_seeded_streams_continue_independently_of_the_batch():
    torch.manual_seed(1)
    steps = [torch.randn(len(MIXED), 200) for _ in range(6)]
    together_states = [SamplerState.for_params(p) for p in MIXED]
    together = [sample(x, MIXED, together_states) for x in steps]
    i, p = 3, MIXED[3]
    state = SamplerState.for_params(p)
    assert [t[i] for t in together] == [sample(x[i:i + 1], [p], [state])[0] for x in steps]


def test_sampler_state_round_trips_through_bytes():
    state = SamplerState.for_params(SamplingParams(temperature=1.0, seed=11))
    logits = torch.randn(1, 100)
    p = [SamplingParams(temperature=1.0)]
    sample(logits, p, [state])
    copy = SamplerState.from_bytes(state.to_bytes())
    assert [sample(logits, p, [state])[0] for _ in range(5)] == [sample(logits, p, [copy])[0] for _ in range(5)]


def test_sampler_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="2 rows"):
        sample(torch.zeros(2, 10), [SamplingParams()], [SamplerState()])


@pytest.mark.cuda
def test_sampler_on_cuda_greedy_equals_cpu_and_seeds_reproduce():
    torch.manual_seed(2)
    logits = torch.randn(len(MIXED), 500) * 3
    cpu = sample(logits, MIXED, [SamplerState.for_params(p) for p in MIXED])
    gpu = sample(logits.cuda(), MIXED, [SamplerState.for_params(p, "cuda") for p in MIXED])
    again = sample(logits.cuda(), MIXED, [SamplerState.for_params(p, "cuda") for p in MIXED])
    greedy = [i for i, p in enumerate(MIXED) if p.is_greedy]
    assert [gpu[i] for i in greedy] == [cpu[i] for i in greedy]
    assert gpu == again


@pytest.mark.cuda
def test_cuda_sampling_queues_its_host_values():
    """Random rows' indices and knobs, and the logprob rows, go up queued (to_device): a pageable copy would
    make the host wait for the step still running, every step an async-scheduled server samples randomly."""
    from unifiedserve.engine.sampling import logprob_tensors, sample_tensor

    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, logprobs=2), SamplingParams()]
    states = [SamplerState.for_params(p, "cuda") for p in params]
    logits = torch.randn(2, 500, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_tensor(logits, params, states)
        logprob_tensors(logits, tokens, params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tokens.shape == (2,) and tokens[1].item() == logits[1].argmax().item()


def test_logprobs_are_the_log_softmax_of_the_model_logits(record_logits):
    """Each token's logprob and its top-k equal log_softmax of the raw logits it was sampled from."""
    engine = LLM()
    ids, vision = engine.build_prompt([{"role": "user", "content": "Hello there"}])
    with record_logits(engine) as rows:
        sampled, greedy, plain = engine.generate([
            (ids, vision, SamplingParams(max_tokens=3, logprobs=4, temperature=0.8, seed=1)),
            (ids, vision, SamplingParams(max_tokens=3, logprobs=0)),
            (ids, vision, SamplingParams(max_tokens=3)),
        ])
    assert plain.logprobs is None and [lp.top for lp in greedy.logprobs] == [[], [], []]
    per_step = torch.stack([torch.stack(rows[o.request_id]) for o in (sampled, greedy)])  # [request, step, vocab]
    for out, logits in zip((sampled, greedy), per_step):
        reference = torch.log_softmax(logits.float(), dim=-1)
        for token, lp, ref in zip(out.token_ids, out.logprobs, reference):
            assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-6)
            values, indices = ref.topk(len(lp.top)) if lp.top else (torch.empty(0), torch.empty(0))
            assert [t for t, _ in lp.top] == indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert all(lp.logprob == pytest.approx(max(ref).item(), abs=1e-6)
               for lp, ref in zip(greedy.logprobs, torch.log_softmax(per_step[1].float(), -1)))


def test_logprobs_bounds():
    with pytest.raises(ValueError, match="logprobs must be an integer in 0..20"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


def test_step_outputs_keep_the_tokens_of_their_step(engine):
    """An output made at step k says the first k tokens (and logprobs) whatever came later: outputs share the
    request's list instead of copying it every step, and read it up to their own length."""
    rid = engine.add_request(prompt(engine), [], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
    seen = []
    while engine.has_unfinished:
        seen += [o for o in engine.step() if o.request_id == rid]
    final = seen[-1]
    assert final.finished and len(final.token_ids) == 6 and len(final.logprobs) == 6
    for k, out in enumerate(seen, start=1):
        assert out.token_ids == final.token_ids[:k] and out.new_token_ids == [final.token_ids[k - 1]]
        assert out.logprobs == final.logprobs[:k]
    assert "[" + ", ".join(map(str, final.token_ids[:3])) not in repr(final)  # not the whole output, each time
