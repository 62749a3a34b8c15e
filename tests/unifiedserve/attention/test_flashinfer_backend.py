"""FlashInferAttention: its glue on CPU against a stand-in for flashinfer's wrappers (which follow
flashinfer 0.6's documented plan/run semantics), and the real kernels on CUDA."""

from __future__ import annotations

import types

import pytest
import torch

from attention_cases import DECODE_SEQS, MIXED_SEQS, dense_reference, make_step, rotated_write
from flashinfer_fakes import BS, fi
from unifiedserve.attention import KVCache, TorchPagedAttention
from unifiedserve.attention import flashinfer_backend as fib
from unifiedserve.attention.metadata import build_paged_batch, pad_decode_batch


@pytest.mark.parametrize("seqs", [MIXED_SEQS, DECODE_SEQS], ids=["mixed", "decode"])
def test_glue_matches_dense_reference(fake_flashinfer, seqs):
    attn = fi()
    step = make_step(seqs, attn.kv_cache, 4, seed=7, layer=1)
    attn.plan(seqs)
    wrapper = attn._step.wrapper
    assert wrapper is (attn._decode if seqs is DECODE_SEQS else attn._prefill)
    assert attn._decode.use_tensor_cores and wrapper.plan_args["causal"] == (seqs is MIXED_SEQS)
    out = attn.forward(1, step.q, step.k, step.v)
    assert out.dtype == torch.bfloat16 and out.shape == step.q.shape
    torch.testing.assert_close(out.double(), dense_reference(step, attn.scale), atol=2e-2, rtol=2e-2)


def test_graph_decode_pads_and_rewrites_fixed_buffers(fake_flashinfer):
    eager, graph = fi(), fi()
    graph.init_cuda_graph([1, 4, 8], max_seq_len=16)
    assert sorted(graph._graph_decode) == [1, 4, 8]
    assert graph.whole_kv_limits() == {1: 0, 4: 0, 8: 0} and graph.graph_variants(8) == (fib.SPLIT_KV,)
    indptr_ptr = graph._graph_bufs["paged_kv_indptr"].data_ptr()
    for seed, seqs in enumerate((DECODE_SEQS, DECODE_SEQS[:3], DECODE_SEQS[2:])):
        e, g = (make_step(seqs, a.kv_cache, 4, seed=seed) for a in (eager, graph))
        eager.plan(seqs)
        expected = eager.forward(0, e.q, e.k, e.v)
        graph.plan(seqs, graph_batch_size=8)
        pad = 8 - len(seqs)
        q = torch.cat([g.q, torch.randn(pad, 4, 64).bfloat16()])
        junk = torch.randn(pad, 2, 64).bfloat16()
        out = graph.forward(0, q, torch.cat([g.k, junk]), torch.cat([g.v, -junk]))
        assert torch.equal(out[:len(seqs)], expected)
        assert torch.equal(graph.kv_cache.tensor, eager.kv_cache.tensor)  # padding rows changed nothing
        assert graph._graph_bufs["paged_kv_indptr"].data_ptr() == indptr_ptr
        assert graph._graph_bufs["paged_kv_last_page_len"][len(seqs):8].tolist() == [1] * pad
        wrapper = graph._step.wrapper
        assert wrapper.use_cuda_graph and wrapper.use_tensor_cores and wrapper.disable_split_kv is False
    assert list(graph._graph_decode[8]) == [fib.SPLIT_KV]  # no split-free wrapper (and its workspaces) unasked


