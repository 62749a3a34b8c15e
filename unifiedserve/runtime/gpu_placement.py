"""Which GPU, and which share of its SMs, each worker process gets under a policy (pure bookkeeping).

On one GPU the three processes share the device through MPS. A client's share is
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: a cap on the SMs its kernels may occupy, fixed when its CUDA
context is created (so it is set in the process's environment before CUDA starts). Caps are not
reservations, so a guaranteed share for decode is made by capping everyone else:

- ``unified``: vision and core are capped at ``100 - decode_sm_percent``; decode is not capped. Decode
  always finds its share free, and takes the whole GPU while encode/prefill idle (paper §6). With a share of 0
  nobody is capped: all three share every SM, and decode's pace rests on core's token budgets alone, the
  paper's own lever (§2, "Takeaway-4", and §4.5: the budgets of Algorithm 3 regulate decode's TBT).
- ``split``: disjoint shares on one GPU (core and vision ``100 - d``, decode ``d``), DistServe/EPD
  style; given two GPUs (``gpus``), encode/prefill on the first and decode on the second, uncapped (planned
  here, refused by ``serve`` until the KV cache can move between GPUs).
- ``monolithic``: one compute process (core, decode inside it) and vision, uncapped.

``mps_priority`` (``serve --mps-priority``, unified and split) also makes vision and core below-normal-priority
MPS clients (``CUDA_MPS_CLIENT_PRIORITY=1``) and decode a normal one (0): a hint by which the GPU dispatches the
thread blocks of decode's waiting work before theirs, without holding SMs back as a cap does. With
``--decode-sm-percent 0`` that is the paper's sharing: decode first, encode and prefill on whatever it leaves
(§4, "prioritizing the decode stream while allowing the encoder to utilize leftover cycles"). What it buys on a
given GPU is measured by ``bench/kernels/bench_sm_shares.py --modes alone,unified:0,priority:0``.

Without MPS the processes time-slice the GPU: caps cannot be enforced, which ``unified`` tolerates
(it says so once) and ``split`` on one GPU cannot (its point is the disjoint shares).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

POLICIES = ("unified", "monolithic", "split")


@dataclass(frozen=True)
class ProcessPlacement:
    """One worker's GPU (a physical ordinal) and its MPS SM cap in percent (None: uncapped)."""

    gpu: int
    sm_percent: int | None
    priority: int | None = None  # MPS client priority (0 normal, 1 below normal); None: not set

    def env(self, use_mps: bool, visible: str | None = None) -> dict[str, str]:
        """Environment the process must start with (before its CUDA context exists).

        ``gpu`` is an ordinal among the GPUs the server itself sees, so when the server was started with a
        ``CUDA_VISIBLE_DEVICES`` of its own (``visible``, default the environment's; a scheduler such as
        SLURM or Ray sets one), the worker gets that list's entry (an index or a UUID), not the ordinal.
        """
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        entries = [e.strip() for e in visible.split(",")] if visible else []
        env = {"CUDA_VISIBLE_DEVICES": entries[self.gpu] if self.gpu < len(entries) else str(self.gpu)}
        if use_mps and self.sm_percent is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(self.sm_percent)
        if use_mps and self.priority is not None:
            env["CUDA_MPS_CLIENT_PRIORITY"] = str(self.priority)
        return env


@dataclass(frozen=True)
class GpuPlacement:
    policy: str
    use_mps: bool
    processes: dict[str, ProcessPlacement]  # "vision", "core", "decode" (monolithic: no "decode")
    notes: tuple[str, ...] = ()  # one-line facts to log once at start (e.g. time-slicing without MPS)

    def env(self, process: str, visible: str | None = None) -> dict[str, str]:
        return self.processes[process].env(self.use_mps, visible)


