"""Bad `unifiedserve serve` flags: one error line naming the flag, before anything is built or spawned."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from unifiedserve.cli import main


@pytest.mark.parametrize("args, needle", [
    (["--port", "-5"], "argument --port: must be at least 1"),
    (["--port", "70000"], "port number in 1..65535"),
    (["--prefill-token-budget", "0"], "argument --prefill-token-budget: must be at least 1"),
    (["--encode-token-budget", "-3"], "argument --encode-token-budget"),
    (["--kv-cache-gb", "nan"], "argument --kv-cache-gb: must be a positive finite number"),
    (["--max-frames", "abc"], "argument --max-frames: 'abc' is not an integer"),
    (["--max-frames", "-3"], "argument --max-frames: must be at least 2, got -3"),
    (["--max-frames", "1"], "argument --max-frames: must be at least 2, got 1"),
    (["--served-model-name", ""], "argument --served-model-name: must be a non-empty name"),
    (["--served-model-name", " m "], "argument --served-model-name: must be a non-empty name"),
    (["--block-size", "0"], "argument --block-size"),
    (["--max-request-mb", "0"], "argument --max-request-mb"),
    (["--max-inflight-request-mb", "-1"], "argument --max-inflight-request-mb"),
    (["--policy", "bogus"], "argument --policy: invalid choice"),
    (["--device", "gpu"], "argument --device: invalid choice"),
    (["--media-cache-gb", "-1"], "argument --media-cache-gb: must be a finite number >= 0"),
    (["--media-cache-gb", "inf"], "argument --media-cache-gb: must be a finite number >= 0"),
    (["--ingest", "foo"], "argument --ingest: invalid choice"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice"),
    (["--max-decode-batch", "0"], "argument --max-decode-batch: must be at least 1"),
    (["--page-size", "-1"], "argument --page-size: must be at least 1"),
    (["--num-kv-blocks", "0"], "argument --num-kv-blocks: must be at least 1"),
    (["--patch-buffer-gb", "0"], "argument --patch-buffer-gb: must be a positive finite number"),
    (["--gpus", "0,x"], "argument --gpus: must be GPU ordinals"),
    (["--decode-sm-percent", "100"], "argument --decode-sm-percent: must be a percentage in 0..99"),
    (["--mps", "maybe"], "argument --mps: invalid choice"),
    (["--vision-device", "nvdec"], "argument --vision-device: invalid choice"),
    (["--vision-ahead-gb", "0"], "argument --vision-ahead-gb: must be a positive finite number"),
    (["--max-image-source-mp", "0"], "argument --max-image-source-mp: must be a positive finite number"),
])
def test_bad_values_are_one_line_before_anything_starts(args, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and "Traceback" not in err
    assert err.strip().splitlines() == [f"unifiedserve serve: error: {err.split('error: ', 1)[1].strip()}"]
    assert err.strip().endswith("(see unifiedserve serve --help)")


@pytest.mark.parametrize("args, needle", [
    (["--allowed-local-media-path", "/nonexistent/media"], "--allowed-local-media-path"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization applies to a CUDA server"),
    (["--gpus", "0"], "--gpus applies to CUDA only"),
    (["--model", "/nonexistent/folder"], "no config.json there"),
    (["--vision-threads", "-1"], "--vision-threads must be >= 0"),
    (["--max-pixels", "35651585"], "--max-pixels must be at most 35651584 (8192x4352)"),  # flashcodec's largest
    (["--vision-device", "cuda"], "--vision-device: vision_device cuda (NVDEC) needs the server on CUDA"),
    (["--decode-threads", "-2"], "--decode-threads and --vision-threads must be >= 0"),
    (["--policy", "split", "--decode-threads", "2"], "--decode-threads applies to --policy unified only"),
    (["--policy", "monolithic", "--decode-threads", "1"], "--decode-threads applies to --policy unified only"),
    (["--num-kv-blocks", "4", "--max-model-len", "4096"], "--max-model-len 4096 needs more KV cache"),
    (["--max-model-len", "200000"], "--max-model-len 200000 is longer than the model's context"),
    (["--vision-threads", "5000"], "--vision-threads must be at most 1024"),
    (["--worker-timeout", "nan"], "--worker-timeout must be 0 (never) or a number of seconds, got nan"),
    (["--api-key", " "], "--api-key (or UNIFIEDSERVE_API_KEY) is empty"),
    (["--visual-buffer-gb", "1e-9"], "the visual-token buffer budget holds no page at all; raise --visual-buffer-gb"),
    (["--generation-config", "/nonexistent/dir"],
     "--generation-config /nonexistent/dir: no generation_config.json there"),
    (["--max-request-mb", "8", "--max-inflight-request-mb", "4"],
     "--max-inflight-request-mb must be at least --max-request-mb (one whole body)"),
])
def test_contradictions_exit_1_fast_without_spawning(args, needle):
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and needle in run.stderr and "Traceback" not in run.stderr
    assert "starting workers" not in run.stderr + run.stdout
    assert time.perf_counter() - started < 5.0


def test_a_bad_generation_config_is_one_line(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu",
                          "--generation-config", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"{tmp_path}/generation_config.json: temperature must be a number >= 0, got -1" in run.stderr


def test_a_config_refusal_names_its_flag():
    from argparse import Namespace

    from unifiedserve.server.serve_setup import _name_flag

    args = Namespace(block_size=0, policy="unified")
    assert _name_flag("block_size must be a positive integer, got 0", args) == \
        "--block-size: block_size must be a positive integer, got 0"
    assert _name_flag("--max-model-len 9 needs more KV cache", args) == "--max-model-len 9 needs more KV cache"
    assert _name_flag("engine.num_kv_blocks must be given", args) == "engine.num_kv_blocks must be given"


def test_a_taken_port_or_unknown_host_is_one_line_before_any_worker_starts(tmp_path):
    """... and leaves nothing behind: the runtime's sockets folder was made before the bind and stayed."""
    import os
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        for args, needle in [(["--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there: "
                                                     f"Address already in use"),
                             (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: ")]:
            started = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu",
                                  "--host", "127.0.0.1", *args], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "TMPDIR": str(tmp_path)})
            assert run.returncode == 1 and needle in run.stderr and "Traceback" not in run.stderr, run.stderr
            assert "starting workers" not in run.stderr + run.stdout
            assert list(tmp_path.iterdir()) == []
            assert time.perf_counter() - started < 5.0
    finally:
        taken.close()


