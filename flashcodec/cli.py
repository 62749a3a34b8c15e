"""``flashcodec`` command line: probe a video, decode the frames a model needs, benchmark decoders."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path

from flashcodec._errors import ArgumentParser
from flashcodec.devices import NVDEC_HOST_CORES

#: Show a progress bar when a decode has at least this many frames to decode.
PROGRESS_MIN_FRAMES = 1000


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
        if h <= 0 or w <= 0:
            raise ValueError
        return h, w
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH, e.g. 224x392, got {text!r}") from None


def _positive(kind: type):
    """An argparse type accepting only positive ``kind`` values (int or float)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = kind(0)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {'integer' if kind is int else 'number'}, "
                                             f"got {text!r}")
        return value
    return parse


_positive_int, _positive_float = _positive(int), _positive(float)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frame sampling (defaults: Qwen2.5-VL rules, as qwen-vl-utils)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--fps", type=_positive_float, help="frames sampled per second of video (default 2)")
    x.add_argument("--num-frames", type=_positive_int,
                   help="sample exactly this many frames (rounded to even; default: by --fps)")
    g.add_argument("--min-frames", type=_positive_int, help="lower bound on sampled frames (default 4)")
    g.add_argument("--max-frames", type=_positive_int, help="upper bound on sampled frames (default 768)")
    s = p.add_argument_group("output size (multiples of 28; defaults: Qwen2.5-VL video budgets)")
    s.add_argument("--size", type=_size, metavar="HxW", help="explicit output size, rounded to multiples of 28")
    s.add_argument("--min-pixels", type=_positive_int, help="minimum pixels per frame (default 128*28*28)")
    s.add_argument("--max-pixels", type=_positive_int, help="maximum pixels per frame (default 768*28*28)")
    s.add_argument("--total-pixels", type=_positive_int,
                   help="pixel budget of the whole video (default: 90%% of a 128k-token context)")


def _sampling_kwargs(args) -> dict:
    kw = {k: getattr(args, k) for k in ("fps", "num_frames", "min_frames", "max_frames", "min_pixels",
                                        "max_pixels", "total_pixels") if getattr(args, k) is not None}
    if args.size:
        kw["height"], kw["width"] = args.size
    return kw


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="flashcodec",
        description="Decode the frames a vision-language model needs from a video, GOP-parallel on all cores.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("probe", help="show a video's metadata and GOP table (demux only, no decode)",
                       description="Scan a video's packets (no full decode) and print its metadata.")
    p.add_argument("file", help="video file")
    p.add_argument("--json", action="store_true", help="print JSON (includes per-frame pts and keyframes)")

    d = sub.add_parser("decode", help="decode the frames a model samples from a video (or an image)",
                       description="Decode the sampled frames of a video at the model's input size. Prints "
                                   "the frame count, size and time; --out saves them. A .jpg/.png/.webp file is "
                                   "decoded as one image at the Qwen2.5-VL image size.")
    d.add_argument("file", help="video file, or a JPEG/PNG/WebP image")
    _add_sampling_args(d)
    d.add_argument("--backend", default="auto", help="decoder backend: auto, pyav or torchcodec (default auto)")
    d.add_argument("--threads", type=_positive_int, default=None,
                   help=f"CPU decoder threads (default: one per core, {os.cpu_count()} here, less "
                        f"{NVDEC_HOST_CORES} per GPU decoding: the host cores its NVDEC threads keep busy)")
    d.add_argument("--device", default="cpu",
                   help="cpu (default); cuda (every GPU's NVDEC), cuda:N, or a list such as cuda:0,cpu (GPUs and "
                        "CPU together); auto: every GPU whose NVDEC works, and the CPU. What NVDEC cannot "
                        "decode (e.g. AV1 on H100) goes to the CPU with a one-line note")
    d.add_argument("--output", choices=("rgb", "patches"), default="rgb",
                   help="rgb (default): uint8 frames [T,3,H,W]; patches: normalised Qwen2.5-VL patches [N,1176]")
    d.add_argument("--out", type=Path, help="save to FILE.npy, FILE.pt, or a folder of PNGs (rgb only)")
    d.add_argument("--resize", default="exact", metavar="{exact,fast}",
                   help="exact (default): full-resolution RGB, then antialiased bicubic, as Qwen2.5-VL's "
                        "reference preprocessing; fast: convert and resize in one step (cheaper, less faithful)")
    d.add_argument("--on-corrupt", choices=("error", "repeat"), default="error",
                   help="if sampled frames cannot be decoded: fail (default), or repeat the nearest good frame")
    d.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    b = sub.add_parser("bench", help="time flashcodec against other decoders on a video",
                       description="Decode the same frames with flashcodec and with each installed peer "
                                   "(PyAV, torchcodec, decord, DeepCodec, OpenCV); check frames, print times and "
                                   "ratios. The full benchmark with generated clips is bench/decode/bench_decode.py.")
    b.add_argument("file", help="video file")
    b.add_argument("--sampling", choices=("dense", "sparse"), default="dense",
                   help="dense (default): Qwen rules (2 fps, <= 768 frames); sparse: 32 frames spread uniformly")
    b.add_argument("--peers", default="all", help="comma-separated peers, or 'all' installed (default)")
    b.add_argument("--repeat", type=_positive_int, default=1, help="timed runs per decoder, the best kept (default 1)")
    b.add_argument("--threads", type=_positive_int, default=None,
                   help="flashcodec decoder threads (default: one per core)")
    b.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    return parser


