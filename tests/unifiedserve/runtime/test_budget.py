"""The budget search: the largest budget whose measured iteration fits the SLO."""

import pytest

from unifiedserve.runtime.budget import largest_within


@pytest.mark.parametrize("per_token_s,limit_s", [(1e-4, 0.05), (2e-5, 0.05), (1e-3, 0.5), (3e-6, 0.02)])
def test_finds_the_largest_fitting_budget_to_within_one_step_of_the_bisection(per_token_s, limit_s):
    calls = []

    def measure(n):
        calls.append(n)
        return 0.001 + n * per_token_s

    n = largest_within(measure, limit_s, 16, 16384, step=16, probes=8)
    exact = min(16384, int((limit_s - 0.001) / per_token_s))
    assert n % 16 == 0 and measure(n) <= limit_s
    assert exact - n <= max(16, exact // 64)  # doubling + 8 bisections
    assert len(calls) < 25  # a short profile


def test_nothing_fits_gives_the_minimum():
    assert largest_within(lambda n: 1.0, 0.01, 64, 4096, step=64) == 64


def test_everything_fits_gives_the_maximum():
    assert largest_within(lambda n: 0.0, 0.01, 16, 1024, step=16) == 1024


def test_the_profile_builds_its_inputs_on_the_runners_device():
    """encode_seconds' patches are made where the runner's weights are (a CUDA runner got CPU patches)."""
    from types import SimpleNamespace

    import torch

    from unifiedserve.runtime.budget import encode_seconds

    seen = []
    model = SimpleNamespace(encode_vision=lambda patches, grids: seen.append((patches.device, patches.dtype, grids)))
    runner = SimpleNamespace(model=model, device=torch.device("meta"), dtype=torch.bfloat16,
                             patch_buffer=SimpleNamespace(dim=1176))
    encode_seconds(runner, 64)
    assert seen and all(d == torch.device("meta") and t == torch.bfloat16 for d, t, _ in seen)


def test_timing_on_cuda_waits_for_the_kernels(monkeypatch):
    """On CUDA a step's functions return once its kernels are launched: the timer waits for them before and
    after each run, else it measures launch time and derives budgets far over the SLO."""
    import torch

    from unifiedserve.runtime import budget

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    budget._time(lambda: events.append("run"), torch.device("cuda", 0), repeats=2)
    assert events == ["run", "sync", "run", "sync", "sync", "run", "sync"]
    events.clear()
    budget._time(lambda: events.append("run"), torch.device("cpu"), repeats=2)
    assert events == ["run"] * 3


def test_the_cached_profile_is_per_policy_and_core_sm_share(tmp_path):
    """A profile measured in unified's core (capped at 70 % of the SMs) is not served to monolithic's (uncapped),
    nor to another share; the same placement finds its own entry again."""
    from types import SimpleNamespace as NS

    from unifiedserve.runtime.budget import _cache_key

    (tmp_path / "model.safetensors").write_bytes(b"x")

    def cfg(policy, share):
        env = {} if share is None else {"core": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": share}}
        return NS(model=str(tmp_path), engine=NS(device="cpu", dtype="float32"), tbt_slo_ms=100, policy=policy,
                  process_env=env)

    keys = {_cache_key(cfg("unified", "70")), _cache_key(cfg("unified", "80")), _cache_key(cfg("monolithic", None)),
            _cache_key(cfg("split", "70"))}
    assert len(keys) == 4 and _cache_key(cfg("unified", "70")) == _cache_key(cfg("unified", "70"))
