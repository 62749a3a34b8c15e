"""Which source a benchmark's JSON was measured on: the commit, and whether the tracked files differ from it.

A tree copied to another machine can carry an older ``.git`` than its files (the GPU machine's copy named the
session's first commit for a later tree): " + changes" says so, as ``scripts/gpu_check.sh`` does."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: the repository this package lives in (its benchmarks run from a checkout)
REPO_ROOT = Path(__file__).resolve().parents[1]


def source_commit(root: Path | str = REPO_ROOT) -> str | None:
    """``"<short hash>"``, or ``"<short hash> + changes"`` when tracked files differ from it; None outside a git
    checkout (or without git)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return None
        changed = git("diff", "--quiet", "HEAD").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" + changes" if changed else "")