def test_rope_write_names_the_steps_slots_and_forward_rotated_attends_over_them(fake_flashinfer):
    """As the torch backend's: rope_write names this layer's slots, the step's slot mapping and (graph) write_rows;
    K/V written there and forward_rotated give forward_rope's output and cache. None before a plan and for float32
    tables beside the bfloat16 cache."""
    fused, unfused = fi(), fi()
    for a in (fused, unfused):
        a.init_cuda_graph([8], max_seq_len=16)
    assert fused.rope_write(0, torch.zeros(1, 64), torch.zeros(1, 64)) is None
    for graph_size, seqs in ((None, MIXED_SEQS), (8, DECODE_SEQS)):
        step = make_step(seqs, fused.kv_cache, 4, seed=5)
        make_step(seqs, unfused.kv_cache, 4, seed=5)
        q, k, v = step.q, step.k, step.v
        if graph_size:
            pad = graph_size - q.shape[0]
            q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:]).bfloat16()]) for t in (q, k, v))
        angles = torch.rand(q.shape[0], 32) * 6.3
        cos, sin = (f(torch.cat((angles, angles), -1)).bfloat16() for f in (torch.cos, torch.sin))
        for a in (fused, unfused):
            a.plan(seqs, graph_batch_size=graph_size)
        assert fused.rope_write(0, cos.float(), sin.float()) is None
        rotated, write = rotated_write(fused, 0, q, k, v, cos, sin)
        assert write.slot_mapping is fused._step.slot_mapping and write.write_rows is fused._step.write_rows
        assert (write.write_rows is None) == (graph_size is None) and write.k_cache.dtype == torch.bfloat16
        n = step.q.shape[0]
        assert torch.equal(fused.forward_rotated(0, rotated)[:n], unfused.forward_rope(0, q, k, v, cos, sin)[:n])
        assert torch.equal(fused.kv_cache.tensor, unfused.kv_cache.tensor)


def test_a_wrapper_is_planned_again_only_after_its_last_plans_copy(fake_flashinfer, monkeypatch):
    """flashinfer's plan queues a copy from the wrapper's page-locked buffer: the next plan of the same wrapper
    first waits for the event recorded after the previous one (async scheduling plans a step while the one
    before may still be queued); a wrapper's first plan waits for nothing, and wrappers do not wait on each other."""
    attn = fi()
    attn.init_cuda_graph([4], max_seq_len=16)
    log = []
    graph_wrapper = attn._graph_wrapper(4, fib.SPLIT_KV)
    names = {id(attn._decode): "decode", id(attn._prefill): "prefill", id(graph_wrapper): "graph"}
    for wrapper in (attn._decode, attn._prefill, graph_wrapper):
        monkeypatch.setattr(wrapper, "plan", lambda *a, _w=wrapper, _plan=wrapper.plan, **k: (
            log.append(("plan", names[id(_w)])), _plan(*a, **k)))

    def event(device):  # numbered by the plan it follows
        n = sum(entry[0] == "plan" for entry in log)
        return types.SimpleNamespace(synchronize=lambda: log.append(("wait", n)))

    monkeypatch.setattr(fib, "_copy_done_event", event)
    attn.plan(DECODE_SEQS)
    attn.plan(MIXED_SEQS)
    attn.plan(DECODE_SEQS)
    attn.plan(DECODE_SEQS, graph_batch_size=4)
    attn.plan(DECODE_SEQS, graph_batch_size=4)
    assert log == [("plan", "decode"), ("plan", "prefill"), ("wait", 1), ("plan", "decode"),
                   ("plan", "graph"), ("wait", 4), ("plan", "graph")]


