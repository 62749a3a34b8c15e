"""The flashcodec CLI: output formats, and one-line errors (no traceback, non-zero exit) on bad input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import synthetic_video
import torch

from flashcodec.cli import main

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


def run_cli(*args):
    """Run the real entry point in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "flashcodec.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_probe_table_and_json(tiny_h264, capsys):
    assert main(["probe", str(tiny_h264)]) == 0
    out = capsys.readouterr().out
    assert "h264" in out and "48" in out and "GOP length" in out
    assert main(["probe", "--json", str(tiny_h264)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_frames"] == 48 and data["keyframe_indices"] == [0, 12, 24, 36]


def test_probe_refuses_pictures_over_the_decode_cap_from_the_header(tiny_h264, capsys, monkeypatch):
    """As decode does: before the probe decodes the first keyframe (one 16000x16000 picture took 300 MB)."""
    from flashcodec import _probe
    from flashcodec.plan import sampling

    monkeypatch.setattr(sampling, "MAX_FRAME_PIXELS", 128 * 96 - 1)
    monkeypatch.setattr(_probe, "_first_frame_orientation", lambda *a: pytest.fail("the first keyframe was decoded"))
    assert main(["probe", str(tiny_h264)]) == 1
    assert "128x96 (12288 pixels); at most 12287 are decoded" in capsys.readouterr().err


def test_decode_to_npy_pt_and_png_folder(tiny_h264, tmp_path, capsys):
    npy, pt, pngs = tmp_path / "f.npy", tmp_path / "f.pt", tmp_path / "frames"
    assert main(["decode", str(tiny_h264), "--num-frames", "6", "--out", str(npy)]) == 0
    out = capsys.readouterr().out
    assert "6 frames at" in out and "decoded" in out
    frames = np.load(npy)
    assert frames.shape[0] == 6 and frames.dtype == np.uint8
    assert main(["decode", str(tiny_h264), "--num-frames", "6", "--output", "patches", "--out", str(pt)]) == 0
    saved = torch.load(pt)
    assert saved["patches"].shape[1] == 1176 and saved["frames"] is None
    assert main(["decode", str(tiny_h264), "--num-frames", "6", "--out", str(pngs), "--size", "112x140"]) == 0
    files = sorted(pngs.glob("*.png"))
    assert len(files) == 6
    from PIL import Image

    assert Image.open(files[0]).size == (140, 112)


def test_decode_json_summary(tiny_h264, capsys):
    assert main(["decode", str(tiny_h264), "--fps", "4", "--threads", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_frames"] == 8 and summary["threads"] == 2 and summary["failed_frame_indices"] == []
    assert summary["height"] % 28 == 0 and summary["width"] % 28 == 0


@pytest.mark.parametrize("make_bad,needle", [
    (lambda tmp, good: tmp / "missing.mp4", "does not exist"),
    (lambda tmp, good: (tmp / "text.mp4", (tmp / "text.mp4").write_text("hello " * 100))[0], "not a readable video"),
    (lambda tmp, good: synthetic_video.truncate_file(good, tmp / "cut.mp4", keep_fraction=0.3), "error"),
    # a URL is not "does not exist"
    (lambda tmp, good: "https://example.com/clip.mp4", "is a URL: flashcodec reads local files"),
])
def test_user_mistakes_get_one_line_errors(tiny_h264, tmp_path, make_bad, needle):
    bad = make_bad(tmp_path, tiny_h264)
    result = run_cli("decode", bad)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashcodec: error:") and needle in lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--min-pixels", "1000000000"], "min_pixels must be at most 35651584"),
    (["--max-pixels", "1000000000000"], "max_pixels must be at most 35651584"),
    (["--size", "100000x100000"], "height x width must be at most 35651584 pixels"),
    (["--min-frames", "100", "--max-frames", "10"], "min_frames (100) is above max_frames (10)"),
    (["--threads", "100000"], "cpu_threads must be at most 1024"),
])
def test_sizes_and_counts_are_capped_before_any_memory(tiny_h264, args, needle):
    result = run_cli("decode", tiny_h264, *args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("flashcodec: error:"), result.stderr
    assert needle in lines[0]


def test_an_output_larger_than_memory_is_refused_before_decoding(tiny_h264, monkeypatch, capsys):
    from types import SimpleNamespace

    import flashcodec._sysmem
    from flashcodec.decode.request import check_output_memory

    plan = SimpleNamespace(num_output_frames=768, height=4480, width=7980)  # 82 GB of RGB frames
    monkeypatch.setattr(flashcodec._sysmem, "available_memory", lambda: (2**34, "available memory"))  # 16 GiB free
    with pytest.raises(flashcodec.OutputTooLargeError, match=r"the output would take 76\.7 GiB \(768 frames of "
                                                             r"4480x7980, rgb\), more than this machine's 16\.0 GiB of "
                                                             r"available memory; lower max_pixels"):
        check_output_memory(plan, "rgb")
    check_output_memory(SimpleNamespace(num_output_frames=8, height=280, width=392), "patches")
    # a container's limit (flashcodec/_sysmem.py): 1.5 GiB left under it
    monkeypatch.setattr(flashcodec._sysmem, "available_memory",
                        lambda: (3 * 2**29, "memory left under its memory limit (cgroup)"))
    hd = SimpleNamespace(num_output_frames=64, height=1080, width=1920)
    check_output_memory(hd, "rgb")  # 0.4 GB
    # patches: the float32 patches (1.5 GiB) and the frames they are cut from, alive together
    with pytest.raises(ValueError, match=r"take 1\.9 GiB .* more than this machine's 1\.5 GiB of memory left under its "
                                         r"memory limit \(cgroup\)"):
        check_output_memory(hd, "patches")
    # the CLI says it in one line before any decoding, and the library refuses it too (it allocated, unchecked, 193 GB
    # in a decoder thread)
    monkeypatch.setattr(flashcodec._sysmem, "available_memory", lambda: (1000, "available memory"))
    assert main(["decode", str(tiny_h264), "--num-frames", "8"]) == 1
    assert capsys.readouterr().err.startswith("flashcodec: error: the output would take")
    with pytest.raises(flashcodec.OutputTooLargeError, match="the output would take"):
        flashcodec.decode_video(str(tiny_h264), backend="pyav", num_frames=8)
    with flashcodec.DecodeEngine("pyav", cpu_threads=1) as engine:
        analysis = engine.analyse_bitstream(str(tiny_h264), num_frames=8)
        engine.add_decoding_request(analysis.key_id, stream=True)  # a stream's parts are freed as they are read
        assert sum(part.stop - part.start for part in engine.stream_decoding_output(analysis.key_id)) == 8


def test_an_unwritable_destination_is_refused_before_decoding(tiny_h264, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from flashcodec import cli

    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "dir.npy").mkdir()
    cases = {
        tmp_path / "missing" / "x.npy": "folder " + str(tmp_path / "missing") + " does not exist",
        tmp_path / "dir.npy": "is a folder; name a file",
        tmp_path / "file" / "x.pt": "does not exist",
        tmp_path / "file" / "pngs": "is not a folder",
        tmp_path / "file.d" / "a" / "pngs": None,  # a new folder with new parents: made at the end
        tmp_path / "x.npy": None,
    }
    for out, needle in cases.items():
        args = SimpleNamespace(out=out, output="rgb")
        if needle is None:
            cli._check_out(args)
        else:
            with pytest.raises(ValueError, match=re.escape(needle)):
                cli._check_out(args)
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} is not writable")):
        cli._check_out(SimpleNamespace(out=tmp_path / "x.pt", output="rgb"))

    with pytest.raises(ValueError, match=re.escape(f"--json {tmp_path}/results: {tmp_path} is not writable")):
        cli._check_destination(tmp_path / "results", "--json")  # no suffix: still a file
    monkeypatch.undo()

    for command in ("decode", "bench"):
        flag = "--out" if command == "decode" else "--json"
        result = run_cli(command, tiny_h264, flag, str(tmp_path / "missing" / "x.npy"))
        assert result.returncode == 1 and result.stderr.count("flashcodec: error:") == 1, result.stderr
        assert f"{flag} {tmp_path}/missing/x.npy: folder" in result.stderr and "Traceback" not in result.stderr
        assert result.stdout == ""  # refused before any decoding (bench prints as it goes)

    from flashcodec._errors import SourceNotFoundError, error_line

    # what the checks cannot see (e.g. a folder that takes no new files, as /proc): the system's reason in one line
    assert error_line(FileNotFoundError(2, "No such file or directory", "/proc/x.npy")) == \
        "/proc/x.npy: No such file or directory"
    assert error_line(PermissionError(13, "Permission denied")) == "Permission denied"
    assert error_line(SourceNotFoundError("a.mp4: does not exist")) == "a.mp4: does not exist"
    assert error_line(ValueError("--out x: bad")) == "--out x: bad"
    if Path("/dev/full").exists():  # a write that fails after the whole run: where it could not go, and why
        result = run_cli("bench", tiny_h264, "--repeat", "1", "--peers", "pyav", "--json", "/dev/full")
        assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == \
            "flashcodec: error: cannot write the results to /dev/full: No space left on device", result.stderr
        # --out through a link to a full device, or to a folder that does not exist: the path and the reason, for
        # .pt too (torch.save's own writer raised a RuntimeError there, a traceback)
        for name, target, reason in (("full.pt", "/dev/full", "No space left on device"),
                                     ("full.npy", "/dev/full", "No space left on device"),
                                     ("dangling.pt", str(tmp_path / "nowhere" / "a.pt"), "No such file or directory")):
            (tmp_path / name).symlink_to(target)
            result = run_cli("decode", tiny_h264, "--out", str(tmp_path / name))
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            assert result.stderr.strip().splitlines()[-1] == f"flashcodec: error: {tmp_path / name}: {reason}"


