// Paged embedding-buffer copies on CUDA, host side: the CUDA dispatch key of unifiedserve::paged_scatter and
// unifiedserve::paged_gather (schemas in ops.cpp). Every check (the same as the CPU kernel's, paged_copy.h)
// runs here, in host-compiled code, and so does every throw; the kernel and its launch are in
// paged_copy_cuda.cu (why the split: paged_copy_cuda.h).
//
// Validation needs the index values on the host (a bad index must raise before any byte moves, and a kernel
// cannot raise): the four index tensors are concatenated on the device and copied to the host once per call,
// which waits for the work already queued on the current stream. That is the op's one host sync; the kernel
// reads the index from device memory, never from the host copy.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "check_msg.h"
#include "paged_copy.h"
#include "paged_copy_cuda.h"

namespace unifiedserve {
namespace {

// The index checks of one CUDA call, then the device pointers for the kernel. The buffer was checked first.
DeviceIndex check_cuda(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                       const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  check_index_tensors(pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len, buffer.device());
  const int64_t B = pv_cu_page_len.size(0);
  const int64_t P = pv_page_indices.size(0);
  // One device-to-host copy for all four tensors (the op's one host sync).
  const at::Tensor host = at::cat({pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len}).cpu();
  const Index checked =
      check_index_values(host.narrow(0, 0, B + 1), host.narrow(0, B + 1, B + 1), host.narrow(0, 2 * B + 2, P),
                         host.narrow(0, 2 * B + 2 + P, B), buffer.size(0), buffer.size(1));
  US_CHECK(P <= std::numeric_limits<int32_t>::max(), "too many listed pages for one launch: ", P);
  return {pv_indptr.data_ptr<int64_t>(), pv_page_indptr.data_ptr<int64_t>(), pv_page_indices.data_ptr<int64_t>(),
          pv_cu_page_len.data_ptr<int64_t>(), B, P, checked.indptr[B]};
}

void launch(bool to_pages, const at::Tensor& buffer, const at::Tensor& rows, const DeviceIndex& ix) {
  C10_CUDA_CHECK(launch_paged_copy(to_pages, buffer.data_ptr(), rows.data_ptr(), buffer.size(1),
                                   row_bytes_of(buffer), ix, c10::cuda::getCurrentCUDAStream()));
}

void paged_scatter_cuda(const at::Tensor& buffer, const at::Tensor& src, const at::Tensor& pv_indptr,
                        const at::Tensor& pv_page_indptr, const at::Tensor& pv_page_indices,
                        const at::Tensor& pv_cu_page_len) {
  check_buffer(buffer, c10::DeviceType::CUDA);
  const DeviceIndex ix = check_cuda(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  check_src(buffer, src, ix.num_rows);
  const c10::cuda::CUDAGuard guard(buffer.device());
  launch(true, buffer, src.contiguous(), ix);  // [N, ...]
}

at::Tensor paged_gather_cuda(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                             const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  check_buffer(buffer, c10::DeviceType::CUDA);
  const DeviceIndex ix = check_cuda(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  const c10::cuda::CUDAGuard guard(buffer.device());
  at::Tensor out = empty_rows(buffer, ix.num_rows);  // [N, ...]
  launch(false, buffer, out, ix);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CUDA, m) {
  m.impl("paged_scatter", &paged_scatter_cuda);
  m.impl("paged_gather", &paged_gather_cuda);
}

}  // namespace unifiedserve
