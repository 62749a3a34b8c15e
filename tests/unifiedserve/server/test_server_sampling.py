"""Sampling through the whole server, against the in-process engine: penalties, logit bias and min_p across the
core-to-decode hand-off, ``n`` choices (seeded, sharing the prompt, each stopping on its own, a disconnect freeing
them all), stop token ids and stop strings across tokens, min_tokens and special tokens. The server's other paths:
test_server_e2e.py."""

from __future__ import annotations

import http.client as httplib
import json
import signal

import pytest

from serve_helpers import QUESTION, Server, http, leftovers, video_message

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def media(clip_dir):
    return clip_dir, {"video": clip_dir / "clip.mp4"}


@pytest.fixture(scope="module")
def server(clip_dir):
    srv = Server(media_dir=clip_dir)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert leftovers(srv.instance) == []


@pytest.fixture(scope="module")
def video(llm, media):
    """The clip's patches as the engine's vision input, decoded once."""
    import flashcodec
    from unifiedserve.engine import VisionInput

    _, files = media
    return VisionInput.from_video(flashcodec.decode_video(str(files["video"]), output="patches",
                                                          patch_spec=llm.processor.patch_spec))


def test_penalties_cross_the_hand_off(client, media, llm, video):
    """Penalties, logit bias and min_p through the server equal the engine's: core samples the first token,
    decode goes on with the counts rebuilt from the hand-off (the prompt's distinct ids for the repetition
    penalty, the first token) and the request's parameters."""
    from unifiedserve.engine import SamplingParams

    _, files = media
    # a repetition penalty below 1 draws the answer to the prompt's tokens: lost prompt ids would show at once
    penalties = dict(repetition_penalty=0.5, frequency_penalty=0.5, presence_penalty=0.25)
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    cases = [(story, story),
             (video_message(files["video"]),
              [{"role": "user", "content": [{"type": "video", "vision": video}, {"type": "text", "text": QUESTION}]}])]
    for served_messages, engine_messages in cases:
        ids, vision = llm.build_prompt(engine_messages)
        ref = llm.generate([(ids, vision, SamplingParams(max_tokens=24, ignore_eos=True, **penalties))])[0]
        plain = llm.generate([(ids, vision, SamplingParams(max_tokens=24, ignore_eos=True))])[0]
        res = client.chat.completions.create(
            model="demo-model", messages=served_messages, temperature=0, max_tokens=24,
            presence_penalty=penalties["presence_penalty"], frequency_penalty=penalties["frequency_penalty"],
            extra_body={"ignore_eos": True, "repetition_penalty": penalties["repetition_penalty"]})
        assert res.choices[0].message.content == ref.text
        assert ref.token_ids != plain.token_ids  # the penalties changed the answer, so the check above is one
        # a bias against the plain answer's later tokens: decode applies it, not only core's first token
        bias = {plain.token_ids[3]: -6.0, plain.token_ids[5]: -4.0, 77: 2.5}
        sampled = dict(temperature=1.1, seed=1234, min_p=0.08)
        ref = llm.generate([(ids, vision, SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=bias,
                                                         **sampled))])[0]
        res = client.chat.completions.create(
            model="demo-model", messages=served_messages, max_tokens=16, temperature=sampled["temperature"],
            seed=sampled["seed"], logit_bias={str(t): b for t, b in bias.items()},
            extra_body={"ignore_eos": True, "min_p": sampled["min_p"]})
        assert res.choices[0].message.content == ref.text
        greedy = llm.generate([(ids, vision, SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=bias))])[0]
        assert greedy.token_ids[:6] != plain.token_ids[:6]


def _stream_choices(server, body):
    """POST ``body`` with ``stream: true``; returns ({index: text}, {index: finish_reason}, usage, roles, ids)."""
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    texts, reasons, roles, ids, usage = {}, {}, [], set(), None
    for line in resp.read().decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            if "role" in delta:
                roles.append(i)
            texts[i] = texts.get(i, "") + delta.get("content", "")
            assert i not in reasons, "a token after the choice's finish event"
            if choice["finish_reason"] is not None:
                reasons[i] = choice["finish_reason"]
    conn.close()
    return texts, reasons, usage, roles, ids


