"""Backend selection, and the torch backend (CPU; SDPA on CUDA) against a dense reference."""

from __future__ import annotations

import logging

import pytest
import torch

from attention_cases import DECODE_SEQS, MIXED_SEQS, dense_reference, make_step, rotated_write, slot
from unifiedserve.attention import (AttentionMetadata, KVCache, TorchPagedAttention, get_attention_backend)

BS = 4


def _torch_backend(device="cpu", dtype=torch.float32, hq=4, hkv=2, d=16, layers=2, blocks=16):
    cache = KVCache(layers, blocks, BS, hkv, d, dtype=dtype, device=device)
    return TorchPagedAttention(cache, hq, hkv, d)


# -- selection -----------------------------------------------------------------------------------

def test_cpu_selects_torch_for_auto_and_torch():
    assert get_attention_backend("cpu") is TorchPagedAttention
    assert get_attention_backend("cpu", "torch") is TorchPagedAttention
    assert get_attention_backend(torch.device("cpu"), "auto", torch.float32) is TorchPagedAttention


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; choose one of auto, flashinfer, torch"):
        get_attention_backend("cpu", "flash")


def test_flashinfer_on_cpu_says_why():
    with pytest.raises(ValueError, match="flashinfer attention backend cannot run here: device cpu is not CUDA"):
        get_attention_backend("cpu", "flashinfer")


def test_auto_on_cuda_with_fp32_falls_back_with_one_log_line(caplog):
    # no CUDA is touched: the dtype rule decides before anything is imported
    with caplog.at_level(logging.INFO, logger="unifiedserve.attention"):
        assert get_attention_backend("cuda", "auto", torch.float32) is TorchPagedAttention
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention backend: torch SDPA (flashinfer's kernels take float16/bfloat16, "
                     "the KV cache is torch.float32)"]
    with pytest.raises(ValueError, match="take float16/bfloat16"):
        get_attention_backend("cuda", "flashinfer", torch.float32)


