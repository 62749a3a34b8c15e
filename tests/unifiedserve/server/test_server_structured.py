"""response_format through the whole server: core samples token 0 under the grammar, decode rebuilds
the grammar from the hand-off and goes on (monolithic: core does both); the demo model's weights are
random, so valid JSON is the grammar's doing."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from json_schemas import PERSON
from serve_helpers import Server, http

jsonschema = pytest.importorskip("jsonschema")  # the test extra (validates outputs); the GPU machine lacks it

pytestmark = pytest.mark.slow

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine's outputs for the same requests (the same demo model)."""
    from unifiedserve.engine import LLM, SamplingParams

    llm = LLM()
    ids, _ = llm.build_prompt(MESSAGES)
    schema = dict(response_format="json_schema", json_schema=json.dumps(PERSON), strict_schema=True)
    greedy, sampled, obj = llm.generate([(ids, [], SamplingParams(max_tokens=100, temperature=0.0, **schema)),
                                         (ids, [], SamplingParams(max_tokens=100, **SAMPLED, **schema)),
                                         (ids, [], SamplingParams(max_tokens=100, temperature=0.0,
                                                                  response_format="json_object"))])
    return {"greedy": greedy.text, "sampled": sampled.text, "json_object": obj.text}


@pytest.fixture(scope="module", params=[("unified",), ("monolithic",), ("unified", "--async-scheduling")],
                ids=["unified", "monolithic", "unified-async"])  # async: grammar rows fed from the device too
def server(request, tmp_path_factory):
    policy, *flags = request.param
    srv = Server("--policy", policy, *flags, media_dir=tmp_path_factory.mktemp("structured"))
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()


def _both(client, **kw):
    """The non-streamed completion and the streamed one's text and finish reasons."""
    whole = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=100, **kw)
    chunks = list(client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=100,
                                                 stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return whole.choices[0], text, reasons


@pytest.mark.parametrize("kind, kw", [("greedy", dict(temperature=0)), ("sampled", SAMPLED)])
def test_json_schema_streamed_and_not(client, reference, kind, kw):
    choice, streamed, reasons = _both(client, response_format=PERSON_FORMAT, **kw)
    assert choice.finish_reason == "stop" and reasons == ["stop"]
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert streamed == choice.message.content == reference[kind]  # the same tokens as the in-process engine


def test_json_object(client, reference):
    choice, streamed, reasons = _both(client, response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(choice.message.content), dict) and choice.finish_reason == "stop"
    assert streamed == choice.message.content == reference["json_object"] and reasons == ["stop"]


def test_a_schema_that_dead_ends_mid_value_is_a_400_and_the_server_goes_on(server, client):
    """'{"a":' fits, then no value can: not a rejected token with finish_reason "stop", but the request's error
    (a 400 when not streamed; in the stream, an error event after the tokens that fitted)."""
    dead = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
        "$defs": {"x": {"$ref": "#/$defs/x"}}}}}
    url = server.url + "/v1/chat/completions"
    status, body = http("POST", url, {"messages": MESSAGES, "response_format": dead, "max_tokens": 50})
    assert status == 400 and "response_format: the JSON schema admits no continuation" in body["error"]["message"]
    chunks, error = [], None
    try:
        for c in client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=50, stream=True,
                                                response_format=dead):
            chunks.append(c)
    except openai.APIError as e:  # the client raises on the in-band error event
        error = str(e)
    assert error is not None and "admits no continuation" in error, error
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == '{"a":'
    assert not [c for c in chunks if c.choices and c.choices[0].finish_reason]
    # on the wire: the error event, then [DONE] as every stream ends (vLLM's too)
    status, raw = http("POST", url, {"messages": MESSAGES, "response_format": dead, "max_tokens": 50, "stream": True})
    events = [line for line in raw.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
    assert "admits no continuation" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    ok = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=100, temperature=0,
                                        response_format=PERSON_FORMAT)
    jsonschema.validate(json.loads(ok.choices[0].message.content), PERSON)
    server.wait_idle()


def test_text_format_and_bad_formats(server, client):
    plain = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=8, temperature=0,
                                           response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"
    url = server.url + "/v1/chat/completions"

    def refused(response_format):
        status, body = http("POST", url, {"messages": MESSAGES, "response_format": response_format})
        assert status == 400 and body["error"]["param"].startswith("response_format"), body
        return body["error"]["message"]

    schema = lambda s, **kw: {"type": "json_schema", "json_schema": {"name": "x", "schema": s, **kw}}  # noqa: E731
    assert "Invalid type" in refused(schema({"type": "strung"}))
    assert "Unsatisfiable" in refused(schema({"type": "integer", "minimum": 5, "maximum": 1}))
    assert "unevaluatedProperties" in refused(schema({"unevaluatedProperties": False}, strict=True))
    assert "at most 65536" in refused(schema({"enum": ["x" * 70000]}))
    assert "response_format" in refused({"type": "json_schema", "json_schema": {"name": "x"}})  # no schema
    assert "response_format" in refused({"type": "yaml"})
    assert "response_format" in refused(schema({}, description="a hint for a prompt this server does not write"))
    ok = client.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=100, temperature=0,
                                        response_format=PERSON_FORMAT)  # and it keeps serving
    jsonschema.validate(json.loads(ok.choices[0].message.content), PERSON)
    server.wait_idle()
