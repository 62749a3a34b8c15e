"""bench/policies: the comparison rate, unified's ratios, capacity and SLO scaling, on known records."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "policies"))

import bench_policies as bp  # noqa: E402
from serve_metrics import RequestRecord, compute_metrics  # noqa: E402

SLO = {"ttft": 1000.0, "tbt": 100.0}


def run(rate: float, ttft_s: float, gap_s: float, n: int = 4, failed: int = 0) -> dict:
    """``n`` requests with the given TTFT and a constant gap between their 5 tokens."""
    recs = []
    for i in range(n):
        t0 = float(i)
        times = [t0 + ttft_s + k * gap_s for k in range(5)]
        ok = i >= failed
        recs.append(RequestRecord(f"r{i}", t0, start_s=t0, end_s=times[-1], token_times_s=times if ok else [],
                                  completion_tokens=5 if ok else 0, is_success=ok, error=None if ok else "HTTP 500"))
    return {"rate": rate, "metrics": compute_metrics(recs, 10.0, goodput=SLO), "records": [r.to_dict() for r in recs]}


@pytest.fixture
def results():
    return {
        # unified: fast first token, smooth decode
        "unified": [run(0.5, 0.5, 0.02), run(1.0, 0.8, 0.03)],
        # monolithic: fast first token, decode stalls (200 ms gaps) at the higher rate
        "monolithic": [run(0.5, 0.4, 0.05), run(1.0, 0.6, 0.2)],
        # split: slow first token at the higher rate, smooth decode
        "split": [run(0.5, 0.9, 0.01), run(1.0, 2.0, 0.01)],
    }


def test_ratios_at_the_comparison_rate(results):
    assert bp.comparison_rate(results, [0.5, 1.0]) == 1.0
    r = bp.ratios(bp._at(results, 1.0))
    assert r["tbt_p99_vs_monolithic"] == pytest.approx(0.03 / 0.2)
    assert r["ttft_mean_vs_split"] == pytest.approx(0.8 / 2.0)
    # at 1.0 req/s unified meets the SLO 4/4, monolithic (TBT) and split (TTFT) 0/4: no baseline goodput
    assert r["goodput_vs_best_baseline"] == float("inf")
    r = bp.ratios(bp._at(results, 0.5))
    assert r["goodput_vs_best_baseline"] == pytest.approx(1.0)  # everyone meets it at 0.5 req/s


def test_comparison_rate_skips_rates_where_monolithic_lost_requests(results):
    results["monolithic"][1] = run(1.0, 0.6, 0.2, failed=1)
    assert bp.comparison_rate(results, [0.5, 1.0]) == 0.5


def test_the_summary_says_why_its_comparison_rate_was_chosen(results):
    assert "(the highest rate at which monolithic completed every request)" in bp.summarize(results, 1.0, SLO)
    alone = {"unified": results["unified"]}  # a first GPU call runs one policy
    rate = bp.comparison_rate(alone, [0.5, 1.0])
    assert rate == 0.5 and "(monolithic did not run here: the lowest rate)" in bp.summarize(alone, rate, SLO)
    results["monolithic"] = [dict(r, metrics=dict(r["metrics"], failed=1)) for r in results["monolithic"]]
    assert bp.comparison_reason(results, 0.5) == "monolithic completed every request at no rate: the lowest rate"


def test_capacity_and_slo_scaling(results):
    assert bp.capacity(results["unified"]) == 1.0
    assert bp.capacity(results["monolithic"]) == 0.5
    assert bp.capacity(results["split"]) == 0.5
    split_hi = results["split"][1]
    assert bp.attainment(split_hi, SLO) == 0.0
    assert bp.attainment(split_hi, SLO, scale=2.0) == 1.0  # TTFT 2 s meets a 2 s SLO


def test_a_policy_with_no_rate_in_slo_is_below_its_lowest_rate_not_at_zero(results):
    """The H200's first unified run met the SLO for 75 % and 14 % of requests: "unified 0 req/s" read as a
    measured capacity of zero."""
    for r in results["unified"]:
        r["metrics"]["goodput"]["attainment"] = 0.5
    text = bp.summarize(results, 1.0, SLO)
    assert "unified below 0.5 req/s (no measured rate met it)" in text and "monolithic 0.5 req/s" in text
    results["split"] = []  # every rate skipped for time (a partial results.json that --merge may read)
    assert "split not measured" in bp.summarize(results, 1.0, SLO)


def test_summary_names_targets_and_every_rate(results):
    text = bp.summarize(results, 1.0, SLO)
    assert "Comparison rate: **1 req/s**" in text
    assert "unified p99 TBT / monolithic p99 TBT = **0.15** (target <= 0.5: met)" in text
    assert "unified mean TTFT / split mean TTFT = **0.40** (target <= 0.7: met)" in text
    assert "| 0.5 | " in text and "| 1 | " in text
    assert "unified 1 req/s, monolithic 0.5 req/s, split 0.5 req/s" in text


def test_plots_are_written(results, tmp_path):
    pytest.importorskip("matplotlib")
    files = bp.plot(results, 1.0, SLO, tmp_path)
    assert [f.name for f in files] == ["policies.png", "timeline.png"]
    assert all(f.stat().st_size > 10_000 for f in files)


def test_gpu_runs_are_held_to_the_gpu_tbt_target(results):
    assert bp.on_gpu("--device cuda --model /tmp/m") and bp.on_gpu("--kv-cache-gb 4 --device cuda:1")
    assert bp.on_gpu("--device=cuda") and not bp.on_gpu("--device cpu") and not bp.on_gpu("")
    results["unified"][1] = run(1.0, 0.8, 0.06)  # p99 TBT 0.3x monolithic's: meets the CPU target only
    assert "= **0.30** (target <= 0.5: met)" in bp.summarize(results, 1.0, SLO)
    assert "= **0.30** (target <= 0.2: missed)" in bp.summarize(results, 1.0, SLO, gpu=True)


def write_run(folder: pathlib.Path, results: dict, **args) -> pathlib.Path:
    import json

    base = {"workload": "long-video", "num_requests": 4, "scale": 1.0, "video_seconds": [60, 300], "num_videos": 4,
            "output_len": 5, "burstiness": 1.0, "seed": 0, "goodput": ["ttft:1000", "tbt:100"], "rates": "0.5,1",
            "server_args": "--device cuda"}
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"machine": {}, "args": base | args, "results": results}))
    return folder


def test_merge_of_one_policy_runs_is_the_three_policy_table(results, tmp_path, capsys):
    runs = [write_run(tmp_path / p, {p: results[p]}) for p in bp.POLICIES]
    assert bp.main(["--merge", *map(str, runs), "--out", str(tmp_path / "merged")]) == 0
    text = (tmp_path / "merged" / "summary.md").read_text()
    assert text == bp.summarize(results, 1.0, SLO, gpu=True)
    assert "(target <= 0.2: met)" in text and "Comparison rate: **1 req/s**" in text


def test_merge_joins_runs_of_one_policy_at_other_rates(results, tmp_path):
    runs = [write_run(tmp_path / p, {p: results[p]}) for p in ("monolithic", "split")]
    runs += [write_run(tmp_path / "u-low", {"unified": results["unified"][:1]}, rates="0.5"),
             write_run(tmp_path / "u-high", {"unified": results["unified"][1:]}, rates="1")]
    assert bp.main(["--merge", *map(str, runs), "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "summary.md").read_text() == bp.summarize(results, 1.0, SLO, gpu=True)


@pytest.mark.parametrize("second, needle", [
    ({"split": None, "args": {"seed": 1}}, "was run with other seed"),
    ({"unified": None, "args": {}}, "policy unified at 0.5, 1 req/s is in more than one run"),
])
def test_merge_refuses_runs_that_do_not_compare(results, tmp_path, capsys, second, needle):
    first = write_run(tmp_path / "a", {"unified": results["unified"]})
    policy = next(k for k in second if k != "args")
    other = write_run(tmp_path / "b", {policy: results[policy]}, **second["args"])
    with pytest.raises(SystemExit):
        bp.main(["--merge", str(first), str(other), "--out", str(tmp_path / "m")])
    assert needle in capsys.readouterr().err


def test_merge_of_a_missing_run_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bp.main(["--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "m")])
    assert "cannot read" in capsys.readouterr().err


def fake_bench(monkeypatch, run_benchmark, warm_ups):
    """bench_policies with a fake server, the given client and warm-up records, and a 4-request text workload."""
    import contextlib

    @contextlib.contextmanager
    def fake_server(args, log):
        yield type("S", (), {"url": "http://fake"})()

    async def warm_up(url, base, num):
        assert num == len(warm_ups)  # --warmups
        return warm_ups

    monkeypatch.setattr(bp, "ServerProcess", fake_server)
    monkeypatch.setattr(bp, "run_benchmark", run_benchmark)
    monkeypatch.setattr(bp, "warm_up", warm_up)
    monkeypatch.setattr(bp.workload_synthetic, "generate_workload", lambda cfg, progress=False: [
        {"id": f"q{i}", "media": [], "prompt": "hi", "output_len": 5} for i in range(4)])
    # evenly spaced arrivals, the last one at len(base) / rate
    monkeypatch.setattr(bp.workload_config, "with_arrivals",
                        lambda base, rate, **kw: [{**r, "arrival_s": (i + 1) / rate} for i, r in enumerate(base)])


def alone(ttft_s: float, e2e_s: float, rid: str = "w") -> RequestRecord:
    """A warm-up request served alone."""
    return RequestRecord(rid, 0.0, start_s=0.0, end_s=e2e_s, token_times_s=[ttft_s, e2e_s], is_success=True)


def test_time_budget_skips_rates_and_results_survive_each_rate(tmp_path, monkeypatch, capsys):
    """With a fake server and client: a rate whose predicted run outlasts --time-budget-s is skipped (its arrivals
    and drain, or, past what one request served alone says the server keeps up with, its requests' first tokens
    one after another), each rate's client gets the budget left as its deadline, and results.json holds every
    finished rate as soon as it finishes."""
    import json

    seen, deadlines = [], []

    async def fake_run(url, reqs, max_concurrency=None, progress=False, deadline_s=None):
        partial = tmp_path / "out" / "results.json"
        seen.append(json.loads(partial.read_text())["results"]["unified"] if partial.exists() else None)
        deadlines.append(deadline_s)
        return bp.records_of(run(0.5, 0.5, 0.02)), 10.0

    fake_bench(monkeypatch, fake_run, [alone(8.0, 9.0, "cold"), alone(2.0, 3.0)])
    # 4 requests, one alone takes 2 s to its first token and 1 s more (the last warm-up; the first, cold, is not
    # used): 8 s of arrivals at 0.5 req/s (9.3 s with the drain; 9 s of first tokens); 400 s at 0.01 req/s (over
    # the 52-s budget); 40 s at 0.1 req/s, which fit with DRAIN_S but not with the drain's share too (40 + 40/6 +
    # 10 s); at 2 req/s 2 s of arrivals, but the first tokens one after another take 4 x 2 + 1 s: about 19 s
    argv = ["--policies", "unified", "--rates", "0.5,0.01,0.1,2", "--num-requests", "4", "--time-budget-s", "52",
            "--warmups", "2", "--goodput", "ttft:1000", "tbt:100", "--out", str(tmp_path / "out")]
    assert bp.main(argv) == 0
    out = capsys.readouterr().out
    assert "unified: one request alone: TTFT 2.00 s, 3.00 s in all" in out
    assert "unified @ 0.01 req/s: skipped: its arrivals and their drain take about 477 s" in out
    assert "unified @ 0.1 req/s: skipped: its arrivals and their drain take about 57 s" in out
    assert "unified @ 2.0 req/s: offered load 4.00 (rate x one request's TTFT alone), about 19 s" in out
    assert seen[0] is None and [r["rate"] for r in seen[1]] == [0.5]  # rate 0.5 was on disk before rate 2 ran
    assert len(deadlines) == 2 and all(0 < d <= 52 - bp.REPORT_S for d in deadlines)
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "partial" not in data and [r["rate"] for r in data["results"]["unified"]] == [0.5, 2.0]
    argv[argv.index("52")] = "1"
    assert bp.main(argv) == 1
    assert "no rate fits --time-budget-s" in capsys.readouterr().err


def test_predicted_length_of_a_rate_follows_its_schedule():
    """A rate's predicted length runs to its seeded schedule's last arrival (not num_requests / rate), a sixth more
    and DRAIN_S, or the first tokens one after another past what one request alone says the server keeps up
    with: the H200 runs of 2026-11-28 (64 requests, TTFT alone 1.57 s, 2.69 s in all) took 139 s at 0.45 req/s
    (last arrival 127.2 s) and 108 s at 1.2 req/s (last arrival 47.7 s)."""
    one = alone(1.57, 2.69)
    assert bp.predicted_s(127.2, 64, one) == pytest.approx(127.2 * 7 / 6 + bp.DRAIN_S)
    assert 139 <= bp.predicted_s(127.2, 64, one) <= 139 * 1.2
    assert bp.predicted_s(47.7, 64, one) == pytest.approx(64 * 1.57 + 1.12 + bp.DRAIN_S)
    assert 108 <= bp.predicted_s(47.7, 64, one) <= 108 * 1.2
    assert bp.predicted_s(47.7, 64, None) == pytest.approx(47.7 * 7 / 6 + bp.DRAIN_S)  # no warm-up to go by


def test_policies_of_one_budgeted_run_share_the_budget(tmp_path, monkeypatch, capsys):
    """Several policies under one --time-budget-s: each gets an even share of what is left when its server starts,
    so the first cannot spend the later ones' time, and a later one also gets what an earlier one left unused."""
    import json

    async def fake_run(url, reqs, max_concurrency=None, progress=False, deadline_s=None):
        return bp.records_of(run(0.5, 0.5, 0.02)), 10.0

    fake_bench(monkeypatch, fake_run, [alone(2.0, 3.0)])
    # 4 requests: 0.5 req/s takes about 19 s (the first tokens one after another, 4 x 2 + 1 s, and 10 s), 0.2 req/s
    # about 33 s (20 s of arrivals, a sixth more, 10 s): within the 60-s budget, not within unified's half of it
    argv = ["--policies", "unified,monolithic", "--rates", "0.5,0.2", "--num-requests", "4", "--time-budget-s", "60",
            "--goodput", "ttft:1000", "tbt:100", "--out", str(tmp_path / "out")]
    assert bp.main(argv) == 0
    out = capsys.readouterr().out
    assert "unified @ 0.5 req/s: offered load" in out
    assert "unified @ 0.2 req/s: skipped: its arrivals and their drain take about 33 s" in out
    assert "(its share: 1/2 of what was left)" in out
    assert "monolithic @ 0.2 req/s: offered load" in out  # the last policy: all that is left
    data = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert [r["rate"] for r in data["unified"]] == [0.5] and [r["rate"] for r in data["monolithic"]] == [0.5, 0.2]


