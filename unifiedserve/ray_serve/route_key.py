"""The ingress's routing key for a chat request: the identity of its first media, found cheaply.

The replica resolves and checks every media part itself (the API's ``convert_messages``), so the
ingress does only what picking a replica needs: it finds the first ``image_url``/``video_url`` part
and keys that one part, nothing else.

* ``file://`` and ``data:`` URLs: the API's own media key (``server/media_key.py``), computed by the
  API's own code on that one part (a ``stat`` of the file, or the base64 decode and digest of the
  payload), so the router sends a video's questions to the replica whose media and prefix caches
  hold that very key.
* ``http(s)://`` URLs: a key of the URL and the part's options, without fetching anything. The
  API keys downloaded media by a digest of their bytes, which only a download can give; fetching
  here would download every video twice (once to route, once on the replica) and put the whole
  fetch in front of the routing decision. Keyed on the URL, all questions about one URL still meet
  on one replica, which downloads it once and caches it under its content key. What this gives up:
  two URLs of the same bytes route apart, and new bytes behind an old URL route to the old owner
  (which misses its cache and serves them correctly: the cache key is the content's).

Nothing here refuses a request: a body the API would refuse gets ``None`` (least-loaded routing)
or a key, and the replica answers with the API's error.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

# imported with this module, when the ingress starts: imported at the first request instead, the API's prompt code
# (torch included) cost that request about a second
from unifiedserve.server.prompts import convert_messages, with_media_keys
from unifiedserve.server.limits import RequestLimits
from unifiedserve.server.media import MediaError, MediaPolicy
from unifiedserve.server.openai_protocol import ChatCompletionRequest

__all__ = ["route_key", "url_key"]

_MEDIA_PART_TYPES = ("image_url", "video_url")


def route_key(body: bytes, policy: MediaPolicy, limits: RequestLimits, context: str) -> str | None:
    """The routing key of a ``/v1/chat/completions`` body, or None (no media, or nothing to key).

    Args:
        body: the request body as the client sent it.
        policy, limits: the replicas' media policy and request limits (the same flags).
        context: the API's media-key context (the served model name).
    """
    part = _first_media_part(body)
    if part is None:
        return None
    try:
        # one user message holding only that part: the API's conversion resolves just it
        one = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
    except ValidationError:
        return None
    options = one.messages[0].content[0].model_dump()[part["type"]]  # validated: fps 2 and 2.0 are one key
    if options["url"][:7].lower() == "http://" or options["url"][:8].lower() == "https://":
        return url_key(part["type"], options, context)
    try:
        _, media = convert_messages(one, policy, limits)
        return with_media_keys(media, context)[0].key
    except (MediaError, ValueError, RecursionError):  # LimitError is a ValueError
        return None


def url_key(part_type: str, options: dict, context: str) -> str:
    """Key of an http(s) media part: its type (``video_url``/``image_url``), URL and options, unfetched.

    Its own namespace (``"url"``) keeps it apart from the API's content keys.
    """
    text = json.dumps([context, part_type, options], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(("url\x1f" + text).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _first_media_part(body: bytes) -> dict | None:
    """The first ``image_url``/``video_url`` part of the messages, in the API's order; None if none (or no JSON)."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # 5000 nested [ pass the shape check: no key
        return None
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list):
        return None
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in _MEDIA_PART_TYPES:
                return part
    return None
