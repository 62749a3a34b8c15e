"""Caps before memory, refused fields, Unicode, seeds, auth and the streamed body limit (no workers needed).

The API runs in-process with a fake engine client: every refusal here must happen before the
request reaches the workers (the fake records whether it did).
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from unifiedserve.model.demo import write_demo_model
from unifiedserve.model.processor import load_processor
from unifiedserve.runtime import protocol
from unifiedserve.runtime.vision_decoding import _one_line
from unifiedserve.server.api import ServerState, build_app
from unifiedserve.server.engine_client import RequestError
from unifiedserve.server.limits import BodyBudget, BodySizeLimit, RequestLimits
from unifiedserve.server.media import MediaPolicy
from unifiedserve.server.metrics import Metrics

KEY = "s3cret"


class FakeClient:
    """Stands in for the workers: probing returns ``plans``; adding a request ends it with a 503."""

    fatal = None
    healthy = True
    worker_info: dict = {}

    def __init__(self, plans=()):
        self.plans, self.probed, self.added, self.aborted, self.streams = list(plans), [], [], [], {}

    def open(self, request_id):
        return SimpleNamespace(request_id=request_id)

    async def probe(self, stream, media):
        self.probed.append(media)
        return SimpleNamespace(plans=self.plans)

    async def add(self, stream, request):
        self.added.append(request)
        raise RequestError("the fake engine stops here", 503)

    def abort(self, request_id):
        self.aborted.append(request_id)

    gauges: dict = {}  # /metrics: no workers here
    sent_bytes: dict = {}

    def all_gauges(self):
        return {}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(write_demo_model(tmp_path_factory.mktemp("demo")))


@pytest.fixture
def media_dir(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 64)  # only resolved, never decoded by the fake
    return tmp_path


def make_api(processor, media_dir, plans=(), limits=RequestLimits(), max_model_len=4096, generation=None,
             vocab_size=None):
    client = FakeClient(plans)
    state = ServerState(client, processor, Metrics("m"), MediaPolicy(media_dir, (), 2**20), "m", max_model_len,
                        16, (0,), "unified", KEY, limits, vocab_size=vocab_size,
                        body_budget=BodyBudget(limits.inflight_request_bytes))
    if generation is not None:
        state.generation = generation
    http = TestClient(BodySizeLimit(build_app(state), limits.max_request_bytes, state.body_budget))
    http.state = state
    http.headers["Authorization"] = f"Bearer {KEY}"
    return http, client


def video(media_dir, **options):
    return {"type": "video_url", "video_url": {"url": f"file://{media_dir}/clip.mp4", **options}}


def chat(*parts, **fields):
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}], **fields}


@pytest.mark.parametrize("part, needle", [
    (lambda d: video(d, min_pixels=10**12), "messages[0].content[0].video_url.min_pixels is 1000000000000"),
    (lambda d: video(d, max_pixels=10**9), "--max-pixels"),
    (lambda d: {"type": "image_url", "image_url": {"url": f"file://{d}/clip.mp4", "min_pixels": 2 * 10**8}},
     "--max-pixels"),
    (lambda d: video(d, min_pixels=50000, max_pixels=40000), "larger than max_pixels"),
    (lambda d: video(d, max_frames=100000), "--max-frames"),
])
def test_pixel_and_frame_caps_refuse_before_probing(processor, media_dir, part, needle):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", json=chat(part(media_dir)))
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.probed == [] and client.added == []


def test_too_many_media_parts(processor, media_dir):
    http, client = make_api(processor, media_dir, limits=RequestLimits(max_media_per_request=2))
    r = http.post("/v1/chat/completions", json=chat(*[video(media_dir)] * 3))
    assert r.status_code == 400 and "--max-media-per-request" in r.json()["error"]["message"]
    assert client.probed == []


def test_visual_tokens_over_the_context_are_refused_before_expansion(processor, media_dir):
    huge = protocol.MediaPlan("video", (384, 4000, 4000), 1.0, 768, 384.0)  # 1.5e9 visual tokens
    http, client = make_api(processor, media_dir, plans=[huge])
    r = http.post("/v1/chat/completions", json=chat(video(media_dir)))
    assert r.status_code == 400 and "maximum context length is 4096" in r.json()["error"]["message"]
    assert client.added == [] and len(client.aborted) == 1
    sent = client.probed[0][0]
    assert sent.max_frames == RequestLimits().max_frames and sent.shown.startswith("file://")


def test_text_that_cannot_fit_is_refused_before_tokenizing(processor, media_dir, monkeypatch):
    http, client = make_api(processor, media_dir, max_model_len=100)  # 3200 characters at most
    tokenized = []
    monkeypatch.setattr(processor, "tokenize", lambda text, *_: tokenized.append(text) or [1])
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 3201}]})
    assert r.status_code == 400 and "3201 characters" in r.json()["error"]["message"] and "--max-model-len" in r.text
    r = http.post("/v1/chat/completions", json=chat({"type": "text", "text": "y" * 3200}))  # parts count too
    assert r.status_code == 400 and tokenized == [] and "retry-after" not in r.headers
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 3000}]})
    assert tokenized and r.status_code == 503  # within the cap: on to the (fake) engine
    assert r.headers["retry-after"] == "1"  # every 503 says when to come back (the openai client waits that long)


def test_a_body_of_more_json_objects_or_values_than_a_request_holds_is_refused_before_parsing(processor, media_dir):
    """Counted in the raw bytes, before FastAPI parses and validates the body on the event loop (60 MB of empty
    content parts held it 20 s): objects and arrays past 4 per token of --max-model-len plus a JSON schema's, and
    commas past the text's characters and a schema (and a prompt of token ids on the routes that take one). A client
    without the API key is told so first, its body not looked at."""
    # objects and arrays: at most 4 x 100 + 65536; commas: 32 x 100 + 65536, and 2**20 more for token ids
    http, client = make_api(processor, media_dir, max_model_len=100)
    parts = b'{"type":"text","text":""},' * 66_000
    body = b'{"messages":[{"role":"user","content":[' + parts + b'{"type":"text","text":""}]}]}'
    json_headers = {"Content-Type": "application/json"}
    r = http.post("/v1/chat/completions", content=body, headers=json_headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("the request body holds 66005 JSON objects and arrays; a request "
                                                   "to this server holds at most 65936 (4 per token")
    r = http.post("/v1/chat/completions", content=body, headers={**json_headers, "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "invalid or missing API key" in r.text
    commas = b'{"messages":[{"role":"user","content":"hi"}],"logit_bias":{' + b'"5":1,' * 68_800 + b'"6":1}}'
    r = http.post("/v1/chat/completions", content=commas, headers=json_headers)
    assert r.status_code == 400 and "68802 JSON values; a request to this server holds at most 68736 (its text and a" \
        in r.text, r.text
    ids = b",".join(b"1" for _ in range(3200 + 65536 + 2**20 + 2))
    r = http.post("/v1/completions", content=b'{"prompt":[' + ids + b'],"max_tokens":1}', headers=json_headers)
    assert r.status_code == 400 and "JSON values; a request to this server holds at most 1117312 (its text, a prompt " \
        "of token ids" in r.text, r.text
    r = http.post("/tokenize", content=b'{"prompt":[' + ids + b']}', headers=json_headers)
    assert r.status_code == 400 and "JSON values" in r.text
    assert client.added == [] and client.probed == []
    r = http.post("/v1/chat/completions", json=chat(*[{"type": "text", "text": ""}] * 100))  # parsed, then counted
    assert r.status_code == 400 and "101 content parts" in r.json()["error"]["message"]


def test_many_messages_or_parts_are_refused_before_rendering(processor, media_dir, monkeypatch):
    """Empty messages pass the character cap but not the template's tokens around each; nor do empty parts."""
    http, client = make_api(processor, media_dir, max_model_len=100)
    rendered = []
    real = processor.render_chat
    monkeypatch.setattr(processor, "render_chat", lambda messages, *a: rendered.append(1) or real(messages, *a))
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * 26})
    assert r.status_code == 400 and "26 messages" in r.json()["error"]["message"] and "at most 25 fit" in r.text
    r = http.post("/v1/chat/completions", json=chat(*[{"type": "text", "text": ""}] * 100))  # 101 parts
    assert r.status_code == 400 and "101 content parts" in r.json()["error"]["message"]
    assert rendered == [] and client.added == []
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * 25})
    assert rendered and r.status_code == 400  # rendered, then its real length checked against the context
    assert "maximum context length is 100" in r.json()["error"]["message"]
    assert "video" not in r.json()["error"]["message"]  # a text-only request is not told to lower fps