def test_head_counts_must_group():
    cache = KVCache(1, 4, BS, 3, 8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchPagedAttention(cache, 4, 3, 8)


# -- the torch backend vs the dense reference ----------------------------------------------------

# more than 8 decode sequences: the plan scatters every page table at once instead of row by row
WIDE_DECODE_SEQS = [(3 * i % 7, 1, [2 * i + 1, 2 * i]) for i in range(12)]


@pytest.mark.parametrize("seqs", [MIXED_SEQS, DECODE_SEQS, WIDE_DECODE_SEQS], ids=["mixed", "decode", "wide_decode"])
def test_torch_backend_matches_dense_reference(seqs):
    attn = _torch_backend(blocks=32)
    step = make_step(seqs, attn.kv_cache, attn.num_q_heads, seed=1, layer=1)
    attn.plan(seqs)
    out = attn.forward(1, step.q, step.k, step.v)
    torch.testing.assert_close(out.double(), dense_reference(step, attn.scale), atol=1e-5, rtol=1e-5)
    # the new rows' K/V are in their slots afterwards
    k_slots, v_slots = attn.kv_cache.layer(1)
    row = 0
    for (num_cached, num_new, blocks), fk, fv in zip(seqs, step.full_k, step.full_v):
        for pos in range(num_cached, num_cached + num_new):
            assert torch.equal(k_slots[slot(blocks, pos, BS)], fk[pos])
            assert torch.equal(v_slots[slot(blocks, pos, BS)], fv[pos])
            row += 1
    assert torch.count_nonzero(attn.kv_cache.tensor[0]) == 0  # layer 0 untouched


def test_plan_is_reused_by_every_layer_and_begin_still_works():
    attn = _torch_backend()
    steps = [make_step(MIXED_SEQS, attn.kv_cache, attn.num_q_heads, seed=s, layer=s) for s in (0, 1)]
    attn.plan(MIXED_SEQS)
    outs = [attn.forward(i, s.q, s.k, s.v) for i, s in enumerate(steps)]
    legacy = _torch_backend()
    legacy_steps = [make_step(MIXED_SEQS, legacy.kv_cache, legacy.num_q_heads, seed=s, layer=s) for s in (0, 1)]
    legacy.begin(AttentionMetadata.build(MIXED_SEQS, BS))
    for i, (s, out) in enumerate(zip(legacy_steps, outs)):
        assert torch.equal(legacy.forward(i, s.q, s.k, s.v), out)
        torch.testing.assert_close(out.double(), dense_reference(steps[i], attn.scale), atol=1e-5, rtol=1e-5)


def test_forward_checks_the_plan():
    attn = _torch_backend()
    q = torch.zeros(2, 4, 16)
    with pytest.raises(RuntimeError, match="call plan"):
        attn.forward(0, q, q[:, :2], q[:, :2])
    attn.plan([(0, 3, [1])])
    with pytest.raises(ValueError, match="forward got 2 rows, the plan has 3"):
        attn.forward(0, q, q[:, :2], q[:, :2])


def test_chunked_prefill_through_the_backend_equals_one_chunk():
    """Writing a prompt in three chunks (each over the pages the earlier ones filled) gives the
    same outputs as one chunk."""
    seqs_full = [(0, 11, [6, 2, 9])]
    whole = _torch_backend()
    step = make_step(seqs_full, whole.kv_cache, whole.num_q_heads, seed=5)
    whole.plan(seqs_full)
    expected = whole.forward(0, step.q, step.k, step.v)
    chunked = _torch_backend()
    outs = []
    for start, end in ((0, 3), (3, 8), (8, 11)):
        chunked.plan([(start, end - start, [6, 2, 9])])
        outs.append(chunked.forward(0, step.q[start:end], step.k[start:end], step.v[start:end]))
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(chunked.kv_cache.tensor, whole.kv_cache.tensor)


# -- CUDA-graph decode protocol (runs eagerly on CPU: checks buffers, padding and the cache) -----

def test_graph_plan_pads_without_touching_the_cache_and_reuses_buffers():
    eager, graph = _torch_backend(), _torch_backend()
    graph.init_cuda_graph([2, 8], max_seq_len=16)
    for seed, seqs in enumerate((DECODE_SEQS, DECODE_SEQS[1:], DECODE_SEQS[:1])):
        e_step = make_step(seqs, eager.kv_cache, eager.num_q_heads, seed=seed)
        g_step = make_step(seqs, graph.kv_cache, graph.num_q_heads, seed=seed)
        eager.plan(seqs)
        expected = eager.forward(0, e_step.q, e_step.k, e_step.v)
        graph.plan(seqs, graph_batch_size=8)
        ptr = graph._plan.decode_slots.data_ptr()
        pad = 8 - len(seqs)
        junk = torch.randn(pad, *g_step.q.shape[1:]), torch.randn(pad, *g_step.k.shape[1:])
        q = torch.cat([g_step.q, junk[0]])
        k, v = torch.cat([g_step.k, junk[1]]), torch.cat([g_step.v, -junk[1]])
        out = graph.forward(0, q, k, v)
        torch.testing.assert_close(out[:len(seqs)], expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(graph.kv_cache.tensor, eager.kv_cache.tensor)  # padding wrote nothing new
        assert ptr == graph._graph_buffers["decode_slots"].data_ptr()  # fixed addresses


def test_rope_write_names_the_steps_slots_and_forward_rotated_attends_over_them():
    """rope_write hands a projection this layer's cache slots and the step's slot mapping (the graph's write_rows
    too); K/V written there and forward_rotated give forward_rope's output and cache, eager and padded for a graph.
    None before a plan, and for rotary tables in another dtype than the cache's."""
    for graph_size in (None, 8):
        fused, unfused = _torch_backend(), _torch_backend()
        for a in (fused, unfused):
            if graph_size:
                a.init_cuda_graph([graph_size], max_seq_len=16)
        seqs = DECODE_SEQS if graph_size else MIXED_SEQS
        assert fused.rope_write(1, torch.zeros(1, 16), torch.zeros(1, 16)) is None
        with pytest.raises(RuntimeError, match="call plan"):
            fused.forward_rotated(1, torch.zeros(1, 4, 16))
        step = make_step(seqs, fused.kv_cache, fused.num_q_heads, seed=3, layer=1)
        make_step(seqs, unfused.kv_cache, unfused.num_q_heads, seed=3, layer=1)
        q, k, v = step.q, step.k, step.v
        if graph_size:  # padding rows: junk that must not land anywhere
            pad = graph_size - q.shape[0]
            q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))
        angles = torch.rand(q.shape[0], 8) * 6.3
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        for a in (fused, unfused):
            a.plan(seqs, graph_batch_size=graph_size)
        assert fused.rope_write(1, cos.bfloat16(), sin.bfloat16()) is None  # float32 cache
        rotated, write = rotated_write(fused, 1, q, k, v, cos, sin)
        assert write.k_cache.data_ptr() == fused.kv_cache.layer(1)[0].data_ptr()
        assert write.slot_mapping is fused._plan.slot_mapping and write.write_rows is fused._plan.write_rows
        assert (write.write_rows is None) == (graph_size is None)
        out = fused.forward_rotated(1, rotated)
        want = unfused.forward_rope(1, q, k, v, cos, sin)
        n = step.q.shape[0]
        torch.testing.assert_close(out[:n], want[:n], atol=1e-6, rtol=1e-6)
        assert torch.equal(fused.kv_cache.tensor, unfused.kv_cache.tensor)


