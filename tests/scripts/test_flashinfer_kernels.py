"""scripts/flashinfer_kernels.py: which kernels the GPU runs need, the slim wheel, and the install on the device
(checked here with stand-ins for flashinfer and tvm-ffi; the real build needs flashinfer and nvcc)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "flashinfer_kernels.py"


def _load():
    spec = importlib.util.spec_from_file_location("flashinfer_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashinfer_kernels"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fk = _load()


def tool(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env)


def test_kernel_configs_follow_the_models():
    K = fk.KernelConfig
    # demo model: text head dim 64 (decode FA2, prefill FA3), vision 80 padded to 128 (FA3); Qwen presets: 128
    assert fk.kernel_configs() == [K("fa2", "bfloat16", 64), K("fa2", "bfloat16", 128), K("fa3", "bfloat16", 64),
                                   K("fa3", "bfloat16", 128)]
    assert fk.kernel_configs(("qwen2.5-vl-7b",), "float16") == [K("fa2", "float16", 128), K("fa3", "float16", 128)]
    with pytest.raises(ValueError, match="unknown preset 'qwen3'"):
        fk.kernel_configs(("qwen3",))
    proc = tool("configs", "--presets", "qwen2.5-vl-3b")
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["fa2 bfloat16 head_dim 128",
                                                                  "fa3 bfloat16 head_dim 128"]
    proc = tool("configs", "--presets", "nope")
    assert proc.returncode == 1 and proc.stderr.strip().startswith("flashinfer_kernels: error: unknown preset")
    proc = tool("build", "out.tar.xz", "--presets", ",")
    assert proc.returncode == 1 and proc.stderr.strip() == "flashinfer_kernels: error: --presets names no model"


def test_slim_wheel_drops_cutlass_and_its_record_lines(tmp_path):
    wheel = tmp_path / "flashinfer_python-0.6.13-py3-none-any.whl"
    kept = {"flashinfer/__init__.py": b"__version__ = '0.6.13'\n", "flashinfer/data/include/a.cuh": b"x" * 5000,
            "flashinfer/data/cutlass_notes.txt": b"not under the dropped folder"}
    dropped = {f"flashinfer/data/cutlass/include/cute/h{i}.hpp": bytes(range(256)) * 40 for i in range(20)}
    record = "".join(f"{n},sha256=abc,{len(d)}\n" for n, d in {**kept, **dropped}.items())
    record += "flashinfer_python-0.6.13.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in {**kept, **dropped}.items():
            z.writestr(name, data)
        z.writestr("flashinfer_python-0.6.13.dist-info/RECORD", record)
    before, after = fk.slim_wheel(wheel)
    assert after == wheel.stat().st_size < before
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {*kept, "flashinfer_python-0.6.13.dist-info/RECORD"}
        assert all(z.read(n) == d for n, d in kept.items())
        lines = z.read("flashinfer_python-0.6.13.dist-info/RECORD").decode().splitlines()
    assert len(lines) == len(kept) + 1 and not any("data/cutlass/" in line for line in lines)
    bad = tmp_path / "not_a.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x.py", "")
    with pytest.raises(ValueError, match="is not a wheel"):
        fk.slim_wheel(bad)


@pytest.fixture
def device_site(tmp_path, monkeypatch):
    """A site folder with stand-ins for flashinfer 0.6.13 (no CUTLASS headers: a slim wheel) and tvm-ffi (whose
    ``load_module`` fails for a library starting with ``bad`` and kills the process for ``crash``), importable here
    and in child processes."""
    site = tmp_path / "site"
    (site / "flashinfer" / "jit").mkdir(parents=True)
    (site / "flashinfer" / "data" / "include").mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text("__version__ = '0.6.13'\n")
    (site / "flashinfer" / "jit" / "__init__.py").write_text("")
    (site / "flashinfer" / "jit" / "env.py").write_text(
        "import pathlib\nFLASHINFER_AOT_DIR = pathlib.Path(__file__).resolve().parents[1] / 'data' / 'aot'\n")
    (site / "tvm_ffi").mkdir()
    (site / "tvm_ffi" / "__init__.py").write_text(
        "import os\n"
        "def load_module(path):\n"
        "    if open(path, 'rb').read().startswith(b'crash'):\n"
        "        os._exit(3)\n"
        "    if open(path, 'rb').read().startswith(b'bad'):\n"
        "        raise OSError(path + ': undefined symbol: _ZSt28__throw_bad_array_new_lengthv')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith(("flashinfer.", "tvm_ffi"))]:
        monkeypatch.delitem(sys.modules, name)
    yield site
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith(("flashinfer.", "tvm_ffi"))]:
        del sys.modules[name]


def _archive(tmp_path, modules: dict[tuple[str, int], bytes], version="0.6.13") -> Path:
    libs, entries = [], []
    for (backend, head_dim), data in modules.items():
        name = f"batch_prefill_bf16_{head_dim}" + ("_sm90" if backend == "fa3" else "")
        lib = tmp_path / "built" / f"{name}.so"
        lib.parent.mkdir(exist_ok=True)
        lib.write_bytes(data)
        libs.append(lib)
        entries.append(dict(backend=backend, dtype="bfloat16", head_dim=head_dim, name=name, sha256=fk.sha256(lib),
                            bytes=len(data)))
    out = tmp_path / "flashinfer-kernels.tar.xz"
    fk.pack(out, dict(flashinfer=version, arch="9.0", nvcc="Build cuda_13.0", built="2026-11-23T00:00:00Z",
                      modules=entries), libs)
    return out


def test_install_places_modules_that_load(tmp_path, device_site):
    archive = _archive(tmp_path, {("fa2", 128): b"\x7fELF fa2", ("fa3", 128): b"\x7fELF fa3"})
    assert fk.install(archive, env_out=tmp_path / "env") == 0
    aot = device_site / "flashinfer" / "data" / "aot"
    assert (aot / "batch_prefill_bf16_128" / "batch_prefill_bf16_128.so").read_bytes() == b"\x7fELF fa2"
    assert (aot / "batch_prefill_bf16_128_sm90" / "batch_prefill_bf16_128_sm90.so").read_bytes() == b"\x7fELF fa3"
    assert not (tmp_path / "env").exists()


def test_install_skips_what_does_not_load_and_falls_back_to_fa2(tmp_path, device_site, capsys):
    archive = _archive(tmp_path, {("fa2", 128): b"\x7fELF fa2", ("fa3", 128): b"bad fa3"})
    assert fk.install(archive, env_out=tmp_path / "env") == 1
    out = capsys.readouterr().out
    assert "flashinfer kernel fa3 bfloat16 head_dim 128: not installed: OSError: " in out
    assert "undefined symbol" in out and "fa2 bfloat16 head_dim 128: installed" in out
    aot = device_site / "flashinfer" / "data" / "aot"
    assert sorted(p.name for p in aot.iterdir()) == ["batch_prefill_bf16_128"]
    assert (tmp_path / "env").read_text() == "export UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND=fa2\n"
    # with CUTLASS's headers there, flashinfer compiles the FA3 module itself: no fallback
    (tmp_path / "env").unlink()
    (device_site / "flashinfer" / "data" / "cutlass").mkdir()
    assert fk.install(archive, env_out=tmp_path / "env") == 1
    assert not (tmp_path / "env").exists()


def test_install_refuses_another_flashinfer_or_a_tampered_module(tmp_path, device_site, capsys):
    assert fk.install(_archive(tmp_path, {("fa2", 64): b"\x7fELF"}, version="0.6.12"), env_out=tmp_path / "env") == 2
    assert "the kernels are for flashinfer 0.6.12, this is 0.6.13" in capsys.readouterr().err
    assert (tmp_path / "env").read_text().startswith("export UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND=fa2")
    archive = _archive(tmp_path, {("fa2", 64): b"\x7fELF"})
    broken = tmp_path / "broken.tar.xz"
    broken.write_bytes(archive.read_bytes()[:40])
    assert fk.install(broken) == 2
    assert "flashinfer_kernels: error:" in capsys.readouterr().err
    # a module whose bytes differ from the manifest's digest is not installed
    import json
    import tarfile
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
    manifest["modules"][0]["sha256"] = "0" * 64
    lib = tmp_path / "built" / "batch_prefill_bf16_64.so"
    fk.pack(archive, manifest, [lib])
    assert fk.install(archive) == 1
    assert "fa2 bfloat16 head_dim 64: not installed: missing or its digest differs" in capsys.readouterr().out
    proc = tool("install", str(tmp_path / "missing.tar.xz"))
    assert proc.returncode == 2 and proc.stderr.startswith("flashinfer_kernels: error:")


def test_a_library_that_kills_the_loader_costs_only_itself(tmp_path, device_site, capsys):
    archive = _archive(tmp_path, {("fa2", 64): b"\x7fELF a", ("fa3", 64): b"crash", ("fa2", 128): b"\x7fELF b"})
    assert fk.install(archive) == 1
    out = capsys.readouterr().out
    assert "fa3 bfloat16 head_dim 64: not installed: exit status 3" in out
    assert out.count(": installed (prebuilt") == 2


def test_load_check_reads_only_its_own_lines(tmp_path, monkeypatch):
    """A library that prints at load time must not turn every module into "not installed": only the marked
    lines are results."""
    mark = fk._MARK
    monkeypatch.setattr(fk, "_LOAD_CHECK", "import sys\nprint('a banner from some library')\n"
                                           f"for p in sys.argv[1:]:\n    print({mark!r} + ('ok' if 'good' in p "
                                           "else 'OSError: cannot open'))\n    print('more noise')\n")
    paths = [tmp_path / "good.so", tmp_path / "bad.so"]
    assert fk.load_errors(paths) == [None, "OSError: cannot open"]