def test_stop_strings_and_top_k_are_bounded(processor, media_dir):
    http, client = make_api(processor, media_dir)
    for fields, param in [({"stop": [str(i) for i in range(65)]}, "stop"), ({"stop": "x" * 1025}, "stop"),
                          ({"top_k": 2**31}, "top_k"), ({"top_k": 10**20}, "top_k")]:
        r = http.post("/v1/chat/completions", json=chat(**fields))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (fields, r.text)
    assert client.added == []
    r = http.post("/v1/chat/completions", json=chat(stop=[str(i) for i in range(64)], top_k=2**31 - 1))
    assert r.status_code == 503 and len(client.added[0].params.stop) == 64


@pytest.mark.parametrize("fields, needle", [
    ({"max_tokens": "2"}, "max_tokens: Input should be a valid integer"),
    ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ({"max_tokens": 2.0}, "max_tokens: Input should be a valid integer"),
    ({"temperature": True}, "temperature: Input should be a valid number"),
    ({"stream": "yes"}, "stream: Input should be a valid boolean"),
    ({"logprobs": "yes"}, "logprobs: Input should be a valid boolean"),
    ({"seed": "1"}, "seed: Input should be a valid integer"),
    ({"presence_penalty": False}, "presence_penalty: Input should be a valid number"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty: Input should be a valid number"),
    ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty: Input should be greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty: Input should be greater than or equal to 0.01"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty: Input should be greater than or equal to 0.01"),
    ({"repetition_penalty": 2.01}, "repetition_penalty: Input should be less than or equal to 2"),
    ({"user": 5}, "user: Input should be a valid string"),
    ({"metadata": [1, 2]}, "metadata: Input should be a valid dictionary"),
    ({"metadata": {"k": 1}}, "metadata.k: Input should be a valid string"),
    # what would be stored or tiered: this server stores nothing and has one tier
    ({"store": True}, "store: true keeps the completion for later, which this server does not do"),
    ({"metadata": {"k": "v"}}, "metadata is kept with stored completions"),
    ({"service_tier": "flex"}, "service_tier 'flex' is not offered: this server has one processing tier"),
    ({"stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "continuous_usage_stats needs include_usage: true"),
    ({"max_tokens": 3, "max_completion_tokens": 7}, "max_tokens (3) and max_completion_tokens (7) disagree"),
])
def test_types_are_strict_and_fields_consistent(processor, media_dir, fields, needle):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.added == []


def test_well_formed_fields_pass(processor, media_dir):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", json=chat(temperature=1, top_p=1, max_tokens=3, max_completion_tokens=3,
                                                    user="u", metadata={}, store=False, service_tier="auto",
                                                    stream=True,
                                                    stream_options={"include_usage": True}))
    assert r.status_code == 503 and client.added[0].params.temperature == 1.0


