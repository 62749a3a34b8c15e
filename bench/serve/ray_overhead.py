#!/usr/bin/env python3
"""What Ray Serve adds to one request: TTFT through ``serve --ray --replicas 1`` vs the plain server.

Same flags otherwise; each server gets, one at a time on an idle server, ``--text`` short text
requests and ``--videos`` first questions about videos it has never seen (no cache hits). Prints
the median TTFT of each kind on both, the difference and the ratio, and where the time went: the
API's own TTFT (its ``/metrics``, from the request's arrival in the API to its first token) and
its stage means, so ``client - API`` is what the HTTP path in front of the API costs (for Ray: the
Serve proxy, the ingress, the handle call and the chunk relay). The machine's load average is
printed with each run: on a shared machine, compare runs only at similar loads, or use
``--interleave`` (both servers up, requests alternating between them).

    python bench/serve/ray_overhead.py --text 20 --videos 4
    python bench/serve/ray_overhead.py --text 20 --videos 4 --interleave
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", HERE):
    sys.path.insert(0, str(extra))

import synthetic_video  # noqa: E402
from server_process import ServerProcess, histogram_totals, run_main  # noqa: E402


def ttft(url: str, messages: list[dict]) -> float:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="demo-model", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
    return first


STAGES = ("probe", "video_decode", "queue", "encode", "prefill")


def api_sums(server: ServerProcess) -> dict[str, float]:
    """Sums and counts of the API's TTFT and stage histograms, over every replica."""
    metrics, out = server.metrics(), {}
    for prefix, totals in (("", histogram_totals(metrics, "unifiedserve_time_to_first_token_seconds")),
                           ("{}.", histogram_totals(metrics, "unifiedserve_request_stage_seconds", "stage"))):
        for group, (total, count) in totals.items():
            out[prefix.format(group) + "sum"], out[prefix.format(group) + "count"] = total, count
    return out


def api_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean API TTFT and stage times (ms) of the requests served between two ``api_sums``."""
    def mean(prefix: str) -> float:
        n = after.get(prefix + "count", 0.0) - before.get(prefix + "count", 0.0)
        return (after.get(prefix + "sum", 0.0) - before.get(prefix + "sum", 0.0)) / n * 1e3 if n else float("nan")

    return {"ttft": mean(""), **{stage: mean(stage + ".") for stage in STAGES}}


MODES = {"plain": [], "ray": ["--ray", "--replicas", "1"]}
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process under ``root_pid`` (Linux /proc), by role.

    Roles: ``api`` (the plain server's process, or a replica's actor, which runs the same API),
    ``workers`` (their vision, core and decode processes), and for Ray each of its own processes
    (``ray::ProxyActor``, ``ray::ServeController``, the ingress, ``raylet``, ``gcs_server``, ...; the
    CLI process that started Ray is ``driver``). Ended processes drop out, so compare short windows.
    """
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        procs[int(entry)] = (int(fields[1]), comm, cmd, (int(fields[11]) + int(fields[12])) / TICKS_PER_S)
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        tree += [pid] if pid in procs else []
    # a replica's actor runs the API; without one (the plain server) the root process does
    apis = {pid for pid in tree if procs[pid][2].startswith("ray::ServeReplica") and "NodeReplica" in procs[pid][2]}
    apis = apis or {root_pid}
    out: dict[str, float] = {}
    for pid in tree:
        ppid, comm, cmd, cpu_s = procs[pid]
        if pid in apis:
            role = "api"
        elif ppid in apis:
            role = "workers"
        elif cmd.startswith("ray::"):
            role = cmd.split()[0].split(".")[0]
        elif comm in ("raylet", "gcs_server"):
            role = comm
        else:
            role = "driver" if pid == root_pid else "other"
        out[role] = out.get(role, 0.0) + cpu_s
    return out


def text_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Say something about {i}."}]


def video_messages(clip: Path) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{clip}"}},
                                         {"type": "text", "text": "What happens?"}]}]


def measure(servers: dict[str, ServerProcess], clips: dict[str, list[Path]], num_text: int, idle_s: float) -> dict:
    """TTFTs (s) and API sums of each server; with several servers the requests alternate between them
    (who goes first alternates too), so a change of the machine's load falls on both alike."""
    for server in servers.values():
        ttft(server.url, text_messages(-1))  # warm-up
    load_before = os.getloadavg()[0]
    modes = list(servers)
    text = {m: [] for m in modes}
    video = {m: [] for m in modes}
    s0 = {m: api_sums(servers[m]) for m in modes}
    for i in range(num_text):
        for m in modes[i % 2:] + modes[:i % 2]:
            text[m].append(ttft(servers[m].url, text_messages(i)))
    s1 = {m: api_sums(servers[m]) for m in modes}
    cpu_ms = {m: {} for m in modes}  # CPU time of each process role during the video requests, summed
    for i in range(len(clips[modes[0]])):
        for m in modes[i % 2:] + modes[:i % 2]:
            before = process_cpu_s(servers[m].proc.pid)
            video[m].append(ttft(servers[m].url, video_messages(clips[m][i])))
            for role, cpu_s in process_cpu_s(servers[m].proc.pid).items():
                cpu_ms[m][role] = cpu_ms[m].get(role, 0.0) + (cpu_s - before.get(role, 0.0)) * 1e3
    s2 = {m: api_sums(servers[m]) for m in modes}
    load = (load_before, os.getloadavg()[0])
    # what each server's processes burn while no request runs (Ray's daemons and loops; the plain
    # server's idle polling), in ms of CPU a second
    before = {m: process_cpu_s(servers[m].proc.pid) for m in modes}
    time.sleep(idle_s)
    idle = {m: {role: (cpu_s - before[m].get(role, 0.0)) * 1e3 / idle_s
                for role, cpu_s in process_cpu_s(servers[m].proc.pid).items()} if idle_s > 0 else {} for m in modes}
    return {m: {"text": text[m], "video": video[m], "sums": (s0[m], s1[m], s2[m]), "load": load,
                "video_cpu_ms": {role: ms / len(video[m]) for role, ms in cpu_ms[m].items()},
                "idle_cpu_ms_per_s": idle[m]} for m in modes}


