"""Prebuilt flashinfer kernels for the GPU machine: compiled here, checked and installed there.

flashinfer JIT-compiles each attention kernel configuration on first use: on the H100 machine 26 s for
the tensor-core decode kernel and 106 s for the Hopper (FA3) prefill (docs/gpu.md), and every device
run pays it again, because each starts on a fresh machine. This machine has the same nvcc (13.0), so
the modules the project's GPU runs use are compiled here once for sm_90a and carried with the wheels:

  build OUT.tar.xz      here: compile the modules (flashinfer importable, nvcc on PATH; 50 s for an FA2 and
                        5 min for an FA3 module on two cores, incremental in --build-dir) and pack them
                        with a manifest
  install ARCHIVE       there, after the wheels: check flashinfer's version and each module's digest,
                        load each in a child process, and put the ones that load in flashinfer's AOT
                        folder, where it loads them instead of compiling (a module that does not load is
                        left to the JIT, said in one line)
  slim-wheel WHEEL      drop CUTLASS's headers (37 MB unpacked, 6.1 MB of the 14.2 MB wheel) from flashinfer's
                        wheel, to fit the 64 MiB a run may carry: only JIT builds of the FA3 kernels read
                        them, and those are carried prebuilt; a run whose FA3 modules cannot load falls
                        back to FA2 (``install --env-out``), which compiles without them
  configs               print the kernel configurations (no flashinfer needed)
  check                 plan the project's attention backends against the real flashinfer (its Hopper check
                        forced, nothing loaded) and check they ask for exactly those modules

Which modules: flashinfer's decode with ``use_tensor_cores=True`` runs its FA2 prefill module; paged
prefill and the vision tower's ragged attention run what ``backend="auto"`` picks on Hopper, FA3
(``unifiedserve.attention.flashinfer_backend``). Each is one module per (backend, dtype, head dim),
here for the demo model (head dim 64) and the Qwen2.5-VL presets (128; the vision tower's 80 is
padded to 128) in bfloat16, the dtype the engine uses on CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: what the carried modules are compiled for: the H100/H200 machines (flashinfer names Hopper "90a")
CUDA_ARCH = "9.0"
DEFAULT_PRESETS = ("tiny", "qwen2.5-vl-3b", "qwen2.5-vl-7b")
#: the wheel's folders only JIT builds of the FA3 (Hopper) kernels read
SLIM_DROP = ("flashinfer/data/cutlass/",)
FALLBACK_ENV = "UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND=fa2"
MANIFEST = "manifest.json"


@dataclass(frozen=True, order=True)
class KernelConfig:
    backend: str  # "fa2" | "fa3"
    dtype: str  # torch dtype name, e.g. "bfloat16"
    head_dim: int

    def __str__(self) -> str:
        return f"{self.backend} {self.dtype} head_dim {self.head_dim}"


def kernel_configs(presets: tuple[str, ...] = DEFAULT_PRESETS, dtype: str = "bfloat16") -> list[KernelConfig]:
    """The flashinfer modules a GPU run of these models uses, sorted.

    Raises:
        ValueError: an unknown preset, or a head dim flashinfer has no kernels for.
    """
    from unifiedserve.attention.flashinfer_backend import SUPPORTED_HEAD_DIMS
    from unifiedserve.attention.varlen import kernel_head_dim
    from unifiedserve.model.demo import preset_shapes

    configs = set()
    for name in presets:
        text, vision = preset_shapes(name)
        if text.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{name}: flashinfer has no kernels for head dim {text.head_dim}")
        configs.add(KernelConfig("fa2", dtype, text.head_dim))  # decode (tensor cores)
        configs.add(KernelConfig("fa3", dtype, text.head_dim))  # paged prefill: auto on Hopper
        padded = kernel_head_dim(vision.head_dim)  # the tower's head dim, padded as attention.varlen does
        if padded is None:
            raise ValueError(f"{name}: vision head dim {vision.head_dim} is over flashinfer's 256")
        configs.add(KernelConfig("fa3", dtype, padded))  # the tower's ragged attention
    return sorted(configs)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def requested_configs(presets: tuple[str, ...] = DEFAULT_PRESETS, dtype: str = "bfloat16") -> list[KernelConfig]:
    """The modules the project's attention backends ask flashinfer for on a Hopper GPU, found without one.

    Drives ``FlashInferAttention.plan`` (a prefill step, a decode step eager and as a CUDA graph replays it)
    and the vision tower's ragged path for each model, with flashinfer's Hopper check forced true, CPU
    tensors for its pinned buffers, and its module lookup recording the request instead of loading;
    :func:`kernel_configs` must equal this, or a run would JIT-compile what was meant to be carried.
    Needs flashinfer importable (the build's site).
    """
    import torch

    empty = torch.empty
    undo = []
    torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)  # no driver here: nothing is pinned
    try:
        import flashinfer.decode as fi_decode
        import flashinfer.prefill as fi_prefill
        import flashinfer.utils as fi_utils

        from unifiedserve.attention import flashinfer_backend, varlen
        from unifiedserve.attention.base import KVCache
        from unifiedserve.model.demo import preset_shapes

        asked = set()

        class _Recorded:  # what get_batch_prefill_module returns: plan() answers, nothing runs
            def __getattr__(self, name):
                return lambda *a, **k: []

        def record(backend, dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_qk, head_dim_vo, pos_encoding,
                   sliding_window, soft_cap, fp16_qk):
            expected = (dtype_q == dtype_kv == dtype_o, dtype_idx == torch.int32, head_dim_qk == head_dim_vo,
                        pos_encoding == 0, not sliding_window, not soft_cap, not fp16_qk)
            if not all(expected):
                raise ValueError(f"unexpected flashinfer module arguments: {dtype_q} {dtype_kv} {dtype_o} {dtype_idx} "
                                 f"{head_dim_qk}/{head_dim_vo} {pos_encoding} {sliding_window} {soft_cap} {fp16_qk}")
            asked.add(KernelConfig(backend, str(dtype_q).removeprefix("torch."), head_dim_qk))
            return _Recorded()

        for module in (fi_utils, fi_prefill, fi_decode):
            if hasattr(module, "is_sm90a_supported"):
                module.is_sm90a_supported = lambda device: True
        fi_prefill.get_batch_prefill_module = fi_decode.get_batch_prefill_module = record
        undo.append(lambda copy_done=flashinfer_backend._copy_done_event: setattr(
            flashinfer_backend, "_copy_done_event", copy_done))
        flashinfer_backend._copy_done_event = lambda device: None  # no CUDA event without a driver
        torch_dtype = getattr(torch, dtype)
        for name in presets:
            text, vision = preset_shapes(name)
            cache = KVCache(1, 8, 16, text.num_key_value_heads, text.head_dim, dtype=torch_dtype)
            attn = _backend_on_cpu(flashinfer_backend, cache, text)
            attn.plan([(0, 5, [0])])  # a prefill chunk
            attn.plan([(4, 1, [0])])  # a decode step
            attn.init_cuda_graph([1, 2], 64)  # and one as a captured graph replays it (its own wrappers)
            attn.plan([(4, 1, [0])], graph_batch_size=2)
            qkv = torch.zeros(64, vision.num_heads, vision.head_dim, dtype=torch_dtype)  # the tower's own head dim
            varlen._ragged(qkv, qkv, qkv, (16, 48), vision.head_dim ** -0.5)  # pads it as a GPU run would
        return sorted(asked)
    finally:
        torch.empty = empty
        for restore in undo:
            restore()


def _backend_on_cpu(flashinfer_backend, cache, text):
    """A ``FlashInferAttention`` on a CPU cache (its device check skipped: only planning runs)."""
    check = flashinfer_backend.FlashInferAttention._validate_cache
    flashinfer_backend.FlashInferAttention._validate_cache = staticmethod(lambda kv_cache: None)
    try:
        return flashinfer_backend.FlashInferAttention(cache, text.num_attention_heads, text.num_key_value_heads,
                                                      text.head_dim)
    finally:
        flashinfer_backend.FlashInferAttention._validate_cache = check


# -- build (development machine) -------------------------------------------------------------------------


def _toolchain_env(build_dir: Path) -> None:
    """Set what flashinfer's JIT needs to compile for Hopper on a machine without a GPU or a driver.

    Raises:
        RuntimeError: no nvcc, or no cuRAND headers (CUTLASS's utilities include them).
    """
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", shutil.which("nvcc") and
                  str(Path(shutil.which("nvcc")).resolve().parent.parent)]
    cuda_home = next((Path(c) for c in candidates if c and (Path(c) / "bin" / "nvcc").exists()), None)
    if cuda_home is None:
        raise RuntimeError("no nvcc: install the CUDA 13.0 toolkit or set CUDA_HOME")
    os.environ["CUDA_HOME"] = str(cuda_home)
    os.environ["PATH"] = f"{cuda_home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = CUDA_ARCH
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(build_dir)
    # The modules link -lcuda; a machine without a driver has no libcuda.so to name. An empty library with
    # the driver's soname satisfies the linker; nothing of it is used (the modules call the runtime only).
    stubs = [cuda_home / "lib64" / "stubs" / "libcuda.so", cuda_home / "lib64" / "libcuda.so",
             Path("/usr/lib/x86_64-linux-gnu/libcuda.so")]
    if not any(p.exists() for p in stubs):
        stub_dir = build_dir / "stubs"
        stub_dir.mkdir(parents=True, exist_ok=True)
        if not (stub_dir / "libcuda.so").exists():
            subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stub_dir / "libcuda.so"),
                            "-x", "c", "/dev/null"], check=True)
        os.environ["LIBRARY_PATH"] = f"{stub_dir}{os.pathsep}{os.environ.get('LIBRARY_PATH', '')}"
    if not (cuda_home / "include" / "curand_kernel.h").exists():
        found = [Path(p) / "nvidia" / "cu13" / "include" for p in sys.path
                 if (Path(p) / "nvidia" / "cu13" / "include" / "curand_kernel.h").exists()]
        if not found:
            raise RuntimeError(f"no cuRAND headers in {cuda_home}/include or an installed nvidia-curand: "
                               "pip install nvidia-curand (CUDA 13)")
        os.environ["CPATH"] = f"{found[0]}{os.pathsep}{os.environ.get('CPATH', '')}"


def build(out: Path, configs: list[KernelConfig], build_dir: Path) -> dict:
    """Compile ``configs`` with flashinfer's own JIT recipe and pack them (and a manifest) into ``out``.

    Returns:
        The manifest.
    Raises:
        RuntimeError: a missing tool (see :func:`_toolchain_env`) or a failed compilation.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    _toolchain_env(build_dir)
    import flashinfer  # after the environment: flashinfer reads it at import
    import torch
    from flashinfer.jit.attention.modules import gen_batch_prefill_module

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    modules, libraries = [], []
    for cfg in configs:
        dtype = getattr(torch, cfg.dtype)
        spec = gen_batch_prefill_module(cfg.backend, dtype, dtype, dtype, torch.int32, cfg.head_dim, cfg.head_dim,
                                        0, False, False, False)  # no RoPE in-kernel, no window, no soft cap
        start = time.perf_counter()
        print(f"building {cfg.backend} {cfg.dtype} head_dim {cfg.head_dim} ({spec.name}) ...", flush=True)
        try:
            spec.build(verbose=False)
        except RuntimeError as exc:  # flashinfer's message holds ninja's whole output: keep it in a file
            log = build_dir / "failed-build.log"
            log.write_text(str(exc))
            errors = [ln for ln in str(exc).splitlines() if "error" in ln.lower()]
            raise RuntimeError(f"compiling {spec.name} failed: {(errors or ['see the log'])[0].strip()[:300]} "
                               f"(ninja's output: {log})") from None
        so = spec.jit_library_path
        libraries.append(so)
        modules.append(dict(asdict(cfg), name=spec.name, sha256=sha256(so), bytes=so.stat().st_size))
        print(f"  {so.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.0f} s", flush=True)
    manifest = dict(flashinfer=flashinfer.__version__, arch=CUDA_ARCH, nvcc=nvcc,
                    built=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), modules=modules)
    pack(out, manifest, libraries)
    print(f"wrote {out}: {len(modules)} modules, {out.stat().st_size / 1e6:.1f} MB")
    return manifest


def pack(out: Path, manifest: dict, libraries: list[Path]) -> None:
    """Write ``manifest`` and each module's library (``NAME/NAME.so``, in the manifest's order) to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:xz") as tar:
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for mod, so in zip(manifest["modules"], libraries, strict=True):
            tar.add(so, arcname=f"{mod['name']}/{mod['name']}.so")
    tmp.replace(out)


# -- install (GPU machine) -------------------------------------------------------------------------------

#: run in a child process, so that a library that does not load cannot take the caller down; one marked line per
#: path (anything else a library prints at load time is not a result)
_MARK = "flashinfer_kernels.load: "
_LOAD_CHECK = """
import sys, torch, tvm_ffi
for path in sys.argv[1:]:
    try:
        tvm_ffi.load_module(path)
        print("%sok", flush=True)
    except Exception as exc:
        print("%s" + f"{type(exc).__name__}: {exc}".replace(chr(10), " "), flush=True)
""" % (_MARK, _MARK)


def load_errors(paths: list[Path], timeout: float = 180.0) -> list[str | None]:
    """Why each library does not load as a tvm-ffi module in a fresh interpreter (``None`` where it loads).

    All are tried in one child process (importing torch once); if that child dies, each is tried alone.
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, *map(str, paths)], capture_output=True,
                              text=True, timeout=timeout)
        lines = [line[len(_MARK):] for line in proc.stdout.splitlines() if line.startswith(_MARK)]
        if proc.returncode == 0 and len(lines) == len(paths):
            return [None if line == "ok" else line for line in lines]
        why = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), f"exit status {proc.returncode}")
    except subprocess.TimeoutExpired:
        why = f"loading took over {timeout:.0f} s"
    if len(paths) == 1:
        return [why]
    return [load_errors([p], timeout)[0] for p in paths]


