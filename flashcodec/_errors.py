"""Exceptions for user-facing failures. Each message is one line that says what to do."""

from __future__ import annotations

import argparse


class FlashCodecError(Exception):
    """Base class of every error flashcodec raises for bad input."""


class SourceNotFoundError(FlashCodecError, FileNotFoundError):
    """The path given does not exist or is not a readable file."""


class NotAVideoError(FlashCodecError, ValueError):
    """The source could not be opened as a container with a video stream."""


class UnsupportedCodecError(FlashCodecError, ValueError):
    """The container holds a video stream whose codec no available decoder handles."""


class CorruptVideoError(FlashCodecError, ValueError):
    """The stream is truncated or damaged where the requested frames lie."""

    def __init__(self, message: str, failed_frame_indices: list[int] | None = None):
        super().__init__(message)
        #: Display-order indices of the target frames that could not be decoded.
        self.failed_frame_indices = list(failed_frame_indices or [])


class DecodeCancelledError(FlashCodecError):
    """The request was cancelled (``DecodeEngine.cancel``) before its decode finished."""


class VideoTooLargeError(FlashCodecError, ValueError):
    """The video's pictures are larger than the decoder accepts (``max_source_pixels``)."""


class OutputTooLargeError(FlashCodecError, ValueError):
    """A decode's output would not fit the memory this process can still take (checked before decoding)."""


class NoFramesError(FlashCodecError, ValueError):
    """The video stream has no frames (or too few to sample)."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (a library's may span several), or its type's name when it has none."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def error_line(e: BaseException) -> str:
    """``e`` as a CLI's one error line: an ``OSError`` from the system as ``path: reason`` (its strerror, without
    Python's ``[Errno N]`` and quotes), anything else as its message's first line."""
    if isinstance(e, OSError) and not isinstance(e, FlashCodecError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename is not None else e.strerror
    return first_line(e)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse``'s parser with a bad flag reported as one ``error:`` line (and exit status 2), not after the
    whole usage text; ``--help`` is unchanged. Subcommand parsers made with ``add_subparsers`` are of this class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
