"""vLLM's ``min_tokens``, ``include_stop_str_in_output`` and ``skip_special_tokens`` through the engine."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams


@pytest.fixture(scope="module")
def engine(demo_path):
    return LLM(demo_path, EngineConfig())


def _eos(engine) -> int:
    return min(engine.eos_token_ids)


def test_greedy_min_tokens_equals_transformers_min_new_tokens(demo_path, engine):
    """transformers' ``min_new_tokens`` masks the stop ids (its ``eos_token_id``) the same way (fp32 demo model)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(demo_path, dtype=torch.float32).eval()
    ids, _ = engine.build_prompt([{"role": "user", "content": "Name three colours, then three more."}])
    plain = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True))])[0].token_ids
    stop = plain[2]
    at = plain.index(stop)  # where it ends without min_tokens
    for min_tokens in (at, at + 1, at + 3):
        ours = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,),
                                                         min_tokens=min_tokens))])[0]
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=min_tokens,
                                        eos_token_id=[stop], pad_token_id=stop, do_sample=False,
                                        mm_token_type_ids=torch.zeros(1, len(ids), dtype=torch.long))
        assert ours.token_ids == theirs[0, len(ids):].tolist(), min_tokens
        assert stop not in ours.token_ids[:min_tokens]
        if min_tokens == at:
            assert ours.token_ids == plain[:at + 1] and ours.finish_reason == "stop"
        else:
            assert len(ours.token_ids) > min_tokens or ours.finish_reason == "length"


def test_no_stop_id_before_min_tokens_greedy_or_sampled_and_eos_right_after(engine):
    """EOS pushed up by 100 in every row: it comes exactly at index min_tokens, and at once without min_tokens."""
    eos = _eos(engine)
    ids, _ = engine.build_prompt([{"role": "user", "content": "Say something."}])
    rows = [SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, min_tokens=5),
            SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, min_tokens=3, temperature=1.0, seed=4,
                           top_k=40, min_p=0.01),
            SamplingParams(max_tokens=20, logit_bias={eos: 100.0}),
            SamplingParams(max_tokens=20, logit_bias={eos: 100.0}, min_tokens=20)]
    outs = engine.generate([(ids, [], p) for p in rows])
    for out, p in zip(outs[:2], rows):
        assert eos not in out.token_ids[:p.min_tokens] and out.token_ids[p.min_tokens] == eos
        assert len(out.token_ids) == p.min_tokens + 1 and out.finish_reason == "stop"
    assert outs[2].token_ids == [eos] and outs[2].text == ""
    assert len(outs[3].token_ids) == 20 and eos not in outs[3].token_ids and outs[3].finish_reason == "length"
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}


def test_stop_strings_count_only_past_min_tokens(engine):
    ids, _ = engine.build_prompt([{"role": "user", "content": "Tell me a story."}])
    plain = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True))])[0]
    first = engine.processor.decode(plain.token_ids[:1])
    assert first.strip(), "the demo model's first token shows no text: pick another prompt"
    cut = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True, stop=(first,)))])[0]
    assert cut.finish_reason == "stop" and cut.text == "" and len(cut.token_ids) == 1
    late = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True, stop=(first,),
                                                     min_tokens=4))])[0]
    assert late.token_ids == plain.token_ids[:len(late.token_ids)] and len(late.token_ids) >= 4
    assert late.text.startswith(engine.processor.decode(plain.token_ids[:4]))
    rest = late.text[len(engine.processor.decode(plain.token_ids[:1])):]
    assert first not in rest  # cut at the first occurrence that ends past min_tokens, if any


def test_include_stop_str_in_output_and_skip_special_tokens(engine):
    eos = _eos(engine)
    eos_text = engine.processor.decode([eos], skip_special_tokens=False)
    assert eos_text.startswith("<|") and engine.processor.decode([eos]) == ""
    ids, _ = engine.build_prompt([{"role": "user", "content": "Say something."}])
    base = dict(max_tokens=8, logit_bias={eos: 100.0}, min_tokens=2)
    outs = engine.generate([(ids, [], SamplingParams(**base, **kw)) for kw in (
        {}, {"include_stop_str_in_output": True}, {"skip_special_tokens": False},
        {"include_stop_str_in_output": True, "skip_special_tokens": False})])
    assert {len(o.token_ids) for o in outs} == {3} and {o.token_ids[-1] for o in outs} == {eos}
    plain, included, special, both = (o.text for o in outs)
    assert included == plain and special == plain  # EOS is special, and a stop token is not text unless included
    assert both == plain + eos_text
    # a stop string: cut before it, or kept at the end with include_stop_str_in_output
    text = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True))])[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut, kept = engine.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,),
                                                          include_stop_str_in_output=i)) for i in (False, True)])
    assert cut.text == text[:text.index(stop)] and kept.text == cut.text + stop
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_streamed_deltas_add_up_to_the_text_with_a_stop_string(engine):
    ids, _ = engine.build_prompt([{"role": "user", "content": "Tell me a story."}])
    text = engine.generate([(ids, [], SamplingParams(max_tokens=16, ignore_eos=True))])[0].text
    for stop in {text[i:i + 3] for i in range(2, len(text) - 3, 3)}:
        rid = engine.add_request(ids, [], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))
        pieces, final = [], None
        while engine.has_unfinished:
            for o in engine.step():
                pieces.append(o.new_text)
                final = o
        assert final.request_id == rid and "".join(pieces) == final.text == text[:text.index(stop)]


def test_bad_min_tokens_are_refused():
    with pytest.raises(ValueError, match=r"min_tokens \(9\) must not exceed max_tokens \(8\)"):
        SamplingParams(max_tokens=8, min_tokens=9)
    with pytest.raises(ValueError, match="non-negative integer"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="cannot be combined with a response_format"):
        SamplingParams(min_tokens=2, response_format="json_object")
