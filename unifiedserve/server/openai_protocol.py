"""The OpenAI chat-completions request schema this server accepts (pydantic), and error bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, as vLLM does


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: str | None = None
    min_pixels: Annotated[int, Field(gt=0)] | None = None
    max_pixels: Annotated[int, Field(gt=0)] | None = None


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Model):
    url: str
    fps: Annotated[float, Field(gt=0, le=120)] | None = None
    max_frames: Annotated[int, Field(ge=2)] | None = None
    min_pixels: Annotated[int, Field(gt=0)] | None = None
    max_pixels: Annotated[int, Field(gt=0)] | None = None


class VideoPart(_Model):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM extension: keep generating past EOS (benchmarks)


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = ("invalid_request_error" if status_code < 500 and status_code not in (401, 404)
            else "authentication_error" if status_code == 401
            else "not_found_error" if status_code == 404 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}