def test_graph_plan_sends_its_inputs_up_in_one_copy(fake_flashinfer, monkeypatch):
    """flashinfer 0.6.13's graph-mode plan copies host page indices with a blocking copy (the device caught it under
    set_sync_debug_mode("error")), so the backend sends them up itself: with the step's slot map and write rows, in
    one queued copy (copy_host_ints) whose page indices land in flashinfer's fixed indices buffer, and hands
    flashinfer a view equal to the one its plan copies into (same memory, offset, size and stride: torch's copy_
    skips it). indptr and last-page lengths stay host arrays, which flashinfer also reads there."""
    attn = fi()
    attn.init_cuda_graph([4, 8], max_seq_len=16)
    copies = []
    copy = fib.copy_host_ints
    monkeypatch.setattr(fib, "copy_host_ints", lambda dst, values: (copies.append(dst), copy(dst, values)))
    wrapper, seen = attn._graph_wrapper(4, fib.SPLIT_KV), {}
    plan = wrapper.plan
    monkeypatch.setattr(wrapper, "plan", lambda indptr, indices, last, *a, **k: (
        seen.update(indptr=indptr, indices=indices, last=last), plan(indptr, indices, last, *a, **k)))
    attn.plan(DECODE_SEQS, graph_batch_size=8)  # the size-8 buffers first: the size-4 step must not read them
    attn.plan(DECODE_SEQS, graph_batch_size=4)
    step = attn._graph_bufs["step"]
    assert len(copies) == 2 and copies[-1].data_ptr() == step.data_ptr()  # one copy per plan, into "step"
    padded = pad_decode_batch(build_paged_batch(DECODE_SEQS, BS), 4)
    expected = fib.plan_tensors(padded)["paged_kv_indices"]
    fixed = wrapper.bufs[1][:len(expected)]  # what flashinfer's plan copies the indices into
    indices = seen["indices"]
    assert indices.tolist() == expected.tolist() and fixed.tolist() == expected.tolist()
    assert (indices.untyped_storage().data_ptr(), indices.storage_offset(), indices.shape, indices.stride(),
            indices.dtype) == (fixed.untyped_storage().data_ptr(), fixed.storage_offset(), fixed.shape,
                               fixed.stride(), fixed.dtype)
    assert seen["indptr"].device.type == "cpu" and seen["last"].device.type == "cpu"
    slots, write_rows = attn._step.slot_mapping, attn._step.write_rows  # [4] each, contiguous, 16-byte aligned
    assert slots.is_contiguous() and write_rows.is_contiguous() and slots.data_ptr() == step.data_ptr()
    assert write_rows.data_ptr() == step.data_ptr() + 8 * 8  # from max_batch (8)
    assert slots.tolist() == padded.slot_mapping.tolist() and write_rows.tolist() == padded.write_rows.tolist()


