"""The ingress's routing key: the API's own media key for file:// and data: media, computed on the
first media part only; http(s) media keyed by URL and options without a download (no Ray)."""

from __future__ import annotations

import base64
import json

import pytest

from unifiedserve.ray_serve.route_key import route_key
from unifiedserve.server import media as media_module
from unifiedserve.server.prompts import convert_messages, with_media_keys
from unifiedserve.server.limits import RequestLimits
from unifiedserve.server.media import MediaPolicy
from unifiedserve.server.openai_protocol import ChatCompletionRequest

MODEL = "demo-model"
LIMITS = RequestLimits(max_frames=64)


@pytest.fixture
def folder(tmp_path):
    for name, size in (("a.mp4", 64), ("b.mp4", 96)):
        (tmp_path / name).write_bytes(bytes(range(size)))
    return tmp_path


@pytest.fixture
def policy(folder):
    return MediaPolicy(folder, ("videos.example",), 2**20)


@pytest.fixture
def no_downloads(monkeypatch):
    def refuse(url, policy):
        raise AssertionError(f"downloaded {url}")

    monkeypatch.setattr(media_module, "_download", refuse)


def body(*parts, system: str | None = None) -> bytes:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]})
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()


def video(url: str, **options) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **options}}


def image(url: str, **options) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **options}}


def api_key(raw: bytes, policy: MediaPolicy) -> str:
    """The key the API gives the request's first media (what the replica's caches use)."""
    _, media = convert_messages(ChatCompletionRequest.model_validate_json(raw), policy, LIMITS)
    return with_media_keys(media, MODEL)[0].key


@pytest.mark.parametrize("options", [{}, {"fps": 2}, {"fps": 1.5, "max_frames": 8},
                                     {"min_pixels": 3136, "max_pixels": 50176}])
def test_file_key_is_the_api_media_key(folder, policy, options):
    raw = body(video(f"file://{folder}/a.mp4", **options), video(f"file://{folder}/b.mp4"))
    assert route_key(raw, policy, LIMITS, MODEL) == api_key(raw, policy)


def test_data_url_key_is_the_api_media_key(policy):
    payload = base64.b64encode(bytes(range(200))).decode()
    for part in (image(f"data:image/png;base64,{payload}"), video(f"data:video/mp4;base64,{payload}", fps=1.0)):
        raw = body(part)
        assert route_key(raw, policy, LIMITS, MODEL) == api_key(raw, policy)


def test_only_the_first_media_is_resolved(folder, policy, no_downloads):
    # the second part is neither resolved (missing file) nor fetched: the first alone decides
    first = route_key(body(video(f"file://{folder}/a.mp4")), policy, LIMITS, MODEL)
    for second in (video(f"file://{folder}/missing.mp4"), video("https://videos.example/v.mp4")):
        assert route_key(body(video(f"file://{folder}/a.mp4"), second), policy, LIMITS, MODEL) == first
    # the first media of the messages, in order (a system text before it changes nothing)
    raw = body(video(f"file://{folder}/b.mp4"), video(f"file://{folder}/a.mp4"), system="Be brief.")
    assert route_key(raw, policy, LIMITS, MODEL) == api_key(raw, policy) != first


def test_a_changed_file_gets_a_new_key_as_in_the_api(folder, policy):
    raw = body(video(f"file://{folder}/a.mp4"))
    before = route_key(raw, policy, LIMITS, MODEL)
    (folder / "a.mp4").write_bytes(b"other bytes, other size")
    assert route_key(raw, policy, LIMITS, MODEL) == api_key(raw, policy) != before


def test_http_media_is_keyed_by_url_and_options_without_a_download(policy, no_downloads):
    def key(part):
        return route_key(body(part), policy, LIMITS, MODEL)

    url = "https://videos.example/talk.mp4"
    assert key(video(url, fps=2)) == key(video(url, fps=2.0)) is not None  # validated: one value, one key
    others = {key(video(url)), key(video(url, fps=1.0)), key(video(url + "?v=2", fps=2)),
              key(image(url)), key(video("http://videos.example/talk.mp4", fps=2))}
    assert len(others | {key(video(url, fps=2))}) == 6
    # a host the policy refuses still gets a key: the replica answers the API's 400
    assert key(video("https://elsewhere.example/x.mp4")) is not None


def test_requests_without_a_usable_first_media_get_no_key(folder, policy):
    payload = base64.b64encode(b"x" * 30).decode()
    for raw in (b"not json", b"[1, 2]", json.dumps({"messages": "hi"}).encode(),
                json.dumps({"messages": [{"role": "user", "content": "text only"}]}).encode(),
                body(video(f"file://{folder}/missing.mp4")),           # the API refuses it (400)
                body(video("file:///etc/passwd")),                     # outside the allowed folder
                body(video(f"file://{folder}/a.mp4", max_frames=65)),  # over --max-frames
                body(video(f"file://{folder}/a.mp4", fps=-1)),         # not a valid part
                body(image(f"data:image/png;base64,{payload}!"))):     # not base64
        assert route_key(raw, policy, LIMITS, MODEL) is None, raw[:80]


def test_a_deeply_nested_body_has_no_key_and_no_error(tmp_path):
    """5000 nested lists pass the JSON shape check and broke json.loads with RecursionError: the ingress answered a
    plain-text 500. Without a key it is routed as text, and the replica gives the request its own error."""
    body = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert route_key(body, MediaPolicy(tmp_path), RequestLimits(), "demo") is None