def _orientation_note(info) -> str:
    """How the display matrix shows the stored picture, for `flashcodec probe`; empty when as stored."""
    if not info.rotation and not info.mirror:
        return ""
    turn = f"rotation {info.rotation}° counter-clockwise" if info.rotation else ""
    how = " then ".join(filter(None, (turn, "mirrored left-right" if info.mirror else "")))
    return f" ({how}, displayed {info.display_width}x{info.display_height})"


def _print_probe(info, as_json: bool) -> None:
    if as_json:
        print(json.dumps(info.to_dict()))
        return
    gops = info.gops
    sizes = [g.num_frames for g in gops]
    rows = [
        ("codec", f"{info.codec} ({info.pix_fmt})"),
        ("container", info.container_format),
        ("size", f"{info.width}x{info.height}" + _orientation_note(info)),
        ("frames", f"{info.num_frames}" + ("" if info.header_num_frames == info.num_frames else
                                           f" (header says {info.header_num_frames})")),
        ("frame rate", f"{info.average_fps:.3f} fps" + (" (variable)" if info.is_vfr else "")),
        ("duration", f"{info.duration_s:.3f} s"),
        ("time base", str(info.time_base)),
        ("keyframes", f"{info.num_keyframes}"),
        ("GOP length", f"min {min(sizes)}, mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)} frames"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def _save(out: Path, frames, patches, grid_thw, frame_indices, sample_fps) -> str:
    """Write frames ``[T,3,H,W]`` (or patches) to ``.npy``, ``.pt`` or a folder of PNGs."""
    import numpy as np
    import torch

    if out.suffix in (".npy", ".pt"):
        # into a file opened here, so a failed write names it: np.save's said only "No space left on device", and
        # torch.save's writer raised a RuntimeError ("unexpected pos 832 vs 726") that became a traceback
        try:
            with open(out, "wb") as f:
                if out.suffix == ".npy":
                    np.save(f, (frames if frames is not None else patches).numpy())
                else:
                    torch.save({"frames": frames, "patches": patches, "grid_thw": grid_thw,
                                "frame_indices": frame_indices, "sample_fps": sample_fps}, f)
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(out)) from None
        except RuntimeError as e:
            from flashcodec._errors import first_line

            raise OSError(errno.EIO, f"could not write the file ({first_line(e)})", str(out)) from None
    else:  # a folder of PNGs (suffixes were checked by _check_out)
        from PIL import Image

        out.mkdir(parents=True, exist_ok=True)
        for i, frame in enumerate(frames):
            Image.fromarray(frame.permute(1, 2, 0).numpy()).save(out / f"frame_{i:05d}.png")
    return str(out)


def _check_out(args) -> None:
    """Reject a bad --out before any decoding work."""
    if args.out is None:
        return
    if args.out.suffix not in ("", ".npy", ".pt"):
        raise ValueError(f"--out must end in .npy or .pt, or name a folder (got {args.out})")
    if args.out.suffix == "" and args.output == "patches":
        raise ValueError("a folder of PNGs needs --output rgb")
    _check_destination(args.out, "--out", folder_ok=not args.out.suffix)


def _check_destination(out: Path, flag: str, folder_ok: bool = False) -> None:
    """Refuse, before the work, a destination ``flag`` names that cannot be written: a file whose folder is missing
    or read-only, or that is a folder; with ``folder_ok``, a folder (made with its parents) under a file or
    read-only."""
    if not folder_ok:  # a file: its folder must exist and take it
        if out.is_dir():
            raise ValueError(f"{flag} {out} is a folder; name a file")
        folder = out.parent
        if not folder.is_dir():
            raise ValueError(f"{flag} {out}: folder {folder} does not exist")
    else:  # a folder of PNGs, made with its parents: the nearest one that exists must be a folder
        if out.exists() and not out.is_dir():
            raise ValueError(f"{flag} {out} is a file, not a folder for PNGs")
        folder = out
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(f"{flag} {out}: {folder} is not a folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {out}: {folder} is not writable")


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def _decode_image(args) -> int:
    import warnings

    from PIL import Image

    from flashcodec.image import decode_image

    # decode_image refuses images over its own max_image_pixels; PIL's warning above half its limit only printed two
    # lines, a source path among them, before the result (the CLI's process: a library caller keeps PIL's filters)
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    started = time.perf_counter()
    kw = {k: getattr(args, k) for k in ("min_pixels", "max_pixels") if getattr(args, k) is not None}
    if args.size:
        kw["height"], kw["width"] = args.size
    image = decode_image(args.file, resize=args.resize, **kw)
    frames = image.pixels.unsqueeze(0)  # [1, 3, H, W]
    patches, grid = image.to_patches() if args.output == "patches" else (None, None)
    elapsed = time.perf_counter() - started

    saved = None
    if args.out is not None:
        saved = _save(args.out, None if patches is not None else frames, patches, grid, [0], None)
    h, w = image.size
    summary = {"file": args.file, "height": h, "width": w, "original_size": list(image.original_size),
               "grid_thw": list(grid) if grid else None, "decode_s": round(elapsed, 4), "out": saved}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"image at {h}x{w} (from {image.original_size[0]}x{image.original_size[1]}) in {elapsed:.3f} s"
              + (f", patches float32[{patches.shape[0]}, {patches.shape[1]}]" if patches is not None else ""))
        if saved:
            print(f"saved to {saved}")
    return 0