def test_bodies_that_are_not_json_say_so(processor, media_dir):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    body = r.json()["error"]
    assert r.status_code == 400 and body["message"].startswith("invalid request: the body is not valid JSON")
    assert body["param"] is None
    r = http.post("/v1/chat/completions", content=json.dumps(chat()), headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json (got text/plain)" in r.json()["error"]["message"]
    assert client.added == []


def test_fields_that_are_not_implemented_are_named(processor, media_dir):
    http, client = make_api(processor, media_dir)
    for fields, name in [({"top_logprobs": 3}, "top_logprobs needs logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"tool_choice": "auto"}, "tool_choice"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"frobnicate": 1}, "frobnicate")]:
        r = http.post("/v1/chat/completions", json=chat(**fields))
        assert r.status_code == 400 and name in r.json()["error"]["message"], (fields, r.text)
    r = http.post("/v1/chat/completions", json=chat(video(media_dir, resolution="4k")))
    assert r.status_code == 400 and "resolution" in r.json()["error"]["message"]
    assert client.added == []
    # neutral values and harmless fields pass validation (the fake engine then answers 503)
    r = http.post("/v1/chat/completions", json=chat(logprobs=False, presence_penalty=0, tools=[], user="u",
                                                         response_format={"type": "text"}))
    assert r.status_code == 503 and len(client.added) == 1


def test_placeholder_tokens_in_the_text_are_refused_before_probing(processor, media_dir):
    http, client = make_api(processor, media_dir)
    for text, needle in [("<|image_pad|> hi", "stands for an image part; send each image as an image_url part"),
                         ("look: <|video_pad|>", "stands for a video part; send each video as a video_url part")]:
        r = http.post("/v1/chat/completions", json=chat(video(media_dir), {"type": "text", "text": text}))
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.probed == [] and client.added == []


def test_penalties_reach_the_engine(processor, media_dir):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", json=chat(presence_penalty=-1.5, frequency_penalty=2, repetition_penalty=1.1))
    assert r.status_code == 503
    p = client.added[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-1.5, 2.0, 1.1)


def test_stop_token_ids_reach_the_engine(processor, media_dir):
    http, client = make_api(processor, media_dir)
    assert http.post("/v1/chat/completions", json=chat(stop_token_ids=[7, 3])).status_code == 503
    p = client.added[0].params
    assert p.stop_token_ids == (7, 3) and {7, 3, 0} <= set(client.added[0].stop_token_ids)  # 0: the EOS id
    for bad in ([-1], list(range(65)), ["7"], 7):
        r = http.post("/v1/chat/completions", json=chat(stop_token_ids=bad))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop_token_ids"), r.text
    assert len(client.added) == 1


def test_logit_bias_and_min_p_reach_the_engine(processor, media_dir):
    http, client = make_api(processor, media_dir, vocab_size=1000)
    r = http.post("/v1/chat/completions", json=chat(logit_bias={"999": -100, "5": 2.5, "0": 100}, min_p=0.25))
    assert r.status_code == 503, r.text
    p = client.added[0].params
    assert p.logit_bias == ((0, 100.0), (5, 2.5), (999, -100.0)) and p.min_p == 0.25
    assert http.post("/v1/chat/completions", json=chat(logit_bias={})).status_code == 503
    assert client.added[-1].params.logit_bias == () and client.added[-1].params.min_p == 0.0


@pytest.mark.parametrize("fields, needle", [
    ({"logit_bias": {"1000": 1}}, "logit_bias names token id 1000 outside the vocabulary (ids 0..999)"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5: Input should be less than or equal to 100"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x: a logit_bias key is a token id in decimal (e.g. \"50256\"), got 'x'"),
    ({"logit_bias": {"-3": 1}}, "a logit_bias key is a token id in decimal"),
    ({"logit_bias": {"\u0663": 1}}, "a logit_bias key is a token id in decimal"),  # an Arabic-Indic digit
    ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias names a token id twice"),
    ({"logit_bias": {"5": "1"}}, "logit_bias.5: Input should be a valid number"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias: Dictionary should have at most 1024 items"),
    ({"logit_bias": [[5, 1]]}, "logit_bias: Input should be a valid dictionary"),
    ({"min_p": 1.5}, "min_p: Input should be less than or equal to 1"),
    ({"min_p": -0.1}, "min_p: Input should be greater than or equal to 0"),
])
def test_bad_logit_bias_and_min_p_are_refused(processor, media_dir, fields, needle):
    http, client = make_api(processor, media_dir, vocab_size=1000)
    r = http.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"].startswith("logit_bias" if "logit_bias" in fields else "min_p")
    assert client.added == [] and client.probed == []


@pytest.mark.parametrize("ids, needle", [([1000], "token id 1000 outside"),
                                         ([5, 2**31 - 1, 1001], "ids 1001, 2147483647")])
def test_stop_token_ids_outside_the_vocabulary_are_refused(processor, media_dir, ids, needle):
    """A stop id the model cannot sample would never match: refused before any work, as logit_bias's are."""
    http, client = make_api(processor, media_dir, vocab_size=1000)
    r = http.post("/v1/chat/completions", json=chat(stop_token_ids=ids))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    assert r.json()["error"]["message"].startswith("stop_token_ids names token id") and needle in r.text, r.text
    assert client.added == [] and client.probed == []
    assert http.post("/v1/chat/completions", json=chat(stop_token_ids=[999])).status_code == 503  # reaches the engine
    assert client.added[-1].params.stop_token_ids == (999,)


def test_generation_config_defaults_fill_what_a_request_leaves_out(processor, media_dir):
    from unifiedserve.model.generation import GenerationDefaults

    defaults = GenerationDefaults(temperature=0.1, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=9,
                                  min_p=0.02)
    http, client = make_api(processor, media_dir, generation=defaults)
    assert http.post("/v1/chat/completions", json=chat()).status_code == 503
    p = client.added[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.1, 0.8, 20, 1.05, 9)
    assert p.min_p == 0.02
    # a request's own values win, top_k -1 (off) included; and max_tokens is the request's when it gives one
    assert http.post("/v1/chat/completions", json=chat(temperature=0, top_p=1, top_k=-1, repetition_penalty=1,
                                                       max_tokens=30)).status_code == 503
    p = client.added[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 1.0, 0, 1.0, 30)
    assert http.post("/v1/chat/completions", json=chat(min_p=0)).status_code == 503
    assert client.added[-1].params.min_p == 0.0
    # without a generation config: the OpenAI API's defaults
    http, client = make_api(processor, media_dir)
    assert http.post("/v1/chat/completions", json=chat()).status_code == 503
    p = client.added[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 1.0, 16)


def test_seed_range_and_unicode(processor, media_dir):
    http, client = make_api(processor, media_dir)
    r = http.post("/v1/chat/completions", json=chat(seed=2**70))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    raw = '{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]
    assert "function-after" not in r.text
    raw = json.dumps(chat(stop=["\ud800"]))  # json.dumps escapes the surrogate as \ud800, as a client would
    r = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop")
    assert client.added == []
    r = http.post("/v1/chat/completions", json=chat(seed=2**64 - 1))
    assert r.status_code == 503 and client.added[0].params.seed == 2**64 - 1


def test_bearer_scheme_is_case_insensitive(processor, media_dir):
    http, _ = make_api(processor, media_dir)
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"):
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in ("", KEY, f"Bearer {KEY}x", f"Basic {KEY}"):
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401, header


def test_body_limit_refuses_before_reading(processor, media_dir):
    http, client = make_api(processor, media_dir, limits=RequestLimits(max_request_bytes=4096))
    r = http.post("/v1/chat/completions", content=json.dumps(chat(stop=["x" * 8000])))
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=(b"x" * 1024 for _ in range(10)))  # chunked: no length
    assert r.status_code == 413
    assert re.match(r"the request body is \d+ bytes so far \(chunked\), over this server's limit of 4096 bytes",
                    r.json()["error"]["message"])
    assert client.added == []


def test_the_bodies_held_are_a_metric_and_given_back(processor, media_dir):
    http, client = make_api(processor, media_dir)
    budget = http.state.body_budget
    assert http.post("/v1/chat/completions", json=chat(video(media_dir, max_frames=10**6))).status_code == 400
    assert budget.held == 0  # the request ended: its body is given back
    budget.held = 12345  # as if bodies were being read now
    text = http.get("/metrics").text
    assert 'unifiedserve_request_body_bytes{model_name="m"} 12345.0' in text


def test_body_limit_middleware_reads_nothing_past_a_declared_length():
    received, sent = [], []

    async def app(scope, receive, send):  # pragma: no cover - must never be reached
        raise AssertionError("the app saw a body over the limit")

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(300 * 2**20).encode())]}
    asyncio.run(BodySizeLimit(app, 2**20)(scope, receive, send))
    assert received == [] and sent[0]["status"] == 413
    sent.clear()
    asyncio.run(BodySizeLimit(app, 4096)({"type": "http", "method": "POST", "headers": []}, receive, send))
    assert len(received) == 5 and sent[0]["status"] == 413  # counted as it streamed, stopped past the limit