def test_graph_decode_errors(fake_flashinfer):
    attn = fi()
    with pytest.raises(ValueError, match="not given to init_cuda_graph"):
        attn.plan(DECODE_SEQS, graph_batch_size=4)
    attn.init_cuda_graph([4], max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds the graph's max_seq_len 8"):
        attn.plan(DECODE_SEQS, graph_batch_size=4)
    with pytest.raises(ValueError, match="do not fit a graph of batch size 4"):
        attn.plan([(1, 1, [i]) for i in range(5)], graph_batch_size=4)


def test_graph_variants_split_free_below_the_limit(fake_flashinfer):
    """A size with a whole-KV limit captures two graphs; a step whose longest sequence (cached + new) is within
    the limit plans the split-free wrapper (flashinfer's disable_split_kv), a longer one the split wrapper, and both
    give the reference attention. Eager steps have no variants."""
    attn = fi()
    attn.init_cuda_graph([4, 8], max_seq_len=16)
    attn.set_whole_kv_limits({4: 6})
    assert attn.whole_kv_limits() == {4: 6, 8: 0}
    assert attn.graph_variants(4) == (fib.SPLIT_KV, fib.WHOLE_KV) and attn.graph_variants(8) == (fib.SPLIT_KV,)
    short = [(5, 1, [0, 1]), (2, 1, [2])]  # longest: 6 tokens
    long = [(6, 1, [3, 4]), (2, 1, [5])]  # 7
    assert attn.graph_variant(short, 4) == fib.WHOLE_KV and attn.graph_variant(long, 4) == fib.SPLIT_KV
    assert attn.graph_variant(short, 8) == fib.SPLIT_KV  # no limit at 8
    eager = fi()
    outs = {}
    for seqs, variant in ((short, fib.WHOLE_KV), (long, fib.SPLIT_KV)):
        step, e = make_step(seqs, attn.kv_cache, 4, seed=2), make_step(seqs, eager.kv_cache, 4, seed=2)
        attn.plan(seqs, graph_batch_size=4)  # the variant follows from the lengths
        wrapper = attn._step.wrapper
        assert wrapper is attn._graph_decode[4][variant] and wrapper.disable_split_kv == (variant == fib.WHOLE_KV)
        pad = torch.zeros(2, 2, 64).bfloat16()
        out = attn.forward(0, torch.cat([step.q, torch.zeros(2, 4, 64).bfloat16()]), torch.cat([step.k, pad]),
                           torch.cat([step.v, pad]))
        eager.plan(seqs)
        outs[variant] = out[:2]
        assert torch.equal(out[:2], eager.forward(0, e.q, e.k, e.v))
    attn.plan(long, graph_batch_size=4, graph_variant=fib.WHOLE_KV)  # a forced variant (what capture does)
    assert attn._step.wrapper is attn._graph_decode[4][fib.WHOLE_KV]
    attn.set_whole_kv_limits({})
    assert fib.WHOLE_KV not in attn._graph_decode[4] and attn.graph_variants(4) == (fib.SPLIT_KV,)
    attn.offer_every_graph_variant()
    assert attn.whole_kv_limits() == {4: 16, 8: 16}
    with pytest.raises(ValueError, match="unknown decode graph variant 'fast'"):
        attn.plan(short, graph_batch_size=4, graph_variant="fast")
    with pytest.raises(ValueError, match="needs graph_batch_size"):
        attn.plan(short, graph_variant=fib.WHOLE_KV)
    with pytest.raises(ValueError, match="sizes given to init_cuda_graph"):
        attn.set_whole_kv_limits({2: 4})
    with pytest.raises(ValueError, match="limits >= 0"):
        attn.set_whole_kv_limits({4: -1})


def test_a_split_free_graph_wrapper_starts_from_a_cleared_schedule(fake_flashinfer, monkeypatch):
    """flashinfer's split-free graph plans leave the schedule's padded tail unwritten, which blocks past the batch
    read (flashinfer#4002): the backend zeroes a split-free wrapper's schedule buffers once, when it is made; the
    split wrapper's plans write a validity mask and are left alone. Without those buffers it refuses the variant."""
    attn = fi()
    attn.init_cuda_graph([4], max_seq_len=16)
    attn.set_whole_kv_limits({4: 16})
    seqs = [(5, 1, [0, 1]), (2, 1, [2])]
    for variant in (fib.SPLIT_KV, fib.WHOLE_KV):
        attn.plan(seqs, graph_batch_size=4, graph_variant=variant)
    whole, split = attn._graph_decode[4][fib.WHOLE_KV], attn._graph_decode[4][fib.SPLIT_KV]
    assert not whole._pin_memory_int_workspace_buffer.any() and not whole._int_workspace_buffer.any()
    assert (split._pin_memory_int_workspace_buffer == 0x7F).all()

    class Other(type(whole)):  # a flashinfer whose wrapper keeps its schedule elsewhere
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            del self._pin_memory_int_workspace_buffer

    monkeypatch.setattr(attn._fi, "BatchDecodeWithPagedKVCacheWrapper", Other)
    attn.init_cuda_graph([2], max_seq_len=16)
    attn.set_whole_kv_limits({2: 16})
    with pytest.raises(RuntimeError, match="no _pin_memory_int_workspace_buffer to clear"):
        attn.plan(seqs, graph_batch_size=2, graph_variant=fib.WHOLE_KV)
    attn.plan(seqs, graph_batch_size=2, graph_variant=fib.SPLIT_KV)


def test_prefill_backend_knob(fake_flashinfer, monkeypatch):
    assert fi()._prefill.backend == "auto" and fib.prefill_backend() == "auto"
    monkeypatch.setenv(fib.PREFILL_BACKEND_ENV, "fa2")
    attn = fi()
    assert attn._prefill.backend == "fa2"
    assert attn._decode.backend == "auto"  # decode keeps flashinfer's tensor-core (FA2) kernel either way
    monkeypatch.setenv(fib.PREFILL_BACKEND_ENV, "fa4")
    with pytest.raises(ValueError, match="UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND='fa4': choose one of auto, fa2, fa3"):
        fi()


def test_constructor_rejects_odd_head_dims(fake_flashinfer):
    with pytest.raises(ValueError, match="built for head dims 64/128/256, the model has 80"):
        fi(d=80)


def test_selection_reasons_for_head_dim():
    assert fib.unsupported_reason("cuda", torch.bfloat16, 128) is None
    assert fib.unsupported_reason("cuda", torch.bfloat16, 16) == (
        "flashinfer's kernels are built for head dims 64/128/256, the model has 16")
    assert fib.unsupported_reason("cpu") == "device cpu is not CUDA"


def test_constructor_rejects_cpu_and_fp32_caches():
    with pytest.raises(ValueError, match="cannot serve this KV cache: device cpu is not CUDA"):
        fib.FlashInferAttention(KVCache(1, 4, BS, 2, 8, dtype=torch.bfloat16), 4, 2, 8)
    fp32 = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot serve this KV cache: flashinfer.s kernels take float16/bfloat16, "
                                         "the KV cache is torch.float32"):
        fib.FlashInferAttention._validate_cache(fp32)


