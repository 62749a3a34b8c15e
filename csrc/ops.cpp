// The schemas of every op in the `unifiedserve` torch namespace (the one TORCH_LIBRARY block). The kernels
// register per dispatch key next to their code: paged_copy.cpp / paged_copy_cuda_host.cpp, fused_ops.cpp /
// fused_ops_cuda.cu. Python reaches them only through unifiedserve/ops/__init__.py.

#include <torch/library.h>

TORCH_LIBRARY(unifiedserve, m) {
  // Paged embedding-buffer copies (paged_copy.cpp).
  m.def(
      "paged_scatter(Tensor(a!) buffer, Tensor src, Tensor pv_indptr, Tensor pv_page_indptr, "
      "Tensor pv_page_indices, Tensor pv_cu_page_len) -> ()");
  m.def(
      "paged_gather(Tensor buffer, Tensor pv_indptr, Tensor pv_page_indptr, Tensor pv_page_indices, "
      "Tensor pv_cu_page_len) -> Tensor");
  // Decode attention over the paged KV cache (paged_attention.cpp, CPU).
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor valid, float scale) -> Tensor");
  // Fused layer ops (fused_ops.cpp).
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def(
      "rotary_cache_(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, Tensor? write_rows) -> ()");
}