def install(archive: Path, aot_dir: Path | None = None, env_out: Path | None = None) -> int:
    """Check the archive's modules and place the ones that load in flashinfer's AOT folder.

    Where an FA3 module is not installed and this flashinfer has no CUTLASS headers to compile it (a slim
    wheel), ``env_out`` gets the FA2 fallback (``UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND=fa2``) for the run.

    Returns:
        0 when every module was installed, 1 when some were not (each said in one line; flashinfer
        compiles those on first use), 2 when none could be (another flashinfer, an unreadable archive).
    """
    try:
        import flashinfer
        from flashinfer.jit import env as jit_env
    except ImportError as exc:
        print(f"flashinfer_kernels: error: flashinfer does not import ({exc})", file=sys.stderr)
        return 2
    status, fa3_missing = _install(archive, flashinfer.__version__,
                                   Path(aot_dir) if aot_dir is not None else Path(jit_env.FLASHINFER_AOT_DIR))
    cutlass = (Path(flashinfer.__file__).parent / SLIM_DROP[0].split("/", 1)[1]).is_dir()
    if fa3_missing and not cutlass:
        print("flashinfer kernels: FA3 modules are not installed and this flashinfer has no CUTLASS headers to "
              f"compile them: prefill falls back to FA2 ({FALLBACK_ENV})")
        if env_out is not None:
            Path(env_out).write_text(f"export {FALLBACK_ENV}\n")
    return status