def test_plan_tensors_are_int32_host_arrays():
    arrays = fib.plan_tensors(build_paged_batch([(3, 2, [4, 1])], BS))
    assert {k: v.tolist() for k, v in arrays.items()} == {
        "qo_indptr": [0, 2], "paged_kv_indptr": [0, 2], "paged_kv_indices": [4, 1], "paged_kv_last_page_len": [1]}
    assert all(v.dtype == torch.int32 and v.device.type == "cpu" for v in arrays.values())


# -- the real kernels ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("hq, hkv", [(28, 4), (16, 2)])
def test_flashinfer_matches_sdpa_and_reference(hq, hkv):
    pytest.importorskip("flashinfer")
    for seqs in (MIXED_SEQS, DECODE_SEQS):
        attn = fi(hq, hkv, 128, torch.bfloat16, "cuda")
        sdpa = TorchPagedAttention(KVCache(2, 16, BS, hkv, 128, dtype=torch.bfloat16, device="cuda"), hq, hkv, 128)
        step = make_step(seqs, attn.kv_cache, hq, seed=11)
        make_step(seqs, sdpa.kv_cache, hq, seed=11)
        attn.plan(seqs)
        sdpa.plan(seqs)
        out = attn.forward(0, step.q, step.k, step.v)
        torch.testing.assert_close(out.double().cpu(), dense_reference(step, attn.scale), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, sdpa.forward(0, step.q, step.k, step.v), atol=2e-2, rtol=2e-2)
        assert torch.equal(attn.kv_cache.tensor, sdpa.kv_cache.tensor)


@pytest.mark.cuda
def test_flashinfer_graph_replay_equals_eager():
    pytest.importorskip("flashinfer")
    attn = fi(28, 4, 128, torch.bfloat16, "cuda", blocks=32)
    attn.warmup()
    attn.init_cuda_graph([4], max_seq_len=64)
    first = make_step(DECODE_SEQS, attn.kv_cache, 28, seed=3)
    attn.plan(DECODE_SEQS, graph_batch_size=4)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    attn.forward(0, q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(0, q, k, v)
    second_seqs = [(6, 1, [3, 9]), (9, 1, [5, 6, 7]), (2, 1, [0])]
    second = make_step(second_seqs, attn.kv_cache, 28, seed=4)
    attn.plan(second_seqs, graph_batch_size=4)
    q[:3].copy_(second.q), k[:3].copy_(second.k), v[:3].copy_(second.v)
    graph.replay()
    replayed = out[:3].clone()
    assert torch.equal(replayed, attn.forward(0, q, k, v)[:3])  # the same padded plan, eagerly
    torch.testing.assert_close(replayed.double().cpu(), dense_reference(second, attn.scale), atol=2e-2, rtol=2e-2)
