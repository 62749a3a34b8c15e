"""Video sources: a path, bytes, or a binary file-like object, opened as often as decoders need."""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

from flashcodec._errors import SourceNotFoundError

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, rtsp://, s3:// ... (file:// is a path)

#: What the public API accepts as a video or image source.
SourceLike = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]


@dataclass(frozen=True)
class Source:
    """A re-openable source. Each decoder thread opens its own handle; handles are never shared.

    File-like inputs are read into memory once, because a stream cannot be read by several
    threads at different offsets.
    """

    path: str | None = None
    data: bytes | None = None

    @classmethod
    def of(cls, source: "SourceLike | Source") -> "Source":
        if isinstance(source, Source):
            return source
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if path.startswith("file://"):
                path = path[len("file://"):]
            if not os.path.isfile(path):
                what = ("is a directory" if os.path.isdir(path) else
                        "is not a regular file (a device, pipe or socket)" if os.path.exists(path) else
                        "is a URL: flashcodec reads local files, bytes and binary files (download it first)"
                        if _URL.match(path) else "does not exist")
                raise SourceNotFoundError(f"{path}: {what}")
            return cls(path=path)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return cls(data=bytes(source))
        if hasattr(source, "read"):
            if isinstance(source, io.TextIOBase):  # its read() would decode the bytes as text (UnicodeDecodeError)
                raise TypeError("file-like sources must be opened in binary mode")
            data = source.read()
            if not isinstance(data, (bytes, bytearray)):
                raise TypeError("file-like sources must be opened in binary mode")
            return cls(data=bytes(data))
        raise TypeError(f"unsupported source type {type(source).__name__}: give a path, bytes or a binary file")

    def open(self) -> "str | io.BytesIO":
        """A fresh handle for one reader: the path itself, or a new in-memory stream."""
        return self.path if self.path is not None else io.BytesIO(self.data)

    @property
    def name(self) -> str:
        return self.path if self.path is not None else f"<{len(self.data)} bytes>"

    @property
    def num_bytes(self) -> int:
        return Path(self.path).stat().st_size if self.path is not None else len(self.data)
