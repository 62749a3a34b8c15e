"""``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them) through the whole server."""

from __future__ import annotations

import http.client as httplib
import json
import signal

import pytest

from serve_helpers import Server, http

pytestmark = pytest.mark.slow

PROMPT = "The lighthouse keeper opened the door and"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--max-model-len", "512", media_dir=tmp_path_factory.mktemp("media"))
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()


def _stream(server, body):
    """POST ``body`` streamed; returns (the events' JSON bodies, {index: text}, {index: finish_reason})."""
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    conn.close()
    texts, reasons = {}, {}
    for e in events:
        assert e["object"] == "text_completion" and e["id"].startswith("cmpl-")
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return events, texts, reasons


def test_a_completion_is_the_engines_continuation_of_the_prompt(server, client, llm):
    """No chat template: the prompt's tokens continued, as the engine continues them; a string, its token ids and a
    one-prompt batch are the same prompt; max_tokens defaults to 16 (OpenAI's and vLLM's default)."""
    from unifiedserve.engine import SamplingParams

    ids = llm.processor.tokenize(PROMPT)
    ref = llm.generate([(ids, [], SamplingParams(max_tokens=16, ignore_eos=True))])[0]
    for prompt in (PROMPT, ids, [PROMPT], [ids]):
        res = client.completions.create(model="demo-model", prompt=prompt, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert res.object == "text_completion" and res.id.startswith("cmpl-")
        assert res.choices[0].text == ref.text and res.choices[0].finish_reason == "length"
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), 16)
    events, texts, reasons = _stream(server, {"prompt": PROMPT, "temperature": 0, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}})
    assert texts == {0: ref.text} and reasons == {0: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16
    # vLLM's continuous_usage_stats: every choice's event carries its usage so far, 2 choices counted apart
    events, texts, _ = _stream(server, {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "n": 2,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert texts == {0: ref.text, 1: ref.text}
    for index in (0, 1):  # an event per arrival (tokens that arrive together share one), then the finish event
        counts = [e["usage"]["completion_tokens"] for e in events for c in e["choices"] if c["index"] == index]
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 16 and len(counts) > 2
    assert all(e["usage"]["prompt_tokens"] == len(ids) and e["usage"]["total_tokens"] == len(ids) +
               e["usage"]["completion_tokens"] for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 32
    server.wait_idle()


def test_echo_logprobs_stop_strings_and_choices(server, client, llm):
    from unifiedserve.engine import SamplingParams

    ids = llm.processor.tokenize(PROMPT)
    ref = llm.generate([(ids, [], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))])[0]
    res = client.completions.create(model="demo-model", prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].text == PROMPT + ref.text
    _, texts, _ = _stream(server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True,
                                   "ignore_eos": True})
    assert texts == {0: PROMPT + ref.text}
    # logprobs in the legacy format: parallel lists; the top tokens include the sampled one
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    status, whole = http("POST", server.url + "/v1/completions", body)
    assert status == 200, whole
    lp = whole["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert token in top and 2 <= len(top) <= 3
    events, _, _ = _stream(server, body)
    streamed = [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [t for s in streamed for t in s["text_offset"]] == lp["text_offset"]
    assert lp["text_offset"][-1] <= len(whole["choices"][0]["text"])
    # offsets are counted in the text: a token the text skips (a special token) adds nothing, however it is shown
    special = str(llm.processor.tokenizer.token_to_id("<|im_start|>"))
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0, "ignore_eos": True,
            "logit_bias": {special: 100}}
    status, whole = http("POST", server.url + "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["text"] == "", whole
    assert whole["choices"][0]["logprobs"]["tokens"] == ["<|im_start|>"] * 4
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0] * 4
    # a stop string, and n seeded choices
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 2]
    res = client.completions.create(model="demo-model", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                    n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1]
    assert {c.text for c in res.choices} == {ref.text[:ref.text.index(stop)]}
    assert {c.finish_reason for c in res.choices} == {"stop"}
    # the stop string spans tokens: no offset points past the text it cut
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True, "stop": [stop]}
    status, whole = http("POST", server.url + "/v1/completions", body)
    choice = whole["choices"][0]
    assert status == 200 and choice["text"] == ref.text[:ref.text.index(stop)]
    assert max(choice["logprobs"]["text_offset"]) <= len(choice["text"]), choice
    server.wait_idle()


def test_a_batch_of_prompts_is_each_prompts_completion(server, client, llm):
    """OpenAI's batch: prompt p's choice i has index p * n + i (OpenAI's and vLLM's numbering), each the engine's
    continuation of its own prompt; usage counts each prompt once; streamed events carry the same indices."""
    from unifiedserve.engine import SamplingParams

    texts = [PROMPT, "Once upon a time, in a small harbour town,"]
    ids = [llm.processor.tokenize(t) for t in texts]
    refs = [r.text for r in llm.generate([(i, [], SamplingParams(max_tokens=6, ignore_eos=True)) for i in ids])]
    assert refs[0] != refs[1]
    for prompt in (texts, ids, [texts[0], ids[1]]):
        res = client.completions.create(model="demo-model", prompt=prompt, max_tokens=6, temperature=0, n=2,
                                        extra_body={"ignore_eos": True})
        assert [c.index for c in res.choices] == [0, 1, 2, 3]
        assert [c.text for c in res.choices] == [refs[0], refs[0], refs[1], refs[1]]
        assert res.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and res.usage.completion_tokens == 24
    res = client.completions.create(model="demo-model", prompt=texts, max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in res.choices] == [texts[0] + refs[0], texts[1] + refs[1]]
    events, streamed, reasons = _stream(server, {"prompt": texts, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True, "n": 2,
                                                 "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}})
    assert streamed == {0: refs[0], 1: refs[0], 2: refs[1], 3: refs[1]} and set(reasons.values()) == {"length"}
    assert len({e["id"] for e in events}) == 1
    for e in events[:-1]:  # each choice's usage counts its own prompt
        assert e["usage"]["prompt_tokens"] == len(ids[e["choices"][0]["index"] // 2])
    assert events[-1]["usage"] == {"prompt_tokens": len(ids[0]) + len(ids[1]), "completion_tokens": 24,
                                   "total_tokens": len(ids[0]) + len(ids[1]) + 24}
    server.wait_idle()


def test_a_batch_whose_client_goes_away_frees_every_choice(server):
    """2 prompts x n=2, streamed, long: once every choice is generating, the client leaves; all four abort."""
    before = server.metrics().get('unifiedserve_requests_total{finish_reason="abort"}', 0)
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps({
        "prompt": [PROMPT, "Once upon a time"], "n": 2, "max_tokens": 400, "ignore_eos": True, "temperature": 0.8,
        "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    indices = set()
    while len(indices) < 4:
        line = resp.readline()
        assert line, "the stream ended before every choice generated"
        if line.startswith(b"data: ") and line != b"data: [DONE]\n":
            indices.update(c["index"] for c in json.loads(line[6:])["choices"] if c["text"])
    conn.sock.shutdown(2)
    conn.close()
    m = server.wait_idle(timeout=30)
    assert m['unifiedserve_requests_total{finish_reason="abort"}'] - before == 4


@pytest.mark.parametrize("body,status,needle,param", [
    ({"prompt": ""}, 400, "prompt is empty", None),
    ({"prompt": []}, 400, "prompt", "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt[1] is empty", None),
    ({"prompt": [[1], []]}, 400, "prompt[1] is empty", "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt mixes token ids with strings or lists", "prompt"),
    ({"prompt": ["a", [5] * (2**20 + 1)]}, 400, "prompt[1] has 1048577 token ids; at most 1048576", "prompt"),
    ({"prompt": ["a"] * 5, "n": 4}, 400, "a batch of 5 prompts with n=4 asks for 20 choices; this server returns "
                                         "at most 16", "prompt"),
    ({"prompt": ["a"] * 200_000}, 400, "a batch of 200000 prompts with n=1 asks for 200000 choices", "prompt"),
    ({"prompt": ["hi", "word " * 600]}, 400, "the prompt[1] alone needs", None),
    ({"prompt": ["hi", list(range(600))]}, 400, "prompt[1] has 600 token ids; this server's context", "prompt"),
    ({"prompt": ["hi", "x <|video_pad|>"]}, 400, "prompt[1] holds the video placeholder token", "prompt"),
    ({"prompt": "hi <|image_pad|>"}, 400, "the prompt holds the image placeholder token", "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "token id 1000000000 outside the vocabulary", "prompt"),
    # the demo model's embedding has 1280 rows, its tokenizer 1253 tokens: the rest are padding no text has
    ({"prompt": [1, 1279, 1253]}, 400, "token ids 1253, 1279 outside the vocabulary (ids 0..1252)", "prompt"),
    ({"prompt": list(range(600))}, 400, "the prompt has 600 token ids; this server's context holds 512", "prompt"),
    ({"prompt": [5] * (2**20 + 1)}, 400, "prompt has 1048577 token ids; at most 1048576 are accepted", "prompt"),
    ({"prompt": "x" * 20000}, 400, "the prompt holds 20000 characters", "prompt"),
    ({"prompt": "word " * 600}, 400, "the prompt alone needs", None),
    ({"prompt": "hi", "max_tokens": 600}, 400, "maximum context length is 512 tokens", None),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo with logprobs", None),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs: Input should be less than or equal to 20", "logprobs"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix is not supported by this server", None),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of is not supported by this server", None),
    ({"prompt": "hi", "messages": []}, 400, "unknown field 'messages'", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist", "model"),
    ({"prompt": "hi", "n": 17}, 400, "at most 16 choices", "n"),
    ({"prompt": "hi", "min_tokens": 17}, 400, "min_tokens (17) must not exceed max_tokens (16)", None),
])
def test_bad_completion_requests_are_a_clear_4xx(server, body, status, needle, param):
    got, answer = http("POST", server.url + "/v1/completions", body)
    assert got == status and needle in answer["error"]["message"], answer
    if param is not None:
        assert answer["error"]["param"] == param, answer
    server.wait_idle()  # a refused batch leaves no engine request behind


def test_neutral_fields_are_accepted(server):
    got, answer = http("POST", server.url + "/v1/completions",
                       {"prompt": "hi", "max_tokens": 2, "suffix": None, "best_of": 1, "user": "u1"})
    assert got == 200 and answer["usage"]["completion_tokens"] <= 2, answer
    server.wait_idle()


def test_chat_streams_carry_continuous_usage_from_the_role_event(server):
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    resp = conn.getresponse()
    events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    conn.close()
    counts = [e["usage"]["completion_tokens"] for e in events]  # role, tokens' arrivals, finish, usage
    assert counts == sorted(counts) and counts[0] == 0 and counts[1] >= 1 and counts[-2:] == [4, 4]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1]["choices"] == []
    server.wait_idle()
