"""response_format: grammar-constrained decoding on the demo model (random weights: unconstrained, its
output is never JSON, so every valid output here is the grammar's doing)."""

import json

import numpy as np
import pytest
import torch

from unifiedserve.engine.llm import LLM
from unifiedserve.engine.params import MAX_JSON_SCHEMA_BYTES, SamplingParams
from unifiedserve.engine.sampling import SamplerState, sample
from unifiedserve.engine.structured import Grammar, apply_grammars, check_response_format, tokenizer_info
from json_schemas import PERSON

jsonschema = pytest.importorskip("jsonschema")  # the test extra (validates outputs); the GPU machine lacks it


def schema_params(schema=PERSON, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120), response_format="json_schema",
                          json_schema=json.dumps(schema), **kw)


@pytest.fixture(scope="module")
def engine():
    return LLM()  # the demo model


def prompt(engine, text="Describe a person as JSON."):
    return engine.build_prompt([{"role": "user", "content": text}])[0]


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0, seed=7),
                                dict(temperature=0.7, top_k=50, top_p=0.9, seed=3)],
                         ids=["greedy", "random", "top-k-top-p"])
def test_output_validates_against_the_schema(engine, kw):
    ids = prompt(engine)
    constrained, free = engine.generate([(ids, [], schema_params(**kw)),
                                         (ids, [], SamplingParams(max_tokens=120, **kw))])
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(constrained.text), PERSON)
    with pytest.raises(ValueError):  # the same request without the grammar: the random model writes no JSON
        json.loads(free.text)


def test_seeded_output_is_reproducible_and_batch_independent(engine):
    ids = prompt(engine)
    params = schema_params(temperature=1.0, seed=11)
    alone = engine.generate([(ids, [], params)])[0]
    batched = engine.generate([(ids, [], SamplingParams(max_tokens=5, temperature=1.0)), (ids, [], params),
                               (ids, [], schema_params(temperature=1.0))])[1]
    assert alone.token_ids == batched.token_ids