def test_n_choices_are_seeded_requests_that_share_the_prompt(server, client, media, llm, video):
    """n choices: choice i is the engine's request seeded seed + i (vLLM's rule), streamed or not; the prompt
    is counted once; choices after the first find the video's prompt in the prefix cache."""
    from unifiedserve.engine import SamplingParams

    _, files = media
    ids, vision = llm.build_prompt([{"role": "user", "content": [{"type": "video", "vision": video},
                                                                 {"type": "text", "text": "Describe it twice."}]}])
    seed = 2**64 - 2  # choice 2 wraps to 0
    refs = [llm.generate([(ids, vision, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=s,
                                                       min_p=0.02))])[0] for s in (seed, seed + 1, 0)]
    assert len({r.text for r in refs}) == 3
    server.wait_idle()
    before = server.metrics()
    messages = video_message(files["video"], "Describe it twice.")
    res = client.chat.completions.create(model="demo-model", messages=messages, max_tokens=10, temperature=1.0,
                                         seed=seed, n=3, extra_body={"ignore_eos": True, "min_p": 0.02})
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.message.content for c in res.choices] == [r.text for r in refs]
    assert all(c.finish_reason == "length" for c in res.choices)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), 30)
    after = server.wait_idle()
    hits = after["unifiedserve_prefix_cache_hits_tokens"] - before["unifiedserve_prefix_cache_hits_tokens"]
    # the two later choices found the prompt's full blocks (the video's tokens among them) in the cache
    assert hits >= 2 * (len(ids) - 2 * 16), (hits, len(ids))
    assert after["unifiedserve_time_to_first_token_seconds_count"] - \
        before["unifiedserve_time_to_first_token_seconds_count"] == 1  # one response, one first token
    texts, reasons, usage, roles, response_ids = _stream_choices(server, {
        "messages": messages, "max_tokens": 10, "temperature": 1.0, "seed": seed, "n": 3, "ignore_eos": True,
        "min_p": 0.02})
    assert texts == {i: r.text for i, r in enumerate(refs)} and reasons == {0: "length", 1: "length", 2: "length"}
    assert sorted(roles) == [0, 1, 2] and len(response_ids) == 1
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 30, "total_tokens": len(ids) + 30}
    server.wait_idle()


def test_n_choices_stop_on_their_own(server, client, media):
    """Greedy choices are identical; a stop string ends each where it matches; n above --max-n is refused."""
    res = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "Tell me a story."}],
                                         temperature=0, max_tokens=12, n=2, extra_body={"ignore_eos": True})
    assert res.choices[0].message.content == res.choices[1].message.content
    text = res.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    res = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "Tell me a story."}],
                                         temperature=0, max_tokens=12, n=4, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert {c.message.content for c in res.choices} == {text[:text.index(stop)]}
    assert {c.finish_reason for c in res.choices} == {"stop"}
    for n, needle in ((17, "n is 17; this server returns at most 16 choices per request (--max-n)"),
                      (0, "n: Input should be greater than or equal to 1")):
        status, body = http("POST", server.url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "n": n})
        assert status == 400 and needle in body["error"]["message"] and body["error"]["param"] == "n", body
    server.wait_idle()


