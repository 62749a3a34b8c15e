"""``unifiedserve`` command line. Subcommands: ``serve`` (the OpenAI-compatible server) and ``demo-model``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_demo_model(sub) -> None:
    from unifiedserve.model.demo import DEFAULT_DEMO_PATH

    p = sub.add_parser(
        "demo-model", help="write a tiny random-weight Qwen2.5-VL checkpoint (for tests and demos)",
        description="Write a tiny, deterministic, random-weight Qwen2.5-VL checkpoint in Hugging Face format "
                    "(config, safetensors, BPE tokenizer, chat template, preprocessor config). transformers "
                    "and unifiedserve both load it. The weights are random: the model's text is gibberish.")
    p.add_argument("path", nargs="?", default=str(DEFAULT_DEMO_PATH),
                   help=f"output directory (default {DEFAULT_DEMO_PATH}); existing weights there are replaced")
    p.add_argument("--shards", type=int, default=1, metavar="N",
                   help="split the weights into N safetensors shards with an index (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--tie-word-embeddings", action="store_true",
                   help="share the token embedding with the output projection (no lm_head.weight)")
    p.add_argument("--measure", action="store_true",
                   help="then time one frame-pair encode (392x728) against one decode step, fp32 on the CPU")


def _demo_model(args) -> int:
    from unifiedserve.model.demo import measure_encode_decode_ratio, write_demo_model

    start = time.perf_counter()
    path = write_demo_model(args.path, seed=args.seed, num_shards=args.shards,
                            tie_word_embeddings=args.tie_word_embeddings)
    print(f"wrote {path} in {time.perf_counter() - start:.2f} s")
    if args.measure:
        print(json.dumps(measure_encode_decode_ratio(path), indent=2))
    return 0


def _add_serve(sub) -> None:
    from unifiedserve.server.serve import add_arguments

    p = sub.add_parser(
        "serve", help="start the OpenAI-compatible server (long-video QA)",
        description="Start an OpenAI-compatible chat-completions server for a Qwen2.5-VL-family model. Four "
                    "processes: api (HTTP), vision (FlashCodec video decoding), core (vision encode + chunked "
                    "prefill under token budgets) and decode, sharing the patch buffer and the KV cache.")
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unifiedserve",
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
        print(f"unifiedserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("unifiedserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