def test_a_rate_cut_at_the_budget_is_kept_marked_and_ends_the_sweep(tmp_path, monkeypatch, capsys):
    """A rate still running when the budget ends comes back cut (its unfinished requests failed): it is saved and
    shown as cut, and no later rate starts."""
    import json

    calls = []

    async def cut_run(url, reqs, max_concurrency=None, progress=False, deadline_s=None):
        calls.append(deadline_s)
        recs = bp.records_of(run(0.5, 0.5, 0.02))
        recs[-1].is_success, recs[-1].error = False, bp.CUT_ERROR
        return recs, 10.0

    fake_bench(monkeypatch, cut_run, [alone(0.1, 0.2)])
    argv = ["--policies", "unified", "--rates", "1,2", "--num-requests", "4", "--time-budget-s", "300",
            "--goodput", "ttft:1000", "tbt:100", "--out", str(tmp_path / "out")]
    assert bp.main(argv) == 0
    out = capsys.readouterr().out
    assert "unified @ 1.0 req/s: 3/4 done in" in out and "(cut: 1 unfinished at the time budget)" in out
    assert len(calls) == 1  # rate 2 never started
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["rate"], r.get("cut")) for r in data["results"]["unified"]] == [(1.0, 1)]
    assert "| unified | 3/4 (cut) |" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.parametrize("argv, needle", [
    (["--max-frames", "1"], "--max-frames must be at least 2"),
    (["--warmups", "0"], "--warmups must be at least 1"),
])
def test_bad_sizes_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bp.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--scale", "2"], "scale must be in (0, 1]"),
    (["--rates", "0.5,x"], "could not convert string to float"),
    (["--rates", "0,1"], "--rates must be positive request rates"),
    (["--goodput", "foo"], "--goodput takes ttft:MS"),
])
def test_bad_flags_are_one_error_line_before_any_media_or_server(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as err:
        bp.main([*argv, "--out", str(tmp_path / "out")])
    assert err.value.code == 2 and needle in capsys.readouterr().err and not (tmp_path / "out").exists()