def test_stop_token_ids_end_a_choice_where_the_token_comes(server, client, llm):
    """vLLM's stop_token_ids: the choice ends at the token (not in the text), at the first token too."""
    from unifiedserve.engine import SamplingParams

    messages = [{"role": "user", "content": "Tell me a story."}]
    ids, _ = llm.build_prompt(messages)
    plain = llm.generate([(ids, [], SamplingParams(max_tokens=12, ignore_eos=True))])[0]
    for at in (0, 5):  # core samples the first token, decode the rest
        stop = plain.token_ids[at]
        want = plain.token_ids[:plain.token_ids.index(stop)]
        res = client.chat.completions.create(model="demo-model", messages=messages, temperature=0, max_tokens=12,
                                             extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
        assert res.choices[0].finish_reason == "stop"
        assert res.choices[0].message.content == llm.processor.tokenizer.decode(want)
        assert res.usage.completion_tokens == len(want) + 1  # the stop token was generated
    server.wait_idle()


def test_streamed_content_equals_the_whole_with_stop_strings_across_tokens(server, client):
    """A streamed choice never shows the start of a stop string that a later token completes: what is streamed adds
    up to the whole response's content (the part of a stop string in one token waits for the next)."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    text = client.chat.completions.create(model="demo-model", messages=messages, temperature=0, max_tokens=16,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    for stop in sorted({text[i:i + 3] for i in range(1, len(text) - 3, 4)}):
        body = {"messages": messages, "temperature": 0, "max_tokens": 16, "ignore_eos": True, "stop": [stop]}
        whole = client.chat.completions.create(model="demo-model", messages=messages, temperature=0, max_tokens=16,
                                               stop=[stop], extra_body={"ignore_eos": True}).choices[0]
        texts, reasons, _, _, _ = _stream_choices(server, body)
        assert whole.message.content == texts[0] == text[:text.index(stop)], stop
        assert whole.finish_reason == reasons[0] == "stop"
    server.wait_idle()


def test_min_tokens_include_stop_str_and_special_tokens_equal_the_engine(server, client, llm):
    """vLLM's min_tokens, include_stop_str_in_output and skip_special_tokens: the server (core samples the first
    token, decode the rest) equals the engine, streamed or not; bad combinations are a 400 before any work."""
    from unifiedserve.engine import SamplingParams

    eos = min(llm.eos_token_ids)
    messages = [{"role": "user", "content": "Say something."}]
    ids, _ = llm.build_prompt(messages)
    for extra in ({"min_tokens": 4},
                  {"min_tokens": 4, "include_stop_str_in_output": True, "skip_special_tokens": False},
                  {"min_tokens": 1, "temperature": 1.0, "seed": 3, "skip_special_tokens": False}):
        body = {"max_tokens": 10, "logit_bias": {str(eos): 100.0}, "temperature": 0, **extra}
        ref = llm.generate([(ids, [], SamplingParams(**{**body, "logit_bias": {eos: 100.0}}))])[0]
        assert ref.token_ids[-1] == eos and len(ref.token_ids) == extra["min_tokens"] + 1
        res = client.chat.completions.create(model="demo-model", messages=messages, **{
            k: body[k] for k in ("max_tokens", "logit_bias", "temperature", "seed") if k in body}, extra_body={
            k: v for k, v in extra.items() if k not in ("temperature", "seed")})
        texts, reasons, usage, _, _ = _stream_choices(server, {"messages": messages, **body})
        assert res.choices[0].message.content == texts[0] == ref.text, extra
        assert res.choices[0].finish_reason == reasons[0] == "stop"
        assert res.usage.completion_tokens == usage["completion_tokens"] == len(ref.token_ids)
        eos_text = llm.processor.decode([eos], skip_special_tokens=False)
        assert eos_text.startswith("<|") and ref.text.endswith(eos_text) == ("include_stop_str_in_output" in extra)
    for body, needle in (({"max_tokens": 3, "min_tokens": 4}, "min_tokens (4) must not exceed max_tokens (3)"),
                         ({"min_tokens": 2, "response_format": {"type": "json_object"}},
                          "min_tokens cannot be combined with a response_format"),
                         ({"min_tokens": -1}, "min_tokens: Input should be greater than or equal to 0"),
                         # no max_tokens sent: the message says where the default came from
                         ({"min_tokens": 100_000}, "min_tokens (100000) exceeds this request's default completion "
                                                   "length"),
                         ({"skip_special_tokens": "no"}, "skip_special_tokens: Input should be a valid boolean")):
        status, answer = http("POST", server.url + "/v1/chat/completions", {"messages": messages, **body})
        assert status == 400 and needle in answer["error"]["message"], answer
    server.wait_idle()


def test_disconnect_mid_stream_with_choices_frees_everything(server, media):
    _, files = media
    body = json.dumps({"messages": video_message(files["video"]), "max_tokens": 2000, "stream": True, "n": 3,
                       "ignore_eos": True, "temperature": 0.8})
    before = server.metrics().get('unifiedserve_requests_total{finish_reason="abort"}', 0)
    conn = httplib.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    indices = set()
    while len(indices) < 3:  # every choice is generating
        line = resp.readline()
        if line.startswith(b"data: ") and b'"content": "' in line and b'"role"' not in line:
            indices.add(json.loads(line[6:])["choices"][0]["index"])
    conn.sock.shutdown(2)
    conn.close()
    m = server.wait_idle(timeout=30)
    assert m['unifiedserve_requests_total{finish_reason="abort"}'] - before == 3