def plan_gpu_placement(policy: str, num_visible_gpus: int, gpus: list[int] | None = None,
                       decode_sm_percent: int = 30, use_mps: bool = True, mps_priority: bool = False) -> GpuPlacement:
    """Place vision, core and decode on GPUs for ``policy``.

    Args:
        num_visible_gpus: CUDA devices this machine shows.
        gpus: the physical ordinals to use (default ``[0]``: every policy on one GPU; ``split`` takes a
            second GPU for decode only when given two). Their order matters: the first holds vision and core.
        decode_sm_percent: decode's guaranteed SM share (``unified``; 0: no caps at all) or its whole share
            (``split`` on one GPU), 1..99.
        use_mps: whether an MPS daemon serves these processes (see ``launch/mps.sh``).
        mps_priority: vision and core at MPS's below-normal client priority, decode at normal (unified, split).
    Raises:
        ValueError: an unknown policy, no GPU, an ordinal that is not visible or repeated, a share
            outside 1..99 (0 under ``unified``), ``split`` on one GPU without MPS, or ``mps_priority`` with
            ``monolithic`` or without MPS. The message names the flag to change.
    """
    if policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if num_visible_gpus < 1:
        raise ValueError("no CUDA device is visible; use --device cpu")
    if not isinstance(decode_sm_percent, int) or not 0 <= decode_sm_percent <= 99:
        raise ValueError(f"--decode-sm-percent must be an integer in 0..99, got {decode_sm_percent!r}")
    if mps_priority and policy == "monolithic":
        raise ValueError("--mps-priority: --policy monolithic has no decode process to put first (decode runs inside "
                         "core's steps); use --policy unified or split")
    if mps_priority and not use_mps:
        raise ValueError("--mps-priority needs the server to run under MPS (client priorities are MPS's): start a "
                         "daemon with launch/mps.sh start and leave out --mps off, or leave --mps-priority out")
    if decode_sm_percent == 0 and policy != "unified":
        raise ValueError(f"--decode-sm-percent 0 (no SM caps) applies to --policy unified; --policy {policy} "
                         f"takes a share in 1..99")
    if gpus is None:  # split on two GPUs needs the KV cache moved between them, which the server refuses for now
        gpus = [0]
    if not gpus:
        raise ValueError("--gpus is empty; give at least one GPU ordinal")
    bad = [g for g in gpus if not 0 <= g < num_visible_gpus]
    if bad:
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: GPU {bad[0]} is not visible "
                         f"({num_visible_gpus} visible: 0..{num_visible_gpus - 1})")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {','.join(map(str, gpus))} names a GPU twice")
    notes: list[str] = []
    first = gpus[0]
    rest = 100 - decode_sm_percent
    if len(gpus) > 2 or (len(gpus) == 2 and policy != "split"):
        raise ValueError(f"--policy {policy} uses {'two GPUs' if policy == 'split' else 'one GPU'} per server; "
                         f"got --gpus {','.join(map(str, gpus))} (start one server per GPU for more)")
    if policy == "monolithic":
        procs = {"vision": ProcessPlacement(first, None), "core": ProcessPlacement(first, None)}
    elif policy == "split" and len(gpus) == 2:
        procs = {"vision": ProcessPlacement(first, None), "core": ProcessPlacement(first, None),
                 "decode": ProcessPlacement(gpus[1], None)}
    elif policy == "split":
        if not use_mps:
            raise ValueError("--policy split on one GPU needs MPS for its disjoint SM shares: start it with "
                             "launch/mps.sh start (or launch/serve-node.sh)")
        procs = {"vision": ProcessPlacement(first, rest), "core": ProcessPlacement(first, rest),
                 "decode": ProcessPlacement(first, decode_sm_percent)}
    else:  # unified
        cap = rest if decode_sm_percent else None
        procs = {"vision": ProcessPlacement(first, cap), "core": ProcessPlacement(first, cap),
                 "decode": ProcessPlacement(first, None)}
        if use_mps and not decode_sm_percent:
            notes.append("--decode-sm-percent 0: vision, core and decode share every SM through MPS; decode's "
                         "pace rests on core's token budgets (--prefill-token-budget, --encode-token-budget)")
        if not use_mps:
            notes.append("no MPS daemon: vision, core and decode time-slice the GPU, so decode's SM share "
                         "is not guaranteed (start one with launch/mps.sh start)")
    if mps_priority:
        procs = {name: ProcessPlacement(p.gpu, p.sm_percent, 0 if name == "decode" else 1) for name, p in procs.items()}
        notes.append("--mps-priority: vision and core are below-normal-priority MPS clients, decode a normal one")
    return GpuPlacement(policy, use_mps, procs, tuple(notes))


#: a worker's MPS settings, which its placement alone decides: never inherited from the server's environment
INHERITED_MPS_SETTINGS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY")


def apply_process_env(env: dict[str, str]) -> None:
    """Set a worker's placement environment (:meth:`ProcessPlacement.env`) in this process, before CUDA starts.

    An SM cap or client priority the server itself was started with (:data:`INHERITED_MPS_SETTINGS`) is dropped
    first whenever there is a placement: a process the placement leaves uncapped (monolithic's, unified's decode)
    must not run capped, nor a capped one at another share than its policy's."""
    if env:
        for name in INHERITED_MPS_SETTINGS:
            os.environ.pop(name, None)
    os.environ.update(env)


DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where a daemon started without CUDA_MPS_PIPE_DIRECTORY listens


def mps_running(pipe_directory: str | None = None) -> bool:
    """Whether an MPS control daemon listens for this process's clients: its ``control`` socket exists in
    ``pipe_directory`` (default ``$CUDA_MPS_PIPE_DIRECTORY``, else the driver's default). A client
    started while one listens becomes an MPS client; the daemon's health is its own (``launch/mps.sh status``)."""
    folder = pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIRECTORY
    try:
        return stat.S_ISSOCK(os.stat(os.path.join(folder, "control")).st_mode)
    except OSError:
        return False