def test_bind_socket_leaves_the_port_to_listen_on_later():
    import socket

    from unifiedserve.server.serve import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        probe = socket.socket()
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # bound, not listening: refused until ready
        probe.close()
        sock.listen()  # what the server's loop does once the workers are ready
        probe = socket.socket()
        assert probe.connect_ex(("127.0.0.1", port)) == 0
        probe.close()
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen there"):  # a second server now
            bind_socket("127.0.0.1", port)
    finally:
        sock.close()


@pytest.mark.parametrize("hard,target,expected", [(2048, 4096, 2048), (8192, 4096, 4096)])
def test_the_open_file_limit_is_raised_within_the_hard_limit(hard, target, expected):
    """In a child process (the limits are per process): a soft limit of 256 goes up to the target, never
    past the hard limit."""
    import resource

    current = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if current != resource.RLIM_INFINITY and current < hard:
        pytest.skip(f"this machine's hard limit on open files is {current}")
    code = ("import resource; from unifiedserve.server.serve import raise_open_file_limit; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); "
            f"print(raise_open_file_limit({target}), *resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(expected), str(expected), str(hard)]


def test_async_scheduling_is_on_for_cuda_unless_turned_off():
    """vLLM's default since 0.14: on with CUDA; off on the CPU, where it only adds a row per request."""
    from unifiedserve.cli import build_parser
    from unifiedserve.server.serve_flags import async_scheduling_default

    parse = build_parser().parse_args
    assert parse(["serve"]).async_scheduling is None
    assert parse(["serve", "--async-scheduling"]).async_scheduling is True
    assert parse(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert async_scheduling_default(None, "cuda") and not async_scheduling_default(None, "cpu")
    assert async_scheduling_default(True, "cpu") and not async_scheduling_default(False, "cuda")


def test_a_patch_buffer_too_small_for_the_largest_image_is_said_at_start(caplog):
    """With the default --max-pixels (12.8 M: 65,536 rows of 14x14 patches) a 0.25-GiB patch buffer (53,248 rows)
    refused every image sent without pixel options; the server now says so when it starts."""
    from types import SimpleNamespace

    from unifiedserve.server.limits import RequestLimits
    from unifiedserve.server.serve_setup import warn_if_images_cannot_fit

    def config(pages):
        return SimpleNamespace(engine=SimpleNamespace(num_patch_pages=pages, page_size=1024))

    processor = SimpleNamespace(image_max_pixels=16384 * 28 * 28)
    model = SimpleNamespace(vision=SimpleNamespace(patch_size=14))
    with caplog.at_level("WARNING", logger="unifiedserve"):
        assert warn_if_images_cannot_fit(config(52), processor, model, RequestLimits())
        assert "the patch buffer holds 53248 patch rows; an image at the default largest size (12845056 pixels" \
            in caplog.text and "makes 65536" in caplog.text
        assert not warn_if_images_cannot_fit(config(64), processor, model, RequestLimits())  # 65,536 rows: fits
        assert not warn_if_images_cannot_fit(config(52), processor, model, RequestLimits(max_pixels=1024 * 196))


def test_the_image_source_cap_reaches_the_vision_process(tmp_path):
    """--max-image-source-mp (default 50: a 48-MP photo fits) is the vision process's header check, in pixels."""
    import argparse

    from unifiedserve.model.demo import write_demo_model
    from unifiedserve.server import serve_setup
    from unifiedserve.server.serve_flags import add_arguments

    model = write_demo_model(tmp_path / "demo")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, pixels in (([], 50_000_000), (["--max-image-source-mp", "108"], 108_000_000)):
        runtime = serve_setup.build_runtime(parser.parse_args(["--model", str(model), "--device", "cpu", *argv]))
        try:
            assert runtime.config.max_image_source_pixels == pixels
        finally:
            runtime.stop()  # nothing started: removes its socket folder


def test_a_model_path_with_a_quoted_tilde_is_expanded(tmp_path, monkeypatch):
    """--model '~/...' (or --model=~/..., which bash leaves as it is), as --help prints the default."""
    from unifiedserve.server.serve_setup import resolve_model

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/ckpt") == str(tmp_path / "ckpt")


@pytest.mark.parametrize("damage", ["a tensor missing", "a shard truncated", "an integer tensor", "a bad tokenizer"])
def test_a_damaged_checkpoint_is_one_error_line_before_any_worker_starts(tmp_path, damage):
    """Each worker used to find it while loading: a traceback from each, then 'the core worker process exited
    unexpectedly', which never said what was wrong."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from unifiedserve.model.demo import DEFAULT_DEMO_PATH, write_demo_model

    demo = Path(DEFAULT_DEMO_PATH).expanduser()
    if not (demo / "config.json").exists():
        write_demo_model(demo)
    model = tmp_path / "model"
    shutil.copytree(demo, model)
    weights = model / "model.safetensors"
    if damage == "a tensor missing":
        tensors = load_file(weights)
        del tensors[sorted(tensors)[-1]]
        save_file(tensors, weights)
        needle = "1 missing tensors"
    elif damage == "a shard truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
        needle = "model.safetensors: not a readable safetensors file"
    elif damage == "an integer tensor":
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].to(torch.int64)
        save_file(tensors, weights)
        needle = "tensors that are not floating point"
    else:
        (model / "tokenizer.json").write_text("{}")
        needle = "tokenizer.json is not a tokenizers-format tokenizer"
    run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu", "--model", str(model)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and needle in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "starting workers" not in run.stderr + run.stdout
    assert run.stderr.count("\n") == 1, run.stderr