def test_graph_plan_errors():
    attn = _torch_backend()
    with pytest.raises(ValueError, match="not given to init_cuda_graph"):
        attn.plan(DECODE_SEQS, graph_batch_size=4)
    attn.init_cuda_graph([4], max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds the graph's max_seq_len 8"):
        attn.plan(DECODE_SEQS, graph_batch_size=4)
    with pytest.raises(ValueError, match="only decode steps"):
        attn.plan([(0, 2, [1])], graph_batch_size=4)
    with pytest.raises(ValueError, match="need batch sizes >= 1"):
        attn.init_cuda_graph([0], max_seq_len=8)


# -- SDPA on CUDA ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("hq, hkv", [(28, 4), (16, 2)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_torch_backend_on_cuda_matches_reference(hq, hkv, dtype, tol):
    for seqs in (MIXED_SEQS, DECODE_SEQS):
        attn = _torch_backend("cuda", dtype, hq, hkv, d=128)
        step = make_step(seqs, attn.kv_cache, hq, seed=2)
        attn.plan(seqs)
        out = attn.forward(0, step.q, step.k, step.v)
        torch.testing.assert_close(out.double().cpu(), dense_reference(step, attn.scale), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_torch_backend_graph_replay_equals_eager_on_cuda():
    attn = _torch_backend("cuda", torch.bfloat16, 28, 4, d=128, blocks=32)
    attn.init_cuda_graph([4], max_seq_len=64)
    first = make_step(DECODE_SEQS, attn.kv_cache, 28, seed=3)
    attn.plan(DECODE_SEQS, graph_batch_size=4)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    attn.forward(0, q, k, v)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(0, q, k, v)
    second_seqs = [(6, 1, [3, 9]), (9, 1, [5, 6, 7]), (2, 1, [0])]  # one row fewer: padding replays too
    second = make_step(second_seqs, attn.kv_cache, 28, seed=4)
    attn.plan(second_seqs, graph_batch_size=4)
    q[:3].copy_(second.q), k[:3].copy_(second.k), v[:3].copy_(second.v)
    graph.replay()
    replayed = out[:3].clone()
    # the same padded plan run eagerly: replay must equal it exactly
    assert torch.equal(replayed, attn.forward(0, q, k, v)[:3])
    eager = _torch_backend("cuda", torch.bfloat16, 28, 4, d=128, blocks=32)
    eager.kv_cache.tensor.copy_(attn.kv_cache.tensor)
    eager.plan(second_seqs)
    torch.testing.assert_close(replayed, eager.forward(0, second.q, second.k, second.v), atol=2e-2, rtol=2e-2)


def test_auto_on_cuda_with_an_odd_head_dim_falls_back(caplog):
    with caplog.at_level(logging.INFO, logger="unifiedserve.attention"):
        assert get_attention_backend("cuda:0", "auto", torch.bfloat16, head_dim=16) is TorchPagedAttention
    assert [r.getMessage() for r in caplog.records] == [
        "attention backend: torch SDPA (flashinfer's kernels are built for head dims 64/128/256, the model has 16)"]


def test_missing_flashinfer_on_cuda(monkeypatch, caplog):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)  # makes `import flashinfer` fail
    with caplog.at_level(logging.INFO, logger="unifiedserve.attention"):
        assert get_attention_backend("cuda", "auto", torch.bfloat16, head_dim=128) is TorchPagedAttention
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("attention backend: torch SDPA (flashinfer does not import (")
    with pytest.raises(ValueError, match="cannot run here: flashinfer does not import"):
        get_attention_backend("cuda", "flashinfer", torch.bfloat16, head_dim=128)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_chunk_over_a_cached_prefix_uses_two_flash_calls_not_a_mask(monkeypatch, dtype, tol):
    """CPU: a chunk after a cached prefix is attended as prefix + causal chunk merged by log-sum-exp (no
    [n, kv_len] mask is built), and equals SDPA with the bottom-right causal mask."""
    from unifiedserve.attention import torch_sdpa

    gen = torch.Generator().manual_seed(7)
    num_cached, num_new, hq, hkv, dim = 45, 19, 28, 4, 32
    q = torch.randn(num_new, hq, dim, generator=gen).to(dtype)
    keys = torch.randn(num_cached + num_new, hkv, dim, generator=gen).to(dtype)
    values = torch.randn(num_cached + num_new, hkv, dim, generator=gen).to(dtype)
    cache = KVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=hkv, head_dim=dim, dtype=dtype)
    attn = TorchPagedAttention(cache, hq, hkv, dim)
    seq = torch_sdpa._PrefillSeq((0, num_new), torch.arange(num_cached + num_new), num_cached)
    want = attn._sdpa(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), seq.mask(q.device))[0]
    got = attn._after_prefix(q, keys, values, num_cached)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

    # through the backend (chunks after cached prefixes among MIXED_SEQS): still the dense reference, no mask
    monkeypatch.setattr(torch_sdpa._PrefillSeq, "mask",
                        lambda self, device: pytest.fail("a mask was built") if self.num_cached else None)
    backend = _torch_backend()
    step = make_step(MIXED_SEQS, backend.kv_cache, backend.num_q_heads, seed=2)
    backend.plan(MIXED_SEQS)
    out = backend.forward(0, step.q, step.k, step.v)
    torch.testing.assert_close(out.double(), dense_reference(step, backend.scale), atol=1e-5, rtol=1e-5)
