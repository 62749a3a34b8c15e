"""A batch of images: JPEGs on the GPU's hardware JPEG decoders (nvJPEG), the rest on CPU threads.

Every image comes out exactly as :func:`flashcodec.image.decode_image` sizes it (EXIF orientation,
``smart_resize`` target, uint8 ``[3, H, W]``), in input order. The split is by magic bytes, not
by file name: data starting with a JPEG SOI marker (``FF D8 FF``) is a JPEG.

How a batch runs (first come, first served on both sides):

1. Each source is sniffed in input order. Non-JPEGs go straight to a CPU thread pool, in order.
2. JPEGs whose header nvJPEG can take (RGB or grayscale, within the pixel and aspect limits) are
   cut into batches of ``batch_size`` in input order; each batch is one
   ``torchvision.io.decode_jpeg(list, device="cuda:N")`` call (the NVJPG engines), then EXIF
   orientation and the reference resize (:func:`flashcodec.resize.resize_frames_on_device`) run on the GPU.
3. JPEGs nvJPEG refuses (CMYK, or any image whose GPU decode raises) join the CPU queue, where
   :func:`~flashcodec.image.decode_image` decodes them or raises its usual clear error.

On the GPU both ``resize`` modes use the video frames' reference resize (torch's antialiased bicubic, float32),
not PIL's bicubic that :func:`decode_image` (and qwen-vl-utils) resize images with: the two differ by a mean of
0.11-0.20 levels, 1 at the 99th percentile and up to 16 at a sharp edge of a slight upscale
(``tests/flashcodec/test_image_batch.py``), and nvJPEG's decode differs from libjpeg's by up to a few levels on
chroma (docs/gpu.md). The ``"fast"`` mode's savings (reduced-scale DCT decode, box pre-reduction) are CPU
techniques, and the GPU resize costs little. CPU-decoded images follow ``resize`` as :func:`decode_image` does.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO
from typing import Callable, Sequence

import torch
from PIL import Image

from flashcodec.devices import DeviceError, gpu_unavailable_reason, log_once, num_visible_gpus, parse_device
from flashcodec.image import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DecodedImage,
    ImageDecodeError,
    _target_size,
    check_image_options,
    decode_image,
)
from flashcodec.resize import DEFAULT_RESIZE_MODE, resize_frames_on_device
from flashcodec.source import Source, SourceLike

__all__ = ["ImageBatchDecoder", "JpegBatchFn", "decode_images", "is_jpeg", "nvjpeg_unavailable_reason"]

log = logging.getLogger(__name__)

#: JPEG start-of-image marker followed by the first marker's 0xFF.
JPEG_MAGIC = b"\xff\xd8\xff"

#: JPEGs per nvJPEG call: large enough to keep all 7 NVJPG engines of an H100 fed.
DEFAULT_BATCH_SIZE = 64

#: Decoded PIL modes whose JPEGs nvJPEG decodes to RGB; CMYK/YCCK go to the CPU.
_NVJPEG_MODES = frozenset({"RGB", "L"})

#: ``jpeg_batch(encoded_list, device) -> decoded_list``: uint8 CPU byte tensors in, uint8
#: ``[3, H, W]`` RGB tensors (stored orientation) out, one per input, in order.
JpegBatchFn = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def is_jpeg(head: bytes) -> bool:
    """Whether data starting with ``head`` (its first bytes, >= 3) is a JPEG."""
    return bytes(head[:3]) == JPEG_MAGIC


def _nvjpeg_batch(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)


def _probe_jpeg() -> bytes:
    buf = BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 90)).save(buf, format="JPEG")
    return buf.getvalue()


@lru_cache(maxsize=None)
def nvjpeg_unavailable_reason(device_index: int) -> str | None:
    """Why nvJPEG cannot decode on GPU ``device_index`` in this process, or None when it can.

    Checks a CUDA build of torch that sees the GPU, an importable torchvision, and one real
    decode of a 16x16 JPEG on that GPU. Cached: the answer does not change in a process.
    """
    reason = gpu_unavailable_reason(device_index)
    if reason is not None:
        return reason
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return "torchvision is not installed"
    except Exception as e:  # a torchvision built for another torch fails with its own error kinds
        return f"torchvision cannot load ({' '.join(str(e).split())[:160] or type(e).__name__})"
    try:
        data = torch.frombuffer(bytearray(_probe_jpeg()), dtype=torch.uint8)
        (out,) = _nvjpeg_batch([data], torch.device("cuda", device_index))
        if tuple(out.shape) != (3, 16, 16) or out.device.type != "cuda":
            return f"torchvision's decode_jpeg returned {tuple(out.shape)} on {out.device} for a 16x16 JPEG"
    except Exception as e:
        return f"nvJPEG decode through torchvision failed ({' '.join(str(e).split())[:160] or type(e).__name__})"
    return None


def apply_orientation(pixels: torch.Tensor, orientation: int | None) -> torch.Tensor:
    """Turn uint8 ``[3, H, W]`` stored pixels into display orientation (EXIF tag 0x0112, 1-8).

    Matches PIL's ``ImageOps.exif_transpose``; any other value leaves the pixels as stored.
    """
    if orientation == 2:
        return pixels.flip(-1)
    if orientation == 3:
        return pixels.flip(-1, -2)
    if orientation == 4:
        return pixels.flip(-2)
    if orientation == 5:
        return pixels.transpose(-1, -2)  # [3, W, H]
    if orientation == 6:
        return pixels.rot90(-1, dims=(-2, -1))  # [3, W, H], a quarter turn clockwise
    if orientation == 7:
        return pixels.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:
        return pixels.rot90(1, dims=(-2, -1))
    return pixels


@dataclass(frozen=True)
class _Options:
    min_pixels: int | None
    max_pixels: int | None
    height: int | None
    width: int | None
    max_image_pixels: int | None
    resize: str

    def check(self) -> None:
        """The same validation as :func:`decode_image`, before any image is read."""
        check_image_options(self.min_pixels, self.max_pixels, self.height, self.width, self.max_image_pixels,
                            self.resize)


@dataclass(frozen=True)
class _GpuJpeg:
    index: int
    source: Source
    data: bytes
    orientation: int | None
    size: tuple[int, int]  # (height, width) in display orientation
    target: tuple[int, int]  # (height, width) of the output


def _read_head(src: Source) -> bytes:
    if src.data is not None:
        return src.data[:3]
    with open(src.path, "rb") as f:
        return f.read(3)


class ImageBatchDecoder:
    """Decodes batches of images: JPEGs on one GPU's nvJPEG, everything else on CPU threads.

    Args:
        device: ``"auto"`` (nvJPEG on cuda:0 when it works, else CPU only; the reason is logged
            once), ``"cuda"`` / ``"cuda:N"`` (nvJPEG on that GPU, the first for ``"cuda"``),
            or ``"cpu"``.
        cpu_threads: threads of the CPU pool (default: one per core).
        batch_size: JPEGs per nvJPEG call.
        output_device: where every result lives; default the nvJPEG GPU when one is used, else
            the CPU (results are moved there, so a batch never mixes devices).
        jpeg_batch: the GPU JPEG decoder (:data:`JpegBatchFn`); default torchvision's nvJPEG.
            Given, it is used as is, without the nvJPEG availability probe (tests, other decoders).

    Raises:
        DeviceError: ``cuda`` / ``cuda:N`` was asked for and nvJPEG cannot run there (says why),
            or ``output_device`` is a GPU that is not visible.
        ValueError: a bad device name, output device, thread count or batch size.
    """

    def __init__(self, device: str = "auto", *, cpu_threads: int | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, output_device: str | torch.device | None = None,
                 jpeg_batch: JpegBatchFn | None = None):
        for name, value in (("cpu_threads", cpu_threads), ("batch_size", batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        name = parse_device(device)
        self.gpu: torch.device | None = None
        if name != "cpu":
            index = int(name[5:]) if name.startswith("cuda:") else 0
            reason = None if jpeg_batch is not None else nvjpeg_unavailable_reason(index)
            if reason is None:
                self.gpu = torch.device("cuda", index)
            elif name == "auto":
                log_once(f"images decode on the CPU: nvJPEG is not usable ({reason})", logging.INFO)
            else:
                raise DeviceError(f"device {name} cannot decode JPEGs with nvJPEG: {reason}; use device cpu or auto")
        self._jpeg_batch = jpeg_batch or _nvjpeg_batch
        self.batch_size = batch_size
        try:
            self.output_device = torch.device(output_device) if output_device is not None else \
                (self.gpu or torch.device("cpu"))
        except (RuntimeError, TypeError):
            raise ValueError(f"output_device must be cpu or cuda:N, got {output_device!r}") from None
        if self.output_device.type == "cuda" and (self.output_device.index or 0) >= num_visible_gpus():
            raise DeviceError(f"output_device {output_device} is not a visible CUDA device")
        self._pool = ThreadPoolExecutor(cpu_threads, thread_name_prefix="flashcodec-image")

    def decode(self, sources: Sequence[SourceLike], *, min_pixels: int | None = None, max_pixels: int | None = None,
               height: int | None = None, width: int | None = None,
               max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
               resize: str = DEFAULT_RESIZE_MODE) -> list[DecodedImage]:
        """Decode ``sources`` (paths, bytes or binary files) in one batch.

        The sizing options are :func:`~flashcodec.image.decode_image`'s and apply to every image.

        Returns:
            one :class:`DecodedImage` per source, in input order, on :attr:`output_device`.

        Raises:
            ImageDecodeError: the first image, in input order, that cannot be decoded (after every
                image was tried); its message names the source.
            flashcodec.SourceNotFoundError: a path that does not exist (before anything is decoded).
            ValueError: invalid options, or ``sources`` is a single source rather than a sequence.
        """
        if isinstance(sources, (str, bytes, bytearray, memoryview)) or not hasattr(sources, "__len__"):
            raise ValueError("sources must be a list of images (paths, bytes or files); "
                             "for one image use flashcodec.decode_image")
        options = _Options(min_pixels, max_pixels, height, width, max_image_pixels, resize)
        options.check()
        srcs = [Source.of(s) for s in sources]
        results: list[DecodedImage | Future | BaseException | None] = [None] * len(srcs)
        batch: list[_GpuJpeg] = []
        for i, src in enumerate(srcs):
            job = self._gpu_job(i, src, options) if self.gpu is not None else None
            if job is None:
                results[i] = self._pool.submit(decode_image, src, **vars(options))
                continue
            batch.append(job)
            if len(batch) == self.batch_size:
                self._run_gpu_batch(batch, options, results)
                batch = []
        if batch:
            self._run_gpu_batch(batch, options, results)
        return self._collect(results)

    def _gpu_job(self, index: int, src: Source, options: _Options) -> _GpuJpeg | None:
        """The JPEG's GPU job, or None when it goes to the CPU (not a JPEG, or nvJPEG cannot take it)."""
        if src.num_bytes == 0 or not is_jpeg(_read_head(src)):
            return None
        if src.data is not None:
            data = src.data
        else:
            with open(src.path, "rb") as f:
                data = f.read()
        try:
            with Image.open(BytesIO(data)) as im:  # the header only: no pixel is decoded here
                w, h = im.size
                mode = im.mode
                orientation = im.getexif().get(0x0112)
        except Exception:  # the CPU path gives the precise error
            return None
        if mode not in _NVJPEG_MODES or w <= 0 or h <= 0:
            return None
        if options.max_image_pixels is not None and w * h > options.max_image_pixels:
            return None  # decode_image raises its "too large" error
        size = (w, h) if orientation in (5, 6, 7, 8) else (h, w)
        try:
            target = _target_size(*size, options.min_pixels, options.max_pixels, options.height, options.width)
        except ImageDecodeError:
            return None  # the aspect-ratio error, raised by decode_image with the source's name
        return _GpuJpeg(index, src, data, orientation, size, target)

    def _run_gpu_batch(self, batch: list[_GpuJpeg], options: _Options, results: list) -> None:
        encoded = [torch.frombuffer(bytearray(job.data), dtype=torch.uint8) for job in batch]
        try:
            decoded = self._jpeg_batch(encoded, self.gpu)
            if len(decoded) != len(batch):
                raise RuntimeError(f"{len(decoded)} images back for {len(batch)}")
        except Exception as e:
            # one bad image fails the whole call; find it by decoding one at a time
            log.debug("nvJPEG batch of %d failed (%s); decoding one by one", len(batch), e)
            decoded = [self._one_on_gpu(x) for x in encoded]
        for job, pixels in zip(batch, decoded):
            out = self._finish_gpu(job, pixels) if pixels is not None else None
            if out is None:  # nvJPEG refused it: the CPU path decodes it or raises the clear error
                results[job.index] = self._pool.submit(decode_image, job.source, **vars(options))
            else:
                results[job.index] = out

    def _one_on_gpu(self, encoded: torch.Tensor) -> torch.Tensor | None:
        try:
            return self._jpeg_batch([encoded], self.gpu)[0]
        except Exception:
            return None

    def _finish_gpu(self, job: _GpuJpeg, pixels: torch.Tensor) -> DecodedImage | None:
        """Orientation and resize on the GPU; None when the decoder's output is not the header's image."""
        pixels = apply_orientation(pixels, job.orientation)  # [3, H, W], display orientation
        if pixels.dtype != torch.uint8 or tuple(pixels.shape) != (3, *job.size):
            return None
        th, tw = job.target
        out = resize_frames_on_device(pixels.unsqueeze(0), th, tw)[0].contiguous()  # [3, th, tw]
        return DecodedImage(pixels=out.to(self.output_device), original_size=job.size)

    def _collect(self, results: list) -> list[DecodedImage]:
        first_error: BaseException | None = None
        done: list[DecodedImage] = []
        for r in results:
            if isinstance(r, Future):
                try:
                    r = r.result()
                except BaseException as e:  # every image is tried; the first error in input order wins
                    first_error = first_error or e
                    continue
            if first_error is None:
                done.append(_moved(r, self.output_device))
        if first_error is not None:
            raise first_error
        return done

    def close(self) -> None:
        """Stop the CPU threads (after the images in flight)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ImageBatchDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _moved(image: DecodedImage, device: torch.device) -> DecodedImage:
    if image.pixels.device == device:
        return image
    return DecodedImage(pixels=image.pixels.to(device), original_size=image.original_size)


def decode_images(sources: Sequence[SourceLike], *, device: str = "auto", cpu_threads: int | None = None,
                  batch_size: int = DEFAULT_BATCH_SIZE, output_device: str | torch.device | None = None,
                  **options) -> list[DecodedImage]:
    """Decode a batch of images: JPEGs on nvJPEG, the rest on CPU threads; results in input order.

    Args:
        sources: paths, bytes or binary files (JPEG, PNG, WebP, anything PIL reads).
        device, cpu_threads, batch_size, output_device: see :class:`ImageBatchDecoder`.
        options: :func:`~flashcodec.image.decode_image`'s sizing options (``min_pixels``,
            ``max_pixels``, ``height``, ``width``, ``max_image_pixels``, ``resize``).

    Returns:
        one :class:`DecodedImage` per source, in input order, each sized as ``decode_image`` does.

    Raises:
        ImageDecodeError, DeviceError, ValueError: see :meth:`ImageBatchDecoder.decode`.
    """
    with ImageBatchDecoder(device, cpu_threads=cpu_threads, batch_size=batch_size,
                           output_device=output_device) as decoder:
        return decoder.decode(sources, **options)