def _count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=_count, default=20, help="text requests per server (default 20)")
    p.add_argument("--videos", type=_count, default=4, help="first questions about new videos per server (default 4)")
    p.add_argument("--interleave", action="store_true",
                   help="run both servers at once and alternate the requests between them (one at a time), "
                        "instead of one server after the other: on a shared machine whose load changes, each "
                        "pair of requests sees the same load; the idle Ray instance's own processes then run "
                        "beside the plain server too")
    p.add_argument("--idle-s", type=_seconds, default=10.0,
                   help="after the requests, measure each server's CPU use while idle for this long "
                        "(default 10; 0: skip)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ray_overhead")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    media = a.out / "media"
    media.mkdir(exist_ok=True)
    clips = [synthetic_video.make_video(media / f"clip{i}.mp4", codec="h264", width=480, height=270, duration_s=8.0,
                                       fps=24.0, gop=48, seed=100 + i) for i in range(2 * a.videos)]
    batches = {"plain": clips[:a.videos], "ray": clips[a.videos:]}
    groups = [list(MODES)] if a.interleave else [[m] for m in MODES]
    runs = {}
    for group in groups:
        servers = {}
        try:
            for m in group:
                servers[m] = ServerProcess(["--allowed-local-media-path", str(media), *MODES[m]],
                                           a.out / f"server-{m}.log")
            runs.update(measure(servers, {m: batches[m] for m in group}, a.text, a.idle_s))
        finally:
            for server in servers.values():
                server.stop()
    results = {m: {"text": statistics.median(r["text"]), "video": statistics.median(r["video"])}
               for m, r in runs.items()}
    breakdown = {m: {"text": {"client_mean": statistics.mean(r["text"]) * 1e3, **api_means_ms(*r["sums"][:2])},
                     "video": {"client_mean": statistics.mean(r["video"]) * 1e3, **api_means_ms(*r["sums"][1:])}}
                 for m, r in runs.items()}
    loads = {m: r["load"] for m, r in runs.items()}
    for kind in ("text", "video"):
        plain, ray = results["plain"][kind], results["ray"][kind]
        print(f"{kind:>6}: plain {plain * 1e3:8.1f} ms   ray {ray * 1e3:8.1f} ms   "
              f"{(ray - plain) * 1e3:+.1f} ms ({ray / plain:.2f}x)   median TTFT")
    print("means (ms): client TTFT | the API's TTFT | client - API | API stages " + " / ".join(STAGES))
    for kind in ("text", "video"):
        for mode in ("plain", "ray"):
            b = breakdown[mode][kind]
            print(f"{kind:>6} {mode:>5}: {b['client_mean']:8.1f} | {b['ttft']:8.1f} | "
                  f"{b['client_mean'] - b['ttft']:6.1f} | " + " / ".join(f"{b[stage]:.1f}" for stage in STAGES))
    print("CPU ms per new-video request (from sending it to its last token), by process:")
    for m, r in runs.items():
        cpu = r["video_cpu_ms"]
        ray_own = {role: ms for role, ms in cpu.items() if role not in ("api", "workers")}
        print(f"{m:>12}: api {cpu.get('api', 0.0):.0f} | workers {cpu.get('workers', 0.0):.0f} | the rest "
              f"{sum(ray_own.values()):.0f}" + "".join(f" | {role} {ms:.0f}" for role, ms in
                                                   sorted(ray_own.items(), key=lambda kv: -kv[1]) if ms >= 1))
    if a.idle_s > 0:
        print(f"idle CPU, ms a second over {a.idle_s:g} s after the requests, by process:")
        for m, r in runs.items():
            idle = r["idle_cpu_ms_per_s"]
            print(f"{m:>12}: total {sum(idle.values()):.1f}" + "".join(
                f" | {role} {ms:.1f}" for role, ms in sorted(idle.items(), key=lambda kv: -kv[1]) if ms >= 0.5))
    print(("interleaved; " if a.interleave else "one server after the other; ")
          + "load average (1 min) before/after the timed requests: "
          + ", ".join(f"{mode} {lo:.2f}/{hi:.2f}" for mode, (lo, hi) in loads.items()))
    (a.out / "ray_overhead.json").write_text(json.dumps(
        {"median_ttft_s": results, "means_ms": breakdown, "load_average": loads, "text": a.text, "videos": a.videos,
         "interleave": a.interleave, "video_cpu_ms": {m: r["video_cpu_ms"] for m, r in runs.items()},
         "idle_cpu_ms_per_s": {m: r["idle_cpu_ms_per_s"] for m, r in runs.items()},
         "ttft_s": {m: {"text": r["text"], "video": r["video"]} for m, r in runs.items()}},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "ray_overhead.py"))