def _install(archive: Path, version: str, target: Path) -> tuple[int, bool]:
    """:func:`install`'s work: (its status, whether an FA3 module was not installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(archive, "r:xz") as tar:
                tar.extractall(tmp, filter="data")
            manifest = json.loads((Path(tmp) / MANIFEST).read_text())
            modules = manifest["modules"]
        except (OSError, tarfile.TarError, ValueError, KeyError) as exc:
            print(f"flashinfer_kernels: error: {archive}: {exc}", file=sys.stderr)
            return 2, True
        if manifest.get("flashinfer") != version:
            print(f"flashinfer_kernels: error: the kernels are for flashinfer {manifest.get('flashinfer')}, this is "
                  f"{version}: not installed", file=sys.stderr)
            return 2, True
        failed = []
        libs = [Path(tmp) / m["name"] / f"{m['name']}.so" for m in modules]
        intact = [so.is_file() and sha256(so) == m["sha256"] for so, m in zip(libs, modules)]
        loads = iter(load_errors([so for so, ok in zip(libs, intact) if ok]) if any(intact) else [])
        for mod, so, ok in zip(modules, libs, intact):
            name, label = mod["name"], f"{mod['backend']} {mod['dtype']} head_dim {mod['head_dim']}"
            why = next(loads) if ok else "missing or its digest differs"
            if why is not None:
                failed.append(mod)
                print(f"flashinfer kernel {label}: not installed: {why}")
                continue
            (target / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, target / name / f"{name}.so")
            print(f"flashinfer kernel {label}: installed (prebuilt, {mod['bytes'] / 1e6:.1f} MB; built "
                  f"{manifest['built']} with {manifest['nvcc']})")
    return (1 if failed else 0), any(m["backend"] == "fa3" for m in failed)


# -- slim wheel ------------------------------------------------------------------------------------------


def slim_wheel(wheel: Path, drop: tuple[str, ...] = SLIM_DROP) -> tuple[int, int]:
    """Rewrite ``wheel`` without the files under ``drop`` (and their RECORD lines), in place.

    Returns:
        The wheel's size before and after.
    Raises:
        ValueError: not a wheel (no ``.dist-info/RECORD``).
    """
    before = wheel.stat().st_size
    tmp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as src:
        records = [n for n in src.namelist() if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{wheel} is not a wheel (no single .dist-info/RECORD)")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith(drop):
                    continue
                data = src.read(info)
                if info.filename == records[0]:
                    data = "".join(line for line in data.decode().splitlines(keepends=True)
                                   if not line.startswith(drop)).encode()
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


# -- CLI -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "configs", "check"):
        p = sub.add_parser(name)
        if name == "build":
            p.add_argument("out", type=Path, help="the archive to write (.tar.xz)")
            p.add_argument("--build-dir", type=Path,
                           default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                           / "unifiedserve" / "flashinfer-build",
                           help="flashinfer's JIT workspace here (kept: a second build is incremental)")
        p.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                       help=f"models whose kernels to build (default {','.join(DEFAULT_PRESETS)})")
        p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p = sub.add_parser("install")
    p.add_argument("archive", type=Path)
    p.add_argument("--aot-dir", type=Path, help="where to put them (default: flashinfer's AOT folder)")
    p.add_argument("--env-out", type=Path, help="write the FA2 fallback's environment here when it is needed")
    p = sub.add_parser("slim-wheel")
    p.add_argument("wheel", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command in ("build", "configs", "check"):
            presets = tuple(p for p in args.presets.split(",") if p)
            if not presets:
                raise ValueError("--presets names no model")
            configs = kernel_configs(presets, args.dtype)
            if args.command == "check":
                asked = requested_configs(presets, args.dtype)
                if asked != configs:
                    raise ValueError(f"the attention backends ask flashinfer for {', '.join(map(str, asked))}; the "
                                     f"build makes {', '.join(map(str, configs))}")
                print(f"the attention backends ask flashinfer for exactly the {len(configs)} modules built")
                return 0
            if args.command == "configs":
                for cfg in configs:
                    print(cfg)
                return 0
            build(args.out, configs, args.build_dir)
            return 0
        if args.command == "install":
            return install(args.archive, args.aot_dir, args.env_out)
        before, after = slim_wheel(args.wheel)
        print(f"{args.wheel.name}: {before / 1e6:.1f} -> {after / 1e6:.1f} MB without {', '.join(SLIM_DROP)}")
        return 0
    except (ValueError, RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"flashinfer_kernels: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