def test_body_within_the_limit_reaches_the_app_whole():
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())

    chunks = iter([{"type": "http.request", "body": b"ab", "more_body": True},
                   {"type": "http.request", "body": b"cd", "more_body": False}, {"type": "http.disconnect"}])

    async def receive():
        return next(chunks)

    async def send(message):  # pragma: no cover
        pass

    asyncio.run(BodySizeLimit(app, 10)({"type": "http", "method": "POST", "headers": []}, receive, send))
    assert seen == [{"type": "http.request", "body": b"abcd", "more_body": False}, {"type": "http.disconnect"}]


def test_errors_never_show_the_resolved_path():
    ref = protocol.MediaRef("video", path="/srv/real/target.mp4", shown="file:///media/link.mp4")
    line = _one_line(ValueError("/srv/real/target.mp4: not a video\nmore"), ref)
    assert line == "file:///media/link.mp4: not a video"


@pytest.mark.parametrize("kwargs", [dict(max_pixels=0), dict(max_frames=1), dict(max_media_per_request=-1),
                                    dict(max_request_bytes=0)])
def test_bad_limits(kwargs):
    with pytest.raises(ValueError, match="--max-"):
        RequestLimits(**kwargs)


def test_media_declared_as_another_type_is_refused(processor, media_dir):
    import base64

    payload = base64.b64encode((media_dir / "clip.mp4").read_bytes()).decode()
    http, client = make_api(processor, media_dir)
    for part, needle in [
        ({"type": "video_url", "video_url": {"url": f"data:text/plain;base64,{payload}"}},
         "messages[0].content[0].video_url is declared text/plain, not a video (video/*)"),
        ({"type": "video_url", "video_url": {"url": f"data:image/png;base64,{payload}"}}, "declared image/png"),
        ({"type": "image_url", "image_url": {"url": f"data:video/mp4;base64,{payload}"}},
         "image_url is declared video/mp4, not an image (image/*)"),
    ]:
        r = http.post("/v1/chat/completions", json=chat(part))
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert client.probed == []
    for mime in ("video/mp4", "video/x-matroska", "application/octet-stream", "application/mp4"):
        r = http.post("/v1/chat/completions",
                      json=chat({"type": "video_url", "video_url": {"url": f"data:{mime};base64,{payload}"}}))
        assert r.status_code != 400 or "declared" not in r.text, (mime, r.text)
    assert len(client.probed) == 4
