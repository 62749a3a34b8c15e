"""``unifiedserve`` command line. Subcommands: ``serve`` (the OpenAI-compatible server) and ``demo-model``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from flashcodec._errors import ArgumentParser


def _seed(text: str) -> int:
    """A seed torch's generator takes (a larger one failed with 'Overflow when unpacking long long')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"must be in 0..2^63-1, got {value}")
    return value


def _add_demo_model(sub) -> None:
    from unifiedserve.model.presets import DEFAULT_DEMO_PATH, PRESETS

    p = sub.add_parser(
        "demo-model", help="write a random-weight Qwen2.5-VL checkpoint (the tiny demo, or a real size)",
        description="Write a deterministic, random-weight Qwen2.5-VL checkpoint in Hugging Face format "
                    "(config, safetensors, BPE tokenizer, chat template, preprocessor config). transformers "
                    "and unifiedserve both load it. --preset tiny (default) is small enough for CPU demos and "
                    "tests; qwen2.5-vl-3b / qwen2.5-vl-7b have the public checkpoints' architecture, so GPU "
                    "benchmarks run offline at real size. The weights are random: the model's text is gibberish.")
    p.add_argument("path", nargs="?", default=str(DEFAULT_DEMO_PATH),
                   help=f"output directory (default {DEFAULT_DEMO_PATH}): new, empty, or one demo-model wrote before "
                        "(its checkpoint is replaced); a folder holding other files is refused")
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="architecture (default tiny)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the stored weights (default float32; bfloat16 halves a 7B's 33 GB)")
    p.add_argument("--num-text-layers", type=int, default=None, metavar="N",
                   help="fewer language-model layers than the preset (public presets only; default: all of them)")
    p.add_argument("--num-vision-layers", type=int, default=None, metavar="N",
                   help="fewer vision blocks, full-attention ones kept at their relative places (public presets only; "
                        "default: all of them)")
    p.add_argument("--shards", type=int, default=None, metavar="N",
                   help="split the weights into N safetensors shards with an index (default: 1 for tiny, one per "
                        "4 GiB otherwise)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random weights, 0..2^63-1 (default 0)")
    p.add_argument("--tie-word-embeddings", action="store_true", default=None,
                   help="share the token embedding with the output projection (no lm_head.weight; default: the "
                        "preset's own choice)")
    p.add_argument("--no-progress", action="store_true",
                   help="never show the progress bar (shown on stderr for checkpoints of 1 GiB or more)")
    p.add_argument("--measure", action="store_true",
                   help="then time one frame-pair encode (392x728) against one decode step, fp32 on the CPU")


#: demo-model shows a progress bar for weights of at least this many bytes (every public preset, not tiny)
PROGRESS_MIN_BYTES = 2**30


def _demo_model(args) -> int:
    import torch

    from unifiedserve.model.demo import measure_encode_decode_ratio, write_demo_model

    start = time.perf_counter()
    bar = []  # made on the first call that says the weights are worth one (a 7B takes minutes on a CPU)

    def progress(done: int, total: int) -> None:
        if not bar:
            if args.no_progress or total < PROGRESS_MIN_BYTES:
                return
            from tqdm import tqdm

            bar.append(tqdm(total=total, unit="B", unit_scale=True, desc="weights", leave=False, file=sys.stderr))
        bar[0].update(done - bar[0].n)

    try:
        path = write_demo_model(args.path, seed=args.seed, num_shards=args.shards, preset=args.preset,
                                tie_word_embeddings=args.tie_word_embeddings, dtype=getattr(torch, args.dtype),
                                num_text_layers=args.num_text_layers, num_vision_layers=args.num_vision_layers,
                                progress=progress)
    finally:
        if bar:
            bar[0].close()
    print(f"wrote {path} ({args.preset}, {args.dtype}) in {time.perf_counter() - start:.2f} s")
    if args.measure:
        print(json.dumps(measure_encode_decode_ratio(path), indent=2))
    return 0


def _add_serve(sub) -> None:
    from unifiedserve.server.serve_flags import add_arguments

    p = sub.add_parser(
        "serve", help="start the OpenAI-compatible server (long-video QA)",
        description="Start an OpenAI-compatible chat-completions server for a Qwen2.5-VL-family model. Four "
                    "processes: api (HTTP), vision (FlashCodec video decoding), core (vision encode + chunked "
                    "prefill under token budgets) and decode, sharing the patch buffer and the KV cache.")
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="unifiedserve",
                                     description="Serve vision-language models on long videos.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_demo_model(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo-model":
            return _demo_model(args)
        if args.command == "serve":
            from unifiedserve.server.serve import run

            return run(args)
        raise AssertionError(f"unhandled command {args.command!r}")
    except (ValueError, OSError) as e:
        from flashcodec._errors import error_line

        print(f"unifiedserve: error: {error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("unifiedserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