def test_a_path_that_is_not_a_regular_file_says_so():
    result = run_cli("decode", "/dev/null")
    assert result.returncode == 1 and "/dev/null: is not a regular file" in result.stderr


def test_bad_flags_exit_with_usage_error(tiny_h264):
    for args in (["--fps", "0"], ["--size", "axb"], ["--fps", "2", "--num-frames", "4"], ["--out", "x.gif"]):
        result = run_cli("decode", tiny_h264, *args)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        if args[0] != "--out":  # a flag argparse refuses: one line, no usage dump
            assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert result.stderr.startswith("flashcodec decode: error: ")


def test_corrupt_gop_in_the_middle(video_factory, tmp_path):
    """Documented behaviour: by default a corrupt GOP fails the decode with the frames it lost;
    --on-corrupt repeat decodes the rest and repeats the nearest good frame in their place."""
    good = video_factory(codec="h264", suffix=".mp4", **{**TINY, "duration_s": 2.0})
    bad = synthetic_video.corrupt_middle(good, tmp_path / "corrupt.mp4", seed=3)
    strict = run_cli("decode", bad, "--fps", "24", "--json")
    lenient = run_cli("decode", bad, "--fps", "24", "--json", "--on-corrupt", "repeat")
    assert lenient.returncode == 0, lenient.stderr
    summary = json.loads(lenient.stdout)
    if summary["failed_frame_indices"]:
        assert strict.returncode == 1 and "could not be decoded" in strict.stderr and "Traceback" not in strict.stderr
        assert len(summary["failed_frame_indices"]) < summary["num_frames"]
    else:  # FFmpeg concealed the damage in every frame: both modes succeed
        assert strict.returncode == 0