def _decode(args) -> int:
    import flashcodec

    _check_out(args)
    from flashcodec.resize import check_resize_mode
    from flashcodec.decode.request import check_output_memory

    check_resize_mode(args.resize)  # before any decoding work
    if Path(args.file).suffix.lower() in IMAGE_SUFFIXES:
        return _decode_image(args)
    started = time.perf_counter()
    with flashcodec.DecodeEngine(args.backend, devices=args.device, cpu_threads=args.threads) as engine:
        analysis = engine.analyse_bitstream(args.file, **_sampling_kwargs(args))
        plan = analysis.plan
        check_output_memory(plan, args.output)  # add_decoding_request checks too; here before a bar is drawn
        bar = None
        if not args.no_progress and plan.decode_cost >= PROGRESS_MIN_FRAMES:
            from tqdm import tqdm

            bar = tqdm(total=plan.decode_cost, unit="frame", desc="decoding", leave=False, file=sys.stderr)
        last = [0]

        def progress(done: int, total: int) -> None:
            bar.update(done - last[0])
            last[0] = done

        engine.add_decoding_request(analysis.key_id, output=args.output, on_corrupt=args.on_corrupt,
                                    progress=progress if bar else None, resize=args.resize)
        try:
            result = engine.get_decoding_output(analysis.key_id)
        finally:
            if bar:
                bar.close()
    total_s = time.perf_counter() - started
    saved = None
    if args.out is not None:
        frames, patches = (t.cpu() if t is not None else None for t in (result.frames, result.patches))
        saved = _save(args.out, frames, patches, result.grid_thw, result.frame_indices, result.sample_fps)
    summary = {
        "file": args.file, "backend": engine.backend.name, "threads": engine.num_threads, "resize": args.resize,
        "devices": list(engine.layout.names),
        "num_frames": len(result.frame_indices), "num_output_frames": plan.num_output_frames,
        "height": plan.height, "width": plan.width, "sample_fps": result.sample_fps,
        "grid_thw": list(result.grid_thw), "frames_decoded": plan.decode_cost,
        "video_frames": analysis.info.num_frames, "failed_frame_indices": result.failed_frame_indices,
        "probe_s": round(result.probe_s, 4), "decode_s": round(result.decode_s, 4), "total_s": round(total_s, 4),
        "out": saved,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        what = (f"patches float32[{result.patches.shape[0]}, {result.patches.shape[1]}]"
                if result.patches is not None else f"frames uint8{list(result.frames.shape)}")
        print(f"{summary['num_frames']} frames at {plan.height}x{plan.width} ({what}, grid_thw "
              f"{tuple(result.grid_thw)}), sampled at {result.sample_fps:.2f} fps from "
              f"{analysis.info.num_frames} frames")
        print(f"decoded {plan.decode_cost} frames in {result.decode_s:.3f} s (probe {result.probe_s:.3f} s, "
              f"total {total_s:.3f} s) with {engine.backend.name} on {engine.num_threads} threads"
              + (f" and NVDEC on {', '.join(engine.layout.names[:len(engine.layout.gpus)])}"
                 if engine.layout.gpus else ""))
        if result.failed_frame_indices:
            print(f"warning: {len(result.failed_frame_indices)} frames could not be decoded and repeat a "
                  f"neighbour: {result.failed_frame_indices[:16]}")
        if saved:
            print(f"saved to {saved}")
    return 0


def _bench(args) -> int:
    from flashcodec.benchmark import run_file_benchmark

    if args.json is not None:
        _check_destination(args.json, "--json")
    run_file_benchmark(args.file, sampling=args.sampling, peers=args.peers, repeat=args.repeat,
                       num_threads=args.threads, json_path=args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from flashcodec._errors import FlashCodecError, error_line

    try:
        if args.command == "probe":
            from flashcodec._probe import probe
            from flashcodec.plan.sampling import MAX_FRAME_PIXELS

            # the cap decode applies: a larger picture is refused from the header, before the probe decodes the
            # first keyframe (one 16000x16000 picture in an 840-KB file took 300 MB and 2.4 s)
            _print_probe(probe(args.file, max_source_pixels=MAX_FRAME_PIXELS), args.json)
            return 0
        if args.command == "decode":
            return _decode(args)
        return _bench(args)
    except (FlashCodecError, ValueError, OSError) as e:
        print(f"flashcodec: error: {error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flashcodec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
