"""How much memory this process can still take: the kernel's ``MemAvailable``, bounded by its memory cgroup.

Inside a container (Docker ``--memory``, a Kubernetes limit, a systemd slice) ``/proc/meminfo`` describes the
whole host: a check against it lets through an allocation the cgroup's limit then answers with the OOM killer.
:func:`cgroup_memory_room` reads the limit of the process's memory cgroup and of each ancestor that has one
(cgroup v2's ``memory.max``, v1's ``memory.limit_in_bytes``) and subtracts what each has charged, less its file
cache (the active and inactive file lists, which the kernel reclaims before it kills, as ``MemAvailable`` counts
them; a tmpfs page, such as the server's shared pools, is on the anonymous lists and stays counted).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

#: a v1 limit at or above this is "no limit" (the kernel reports 2^63 rounded down to a page)
_V1_UNLIMITED = 1 << 62


def _read_int(path: str) -> int | None:
    try:  # a number the kernel wrote (ASCII)
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":  # v2: no limit
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _file_cache(stat_path: str, version: int) -> int:
    """Bytes on a cgroup's file lists (active and inactive) from its ``memory.stat``, 0 when it cannot be read
    (v1: the hierarchical ``total_`` counts where present)."""
    try:
        with open(stat_path, errors="surrogateescape") as f:
            fields = dict(line.split(None, 1) for line in f if " " in line)
    except (OSError, ValueError):
        return 0
    total = 0
    for name in ("active_file", "inactive_file"):
        for key in ((f"total_{name}", name) if version == 1 else (name,)):
            try:
                total += int(fields[key])
                break
            except (KeyError, ValueError):
                continue
    return total


def _memory_cgroups(proc_cgroup: str, root: str) -> list[tuple[str, int]]:
    """``(folder, version)`` of the process's memory cgroup and its ancestors, deepest first, those that exist.

    The mount's own root is always among them: without a cgroup namespace, a container's ``/proc/self/cgroup``
    names a host path while its mount shows its own cgroup at the root."""
    try:  # a cgroup's name need not be UTF-8
        with open(proc_cgroup, errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            version, base = 2, root
        elif "memory" in controllers.split(","):
            version, base = 1, os.path.join(root, "memory")
        else:
            continue
        folders = [PurePosixPath(path or "/")]
        folders += list(folders[0].parents)
        for folder in folders:
            where = os.path.join(base, str(folder).lstrip("/"))
            if os.path.isdir(where) and (where, version) not in found:
                found.append((where, version))
    v1 = [f for f in found if f[1] == 1]
    return v1 or found  # a v1 memory controller, where mounted, is the one that charges (hybrid mounts)


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the process's memory cgroups can still charge before their limit: the least over the process's
    cgroup and its ancestors of ``limit - (usage - file cache)``, at least 0; None where none has a limit (or
    cgroups cannot be read)."""
    room = None
    for folder, version in _memory_cgroups(proc_cgroup, root):
        if version == 2:
            limit = _read_int(os.path.join(folder, "memory.max"))
            usage = _read_int(os.path.join(folder, "memory.current"))
            cache = _file_cache(os.path.join(folder, "memory.stat"), 2)
        else:
            limit = _read_int(os.path.join(folder, "memory.limit_in_bytes"))
            if limit is not None and limit >= _V1_UNLIMITED:
                limit = None
            usage = _read_int(os.path.join(folder, "memory.usage_in_bytes"))
            cache = _file_cache(os.path.join(folder, "memory.stat"), 1)
        if limit is None or usage is None:
            continue
        left = max(0, limit - max(0, usage - cache))
        room = left if room is None else min(room, left)
    return room


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """``(bytes, what)``: the memory a new allocation can have: the kernel's ``MemAvailable``, or what the memory
    cgroup's limit leaves where that is less; else the machine's physical memory; None where nothing says."""
    found = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024, "available memory"
                    break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"
        except (ValueError, OSError, AttributeError):  # not a POSIX system that says
            pass
    room = cgroup_memory_room(proc_cgroup, root)
    if room is not None and (found is None or room < found[0]):
        return room, "memory left under its memory limit (cgroup)"
    return found
