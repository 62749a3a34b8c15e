"""The memory a new allocation can have: MemAvailable, bounded by the memory cgroup's limit (v1, v2, nested
limits, a container without a cgroup namespace), on fake /proc and /sys trees."""

from __future__ import annotations

import os

from flashcodec._sysmem import available_memory, cgroup_memory_room

GiB = 2**30


def write(path, text) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def v2_group(root, path, limit, current, inactive_file=0, active_file=0):
    folder = os.path.join(root, path.lstrip("/"))
    write(os.path.join(folder, "memory.max"), f"{limit}\n")
    write(os.path.join(folder, "memory.current"), f"{current}\n")
    write(os.path.join(folder, "memory.stat"), f"anon 1\nshmem 9\ninactive_file {inactive_file}\n"
                                               f"active_file {active_file}\n")


def v1_group(root, path, limit, usage, total_inactive_file=0, total_active_file=0):
    folder = os.path.join(root, "memory", path.lstrip("/"))
    write(os.path.join(folder, "memory.limit_in_bytes"), f"{limit}\n")
    write(os.path.join(folder, "memory.usage_in_bytes"), f"{usage}\n")
    write(os.path.join(folder, "memory.stat"), f"inactive_file 7\nactive_file 3\n"
                                               f"total_inactive_file {total_inactive_file}\n"
                                               f"total_active_file {total_active_file}\n")


def test_v2_limit_less_usage_plus_the_file_cache(tmp_path):
    """Both file lists are reclaimable (a video read twice, probe then decode, lands on the active one), as
    MemAvailable counts them; tmpfs pages (the server's pools) are on the anonymous lists and stay counted."""
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/kubepods/pod1/ctr\n")
    v2_group(root, "/kubepods/pod1/ctr", 8 * GiB, 5 * GiB, inactive_file=1 * GiB, active_file=1 * GiB)
    assert cgroup_memory_room(proc, root) == 5 * GiB  # 8 - (5 - 1 - 1)


def test_the_tightest_ancestor_wins(tmp_path):
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/kubepods/pod1/ctr\n")
    v2_group(root, "/kubepods/pod1/ctr", "max", 1 * GiB)  # the container: no limit of its own
    v2_group(root, "/kubepods/pod1", 4 * GiB, 3 * GiB)  # the pod's: 1 GiB left
    v2_group(root, "/kubepods", 64 * GiB, 10 * GiB)
    assert cgroup_memory_room(proc, root) == 1 * GiB


def test_no_limit_anywhere_is_none(tmp_path):
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/user.slice\n")
    v2_group(root, "/user.slice", "max", 5 * GiB)
    assert cgroup_memory_room(proc, root) is None
    assert cgroup_memory_room(str(tmp_path / "missing"), root) is None  # no /proc/self/cgroup


def test_v1_with_an_unlimited_sentinel_and_hybrid_mounts(tmp_path):
    root = str(tmp_path / "sys")
    # hybrid: systemd's unified line as well as the v1 memory controller, which is the one that charges
    proc = write(tmp_path / "cgroup", "9:name=systemd:/\n4:cpu,memory:/docker/abc\n0::/\n")
    v1_group(root, "/docker/abc", 2 * GiB, GiB + GiB // 2, total_inactive_file=GiB // 4, total_active_file=GiB // 4)
    v1_group(root, "/docker", 9223372036854771712, 40 * GiB)  # 2^63 rounded to a page: no limit
    v1_group(root, "/", 9223372036854771712, 50 * GiB)
    assert cgroup_memory_room(proc, root) == GiB  # 2 - (1.5 - 0.5)


def test_a_container_without_a_cgroup_namespace_reads_its_mount_root(tmp_path):
    """/proc/self/cgroup names the host's path, which does not exist under the container's mount: the mount's
    root is the container's own cgroup."""
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/system.slice/docker-abc.scope\n")
    v2_group(root, "/", 3 * GiB, 2 * GiB)
    assert cgroup_memory_room(proc, root) == 1 * GiB


def test_a_cgroup_name_that_is_not_utf8_is_read(tmp_path):
    """A cgroup's name is bytes: one that is not UTF-8 made the reader raise (every decode and the server's start
    would have failed)."""
    root = str(tmp_path / "sys")
    proc = tmp_path / "cgroup"
    proc.write_bytes(b"0::/caf\xe9\n")
    assert cgroup_memory_room(str(proc), root) is None  # no such folder under the fake mount: no limit found
    folder = os.path.join(root.encode(), b"caf\xe9")
    os.makedirs(folder)
    for name, value in ((b"memory.max", b"4096\n"), (b"memory.current", b"1024\n"), (b"memory.stat", b"x 1\n")):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(value)
    assert cgroup_memory_room(str(proc), root) == 3072


def test_usage_over_the_limit_leaves_nothing(tmp_path):
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/a\n")
    v2_group(root, "/a", GiB, 2 * GiB)
    assert cgroup_memory_room(proc, root) == 0


def test_available_memory_is_the_lesser_of_meminfo_and_the_cgroup(tmp_path, monkeypatch):
    root = str(tmp_path / "sys")
    proc = write(tmp_path / "cgroup", "0::/a\n")
    meminfo = write(tmp_path / "meminfo", "MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")  # 16 GiB
    assert available_memory(meminfo, proc, root) == (16 * GiB, "available memory")  # no limit
    v2_group(root, "/a", 4 * GiB, 1 * GiB)
    assert available_memory(meminfo, proc, root) == (3 * GiB, "memory left under its memory limit (cgroup)")
    v2_group(root, "/a", 64 * GiB, 1 * GiB)  # a limit above what the host has free: the host's
    assert available_memory(meminfo, proc, root) == (16 * GiB, "available memory")
    # no /proc/meminfo: the physical memory
    monkeypatch.setattr(os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**22}.__getitem__)
    assert available_memory(str(tmp_path / "none"), str(tmp_path / "none"), root) == (16 * GiB, "memory")


def test_this_machine(tmp_path):
    """The real files: a positive figure no larger than the physical memory."""
    free, what = available_memory()
    assert 0 <= free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and what