def test_json_object_ends_at_the_closing_brace(engine):
    out = engine.generate([(prompt(engine), [], SamplingParams(max_tokens=200, response_format="json_object"))])[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    assert engine.eos_token_ids.isdisjoint(out.token_ids)  # ended by the grammar: its last token is text


def test_logprobs_stay_the_models_and_every_token_was_allowed(engine, record_logits):
    ids = prompt(engine)
    params = schema_params(temperature=1.0, seed=5, logprobs=2)
    with record_logits(engine) as rows:
        out = engine.generate([(ids, [], params)])[0]
    logits = torch.stack(rows[out.request_id])  # [steps, vocab]
    reference = torch.log_softmax(logits.float(), dim=-1)
    grammar = Grammar(params, engine.model_dir, engine.eos_token_ids)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(reference[step, token].item(), abs=1e-6)  # raw, not the masked softmax
        allowed = apply_grammars(logits[step:step + 1], [grammar])[0] > float("-inf")
        assert allowed[token] and not allowed.all()
        grammar.accept(token)
    assert grammar.is_complete


def test_stop_tokens_only_where_the_grammar_may_end(engine):
    eos = sorted(engine.eos_token_ids)
    grammar = Grammar(SamplingParams(response_format="json_object"), engine.model_dir, eos)
    vocab = engine.model_config.text.vocab_size
    eos_logits = torch.zeros(1, vocab)
    eos_logits[0, eos] = 100.0  # the model wants to stop at once
    assert apply_grammars(eos_logits, [grammar])[0, eos].isinf().all()  # "" is not a JSON object
    text = engine.processor.tokenize('{"a":1')
    for t in text:
        grammar.accept(t)
    assert not grammar.is_complete and apply_grammars(eos_logits, [grammar])[0, eos].isinf().all()
    for t in engine.processor.tokenize("}"):
        grammar.accept(t)
    assert grammar.is_complete  # the object is closed: nothing may follow, the request ends with "stop"


def test_ignore_eos_and_max_tokens(engine):
    ids = prompt(engine)
    short, no_eos = engine.generate([(ids, [], schema_params(max_tokens=3)),
                                     (ids, [], schema_params(ignore_eos=True))])
    assert short.finish_reason == "length" and len(short.token_ids) == 3  # cut: the caller sees "length"
    assert no_eos.finish_reason == "stop"
    jsonschema.validate(json.loads(no_eos.text), PERSON)


def test_a_grammar_rebuilt_from_the_tokens_so_far_masks_the_same(engine):
    """What decode does with a hand-off: rebuild from params, replay token 0, continue identically."""
    params = schema_params(temperature=1.0, seed=2)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.text.vocab_size
    first = SamplerState.for_params(params, grammar=Grammar(params, engine.model_dir, engine.eos_token_ids))
    tokens = sample(torch.randn(1, vocab, generator=g), [params], [first])
    rebuilt = Grammar(params, engine.model_dir, engine.eos_token_ids, tokens)
    logits = torch.randn(1, vocab, generator=g)
    assert torch.equal(apply_grammars(logits, [first.grammar]), apply_grammars(logits, [rebuilt]))
    bad = engine.processor.tokenize("hello")  # not the start of a JSON object
    with pytest.raises(ValueError, match="do not follow the grammar"):
        Grammar(params, engine.model_dir, engine.eos_token_ids, bad)


def test_apply_grammars_leaves_other_rows_and_its_input_alone(engine):
    vocab = engine.model_config.text.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    grammar = Grammar(SamplingParams(response_format="json_object"), engine.model_dir, engine.eos_token_ids)
    masked = apply_grammars(logits, [None, grammar, None])
    assert torch.equal(logits, before) and torch.equal(masked[[0, 2]], before[[0, 2]])
    allowed = (masked[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed == engine.processor.tokenize("{")  # a JSON object starts with "{" (compact: no blank first)
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    grammar.fill_bitmask(words)
    assert np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].nonzero()[0].tolist() == allowed


def test_tokenizer_info_is_built_once_per_model(engine):
    assert tokenizer_info(str(engine.model_dir)) is tokenizer_info(str(engine.model_dir))
    assert tokenizer_info(str(engine.model_dir)).vocab_size == engine.model_config.text.vocab_size


@pytest.mark.parametrize("kwargs, message", [
    (dict(response_format="xml"), "response_format must be one of"),
    (dict(response_format="json_schema"), "json_schema is given exactly when"),
    (dict(response_format="json_object", json_schema="{}"), "json_schema is given exactly when"),
    (dict(response_format="json_object", strict_schema=True), "strict_schema applies"),
    (dict(response_format="json_schema", json_schema="{not json"), "not valid JSON"),
    (dict(response_format="json_schema", json_schema="[1, 2]"), "a JSON schema is an object"),
    (dict(response_format="json_schema", json_schema=json.dumps({"enum": ["x" * MAX_JSON_SCHEMA_BYTES]})),
     f"at most {MAX_JSON_SCHEMA_BYTES}"),
])
def test_bad_formats_raise_in_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("schema, strict, message", [
    ({"type": "strung"}, False, "Invalid type"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, False, "Unsatisfiable"),
    ({"$ref": "#/definitions/missing"}, False, "does not exist"),
    ({"type": "string", "format": "no-such-format"}, True, "Unknown format"),  # not strict: not enforced
])
def test_bad_schemas_are_refused_before_any_work(schema, strict, message, engine):
    params = schema_params(schema, strict_schema=strict)
    with pytest.raises(ValueError, match=message):
        check_response_format(params)
    with pytest.raises(ValueError, match=message):  # and by the engine, before the request is queued
        engine.add_request(prompt(engine), (), params)
    assert not engine.has_unfinished


@pytest.mark.parametrize("schema", [{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                                    {"anyOf": [{"$ref": "#"}]}])
def test_a_schema_that_admits_no_value_is_refused_at_admission(schema, engine):
    """It compiles (llguidance finds no error in the grammar), but no first token fits: the engine refuses the
    request rather than sampling a token the grammar then rejects."""
    params = schema_params(schema)
    with pytest.raises(ValueError, match="admits no value"):
        engine.add_request(prompt(engine), (), params)
    assert not engine.has_unfinished


DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
            "$defs": {"x": {"$ref": "#/$defs/x"}}}  # '{"a":' fits, then no value can follow


def test_a_schema_that_dead_ends_mid_value_fails_the_request_without_a_bad_token(engine):
    """The first token fits (so admission passes), and later the grammar allows none: the request ends with
    finish reason "error" and the reason, its output the valid prefix, nothing sampled at the dead end kept."""
    other = SamplingParams(max_tokens=6, ignore_eos=True)
    dead, fine = engine.generate([(prompt(engine), (), schema_params(DEAD_END)), (prompt(engine), (), other)])
    assert dead.finish_reason == "error" and "admits no continuation after" in dead.error
    assert dead.text == '{"a":' and engine.processor.decode(dead.token_ids) == '{"a":'
    assert fine.finish_reason == "length" and len(fine.token_ids) == 6  # the batch beside it goes on
    assert not engine.has_unfinished and engine.pool_usage()["kv_blocks_used"] == 0


def test_a_token_the_mask_forbade_fails_the_request_as_the_servers_fault(engine):
    """Should the sampler ever pick a token the grammar's mask forbade (non-finite logits, a bug), the request fails
    with a 500 instead of returning output that breaks its grammar (it used to end with "stop" and the bad token)."""
    from unifiedserve.engine.core import record_tokens
    from unifiedserve.runtime import protocol
    from unifiedserve.runtime.worker import token_message

    params = SamplingParams(max_tokens=8, response_format="json_object")
    state = SamplerState.for_params(params, grammar=Grammar(params, engine.model_dir, engine.eos_token_ids))
    vocab = engine.model_config.text.vocab_size
    allowed = apply_grammars(torch.zeros(1, vocab), [state.grammar])[0] > float("-inf")
    forbidden = int((~allowed).nonzero()[0])
    assert state.error is None
    state.grammar.accept(forbidden)
    assert state.error.startswith(f"internal error: token {forbidden} was sampled against the grammar's mask after 0")
    assert state.error_status == 500

    class Seq:  # what record_tokens reads of a sequence
        sampler, output_token_ids, stop_ids = state, [], ()

    [sampled] = record_tokens([forbidden], [Seq], [None])
    assert sampled.finish_reason == "error" and Seq.output_token_ids == []  # the token is no output
    failed = token_message("r", sampled)
    assert isinstance(failed, protocol.RequestFailed) and failed.status_code == 500
    assert failed.message.startswith("internal error: token")


def test_strict_refuses_what_it_cannot_enforce():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}
    check_response_format(schema_params(schema))  # not strict: the keyword is not enforced
    with pytest.raises(ValueError, match="unevaluatedProperties"):
        check_response_format(schema_params(schema, strict_schema=True))


@pytest.mark.cuda
def test_masks_on_cuda_equal_the_cpu_ones(engine):
    vocab = engine.model_config.text.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    params = schema_params(temperature=1.0, seed=9)
    grammars = [Grammar(params, engine.model_dir, engine.eos_token_ids), None]
    assert torch.equal(apply_grammars(logits.cuda(), grammars).cpu(), apply_grammars(logits, grammars))
    state = SamplerState.for_params(params, "cuda", Grammar(params, engine.model_dir, engine.eos_token_ids))
    tokens = [sample(logits[:1].cuda(), [params], [state])[0] for _ in range(5)]
    Grammar(params, engine.model_dir, engine.eos_token_ids, tokens)  # raises if a token broke the grammar