def test_help_explains_each_command():
    for cmd in ("probe", "decode", "bench"):
        result = run_cli(cmd, "--help")
        assert result.returncode == 0 and "usage: flashcodec" in result.stdout


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp"])
def test_decode_image_files(image_factory, tmp_path, suffix, capsys):
    path = image_factory(suffix, width=97, height=61)
    out = tmp_path / "img.npy"
    assert main(["decode", str(path), "--out", str(out)]) == 0
    assert "image at 56x84" in capsys.readouterr().out
    assert np.load(out).shape == (1, 3, 56, 84)
    assert main(["decode", str(path), "--output", "patches", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["grid_thw"] == [1, 4, 6]


def test_corrupt_image_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    result = run_cli("decode", bad)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "flashcodec: error:" in result.stderr


def test_a_text_mode_file_is_refused_as_one(tiny_h264):
    """A file opened in text mode: its read() decoded the video's bytes as text (a UnicodeDecodeError)."""
    import flashcodec

    with open(tiny_h264) as f, pytest.raises(TypeError, match="must be opened in binary mode"):
        flashcodec.decode_video(f)


def test_an_image_past_pils_warning_size_prints_no_warning(tmp_path, monkeypatch, capsys):
    """PIL warns (two lines on stderr, a source path among them) above half its own limit; the CLI's image decode
    has its own cap, so its output is the result line alone. Here PIL's limit is lowered to 1000 pixels."""
    import warnings

    from PIL import Image

    path = tmp_path / "wide.png"
    Image.new("RGB", (40, 30)).save(path)  # 1200 pixels: over 1000, under PIL's error at 2000
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["decode", str(path), "--no-progress"]) == 0
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert capsys.readouterr().err == ""
