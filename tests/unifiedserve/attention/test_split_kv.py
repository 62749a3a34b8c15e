"""split_kv.tune: which decode graphs read the keys without splitting them, per batch size and length (CPU, with
flashinfer's stand-in and injected timings), and the real kernels on CUDA."""

from __future__ import annotations

import pytest
import torch

from attention_cases import dense_reference, make_step
from flashinfer_fakes import fi
from unifiedserve.attention import flashinfer_backend as fib
from unifiedserve.attention import split_kv


def _timer(table, calls, outputs=None):
    """A timer that plans and runs layer 0 like the device timer (so the batches it is given must be valid), and
    reports ``table[(variant, batch, length)]`` microseconds."""

    def run(attn, seqs, size, variant, num_layers):
        assert len(seqs) == size and num_layers == 2
        length = seqs[0][0] + seqs[0][1]
        assert all(cached + new == length and new == 1 for cached, new, _ in seqs)
        blocks = [b for _, _, table_ in seqs for b in table_]
        assert len(set(blocks)) == len(blocks)  # every sequence on blocks of its own
        calls.append((variant, size, length))
        attn.plan(seqs, graph_batch_size=size, graph_variant=variant)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn((size, h, 64), generator=gen).bfloat16() for h in (4, 2, 2))
        out = attn.forward(0, q, k, v)
        if outputs is not None and variant == fib.WHOLE_KV:
            out = outputs(out, length)
        return table[(variant, size, length)], out

    return run


def test_tune_keeps_split_free_graphs_while_they_win(fake_flashinfer):
    """Batch 1 wins up to 256 tokens (the next length loses and ends its ladder), batch 2 never wins by the margin;
    lengths past max_seq_len or the cache's blocks are not timed; the backend's limits follow."""
    attn = fi(blocks=64)  # 64 blocks of 4 tokens
    attn.init_cuda_graph([1, 2], max_seq_len=256)
    split = {64: 10.0, 128: 10.0, 256: 11.0, 512: 12.0}
    table = {}
    for length, us in split.items():
        table[(fib.SPLIT_KV, 1, length)] = us
        table[(fib.WHOLE_KV, 1, length)] = us * 0.5
        table[(fib.SPLIT_KV, 2, length)] = us
        table[(fib.WHOLE_KV, 2, length)] = us * 0.99  # faster, but not by 2 %
    calls = []
    choices = split_kv.tune(attn, 2, lengths=(64, 128, 256, 512), timer=_timer(table, calls))
    assert [c.batch_size for c in choices] == [1, 2]
    one, two = choices
    assert one.lengths == [64, 128, 256] and one.whole_kv_max == 256  # 512 > max_seq_len: not timed
    assert one.split_us == [10.0, 10.0, 11.0] and one.whole_us == [5.0, 5.0, 5.5]
    assert two.lengths == [64] and two.whole_kv_max == 0 and two.note == ""
    assert attn.whole_kv_limits() == {1: 256, 2: 0}
    assert attn.graph_variants(1) == (fib.SPLIT_KV, fib.WHOLE_KV) and attn.graph_variants(2) == (fib.SPLIT_KV,)
    assert calls[:2] == [(fib.SPLIT_KV, 1, 64), (fib.WHOLE_KV, 1, 64)]
    assert split_kv.summary(choices) == "batch 1: split-free up to 256 tokens; batch 2: split-KV"
    assert split_kv.tune_seconds() > 0
    # the cache's blocks bound the lengths too: 2 sequences of 256 tokens need 128 blocks of the 64
    attn = fi(blocks=64)
    attn.init_cuda_graph([2], max_seq_len=1024)
    table.update({(v, 2, n): 1.0 if v == fib.WHOLE_KV else 2.0 for v in (fib.SPLIT_KV, fib.WHOLE_KV)
                  for n in (64, 128, 256)})
    (two,) = split_kv.tune(attn, 2, lengths=(64, 128, 256), timer=_timer(table, []))
    assert two.lengths == [64, 128] and two.whole_kv_max == 128


def test_tune_never_keeps_a_split_free_graph_that_disagrees(fake_flashinfer):
    attn = fi(blocks=64)
    attn.init_cuda_graph([1], max_seq_len=512)
    table = {(v, 1, n): (1.0 if v == fib.WHOLE_KV else 5.0) for v in (fib.SPLIT_KV, fib.WHOLE_KV)
             for n in (64, 128)}
    wrong = _timer(table, [], outputs=lambda out, length: out + 1.0 if length == 128 else out)
    (choice,) = split_kv.tune(attn, 2, lengths=(64, 128), timer=wrong)
    assert choice.whole_kv_max == 0 and choice.lengths == [64, 128]
    assert "at 128 tokens the split-free output differs from the split-KV output by" in choice.note
    assert attn.graph_variants(1) == (fib.SPLIT_KV,)
    assert choice.as_dict()["note"] == choice.note


def test_the_knob_keeps_every_graph_split(fake_flashinfer, monkeypatch):
    attn = fi(blocks=16)
    attn.init_cuda_graph([1], max_seq_len=64)
    attn.set_whole_kv_limits({1: 64})
    monkeypatch.setenv("UNIFIEDSERVE_SPLIT_FREE_DECODE", "0")
    calls = []
    assert split_kv.tune(attn, 2, lengths=(64,), timer=_timer({}, calls)) == [] and calls == []
    assert attn.whole_kv_limits() == {1: 0}


