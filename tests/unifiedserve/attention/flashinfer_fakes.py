"""A stand-in for flashinfer's paged wrappers (following flashinfer 0.6's documented plan/run semantics), so that
FlashInferAttention's glue runs on a CPU cache (``conftest.py``'s ``fake_flashinfer`` fixture puts them in place) and
``fi()`` to build the backend."""

from __future__ import annotations


import torch

from unifiedserve.attention import KVCache
from unifiedserve.attention import flashinfer_backend as fib

BS = 4


def _paged_reference(q, kv, qo_indptr, kv_indptr, indices, last_page_len, page_size, causal, scale):
    """flashinfer's paged attention semantics, densely: request b's keys are the first
    ``(pages - 1) * page_size + last_page_len`` slots of its pages; causal aligns bottom-right."""
    k_cache, v_cache = kv  # [P, page, Hkv, D] each (NHD)
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(kv_indptr) - 1):
        pages = indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_page_len[b])
        k = k_cache[pages].flatten(0, 1)[:kv_len].double()
        v = v_cache[pages].flatten(0, 1)[:kv_len].double()
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[qs:qe].double(), k) * scale
        if causal:
            n = qe - qs
            allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out.to(q.dtype)


class FakeWrapper:
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto"):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.backend = backend
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0
        self.disable_split_kv = None  # what the last decode plan asked for
        # flashinfer 0.6.13's schedule buffers (torch.empty: here, the stale bytes of recycled memory)
        self._int_workspace_buffer = torch.full((64,), 0x7F, dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.full((64,), 0x7F, dtype=torch.uint8)

    def _store(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
               causal, sm_scale, q_data_type, kv_data_type, pos_encoding_mode):
        assert all(t.dtype == torch.int32 for t in (qo_indptr, indptr, indices, last))
        assert pos_encoding_mode == "NONE" and q_data_type == kv_data_type
        if self.use_cuda_graph:  # flashinfer copies into the fixed buffers; the batch size is fixed
            ind_buf, idx_buf, last_buf = self.bufs
            if len(last) != len(last_buf):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            ind_buf.copy_(indptr), last_buf.copy_(last), idx_buf[:len(indices)].copy_(indices)
            indptr, indices, last = ind_buf, idx_buf, last_buf
        self.plan_args = dict(qo_indptr=qo_indptr.clone(), indptr=indptr, indices=indices, last=last,
                              heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size, causal=causal,
                              scale=sm_scale, dtype=q_data_type)
        self.plans += 1

    def run(self, q, paged_kv_cache):
        a = self.plan_args
        assert isinstance(paged_kv_cache, tuple) and q.dtype == a["dtype"]
        assert (q.shape[1], paged_kv_cache[0].shape[2], q.shape[2]) == a["heads"]
        return _paged_reference(q, paged_kv_cache, a["qo_indptr"].tolist(), a["indptr"].tolist(), a["indices"],
                                a["last"].tolist(), a["page_size"], a["causal"], a["scale"])


class FakeDecode(FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type="float16", kv_data_type=None,
             disable_split_kv=False):
        self.disable_split_kv = disable_split_kv
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._store(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, False,
                    sm_scale, q_data_type, kv_data_type, pos_encoding_mode)


class FakePrefill(FakeWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, pos_encoding_mode="NONE", sm_scale=None,
             q_data_type="float16", kv_data_type=None):
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size, causal, sm_scale, q_data_type, kv_data_type,
                    pos_encoding_mode)


def fi(hq=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu", blocks=16):
    return fib.FlashInferAttention(KVCache(2, blocks, BS, hkv, d, dtype=dtype, device=device), hq, hkv, d)