def test_every_length_runs_on_random_keys_in_the_pools_last_blocks(fake_flashinfer):
    """The tune writes random K/V into the blocks it times, at every length, so that the outputs it compares are not
    equal by accident (an all-zero cache gives every query the same average of nothing) nor NaN from the pool's
    undefined memory; it times on the pool's last blocks, the least likely to be in use by another process."""
    attn = fi(blocks=16)
    attn.init_cuda_graph([1], max_seq_len=64)
    attn.kv_cache.tensor.fill_(float("nan"))
    calls, blocks = [], []
    timer = _timer({(v, 1, n): 1.0 if v == fib.SPLIT_KV else 0.5 for v in (fib.SPLIT_KV, fib.WHOLE_KV)
                    for n in (8, 32)}, calls)
    split_kv.tune(attn, 2, lengths=(8, 32), timer=lambda a, seqs, *rest: blocks.append(seqs[0][2]) or timer(
        a, seqs, *rest))
    assert blocks == [[14, 15]] * 2 + [list(range(8, 16))] * 2  # 4 tokens a block
    assert [c[2] for c in calls] == [8, 8, 32, 32] and attn.whole_kv_limits() == {1: 32}
    assert attn.kv_cache.tensor[:, :, 8:].float().std() > 0.5 and attn.kv_cache.tensor[:, :, :8].isnan().all()


def test_a_split_free_graph_that_cannot_run_keeps_the_size_split_and_a_fault_stops(fake_flashinfer):
    """A split-free graph that flashinfer or the capture refuses leaves that batch size split, with the reason; a
    fault of the GPU (which no later call survives) stops the tune with the way out."""
    attn = fi(blocks=16)
    attn.init_cuda_graph([1, 2], max_seq_len=64)
    table = {(v, b, 8): 1.0 for v in (fib.SPLIT_KV, fib.WHOLE_KV) for b in (1, 2)}
    table[(fib.WHOLE_KV, 2, 8)] = 0.5
    timer = _timer(table, [])

    def refusing(attn_, seqs, size, variant, layers):
        if variant == fib.WHOLE_KV and size == 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return timer(attn_, seqs, size, variant, layers)

    choices = split_kv.tune(attn, 2, lengths=(8,), timer=refusing)
    assert [c.whole_kv_max for c in choices] == [0, 8] and attn.whole_kv_limits() == {1: 0, 2: 8}
    assert choices[0].note == ("at 8 tokens the split-free graph cannot run: CUDA error: operation not permitted "
                               "when stream is capturing")

    def faulting(attn_, seqs, size, variant, layers):
        if variant == fib.WHOLE_KV:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return timer(attn_, seqs, size, variant, layers)

    with pytest.raises(RuntimeError, match="faulted the GPU .* UNIFIEDSERVE_SPLIT_FREE_DECODE=0"):
        split_kv.tune(attn, 2, lengths=(8,), timer=faulting)


def test_a_refusal_without_a_message_is_named_by_its_type(fake_flashinfer):
    """An exception with no message (an assert in flashinfer's plan) keeps the size split like any refusal, not an
    IndexError out of the tune."""
    attn = fi(blocks=16)
    attn.init_cuda_graph([1], max_seq_len=64)
    timer = _timer({(v, 1, 8): 1.0 for v in (fib.SPLIT_KV, fib.WHOLE_KV)}, [])

    def asserting(attn_, seqs, size, variant, layers):
        if variant == fib.WHOLE_KV:
            raise AssertionError()
        return timer(attn_, seqs, size, variant, layers)

    choices = split_kv.tune(attn, 2, lengths=(8,), timer=asserting)
    assert choices[0].whole_kv_max == 0 and choices[0].note.endswith("cannot run: AssertionError")


# -- the real kernels ------------------------------------------------------------------------------

@pytest.mark.cuda
def test_split_free_graph_equals_the_reference_and_tunes_on_the_device():
    """flashinfer's disable_split_kv plan in graph mode: replay equals the same plan run eagerly, both variants give
    the dense reference; then the device tune times both at a 7B's head shapes and sets limits it can replay."""
    pytest.importorskip("flashinfer")
    attn = fi(28, 4, 128, torch.bfloat16, "cuda", blocks=256)
    attn.warmup()
    attn.init_cuda_graph([1, 4], max_seq_len=512)
    seqs = [(6, 1, [3, 9]), (9, 1, [5, 6, 7]), (2, 1, [0])]
    outs = {}
    for variant in (fib.SPLIT_KV, fib.WHOLE_KV):
        step = make_step(seqs, attn.kv_cache, 28, seed=4)
        pad = 4 - len(seqs)
        q = torch.cat([step.q, step.q[:pad]])
        k, v = torch.cat([step.k, step.k[:pad]]), torch.cat([step.v, step.v[:pad]])
        attn.plan(seqs, graph_batch_size=4, graph_variant=variant)
        attn.forward(0, q, k, v)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn.forward(0, q, k, v)
        graph.replay()
        outs[variant] = out[:3].clone()
        assert torch.equal(outs[variant], attn.forward(0, q, k, v)[:3])
        torch.testing.assert_close(outs[variant].double().cpu(), dense_reference(step, attn.scale), atol=2e-2,
                                   rtol=2e-2)
    torch.testing.assert_close(outs[fib.WHOLE_KV], outs[fib.SPLIT_KV], atol=2e-2, rtol=2e-2)
    whole = attn._graph_decode[4][fib.WHOLE_KV]  # its schedule's padded tail stays as cleared (flashinfer#4002)
    schedule = whole._pin_memory_int_workspace_buffer
    assert schedule[4096:].count_nonzero().item() == 0 and schedule[:4096].count_nonzero().item() > 0
    choices = split_kv.tune(attn, attn.kv_cache.tensor.shape[0], lengths=(64, 128, 256, 512))
    assert [c.batch_size for c in choices] == [1, 4]
    assert all(c.lengths and min(c.split_us + c.whole_us) > 0 and not c.note for c in choices)
    assert attn.whole_kv_limits() == {c.batch_size: c.whole_kv_max for c in choices}
