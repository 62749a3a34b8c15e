// Paged embedding-buffer copies, CUDA kernels: the CUDA dispatch key of unifiedserve::paged_scatter and
// unifiedserve::paged_gather (schemas in ops.cpp, index semantics in paged_copy.cpp, checks in paged_copy.h).
//
// One launch per call. Block (j, c) copies chunk c of listed page j's run: the rows of one request that
// fall in that page, which are contiguous on both sides (a run of whole rows inside one page, and a
// run of whole rows of the packed chunk). Each thread moves up to kVecsPerThread vectors of the widest
// type (16, 8, 4, 2 or 1 bytes) that divides the row size and both base addresses; every run starts at a
// whole row, so one choice per call keeps every access aligned.
//
// Validation needs the index values on the host (a bad index must raise before any byte moves, and a
// kernel cannot raise): the four index tensors are concatenated on the device and copied to the host
// once per call, which waits for the work already queued on the current stream. That is the one host
// sync of this op. The kernel then reads the index from device memory, never from the host copy.
//
// Only c10/cuda headers are included (not ATen/cuda/CUDAContext.h, which pulls in the cuBLAS/cuSPARSE/
// cuSOLVER headers), so nvcc and the CUDA runtime headers are all the build needs.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_copy.h"

namespace unifiedserve {
namespace {

constexpr int kThreads = 256;      // per block at most; fewer when a page holds fewer Vecs (page_size 1)
constexpr int kMinThreads = 32;    // one warp
constexpr int kVecsPerThread = 4;  // loads in flight per thread before the stores
constexpr int64_t kMaxGridY = 65535;

// kToPages: rows -> pages (scatter); otherwise pages -> rows (gather). Vec is the copy unit; row_vecs is
// one row's size in Vecs. Pointers are Vec-aligned (checked on the host).
template <bool kToPages, typename Vec>
__global__ void __launch_bounds__(kThreads)
    paged_copy_kernel(Vec* pages, Vec* rows, const int64_t* __restrict__ indptr,
                      const int64_t* __restrict__ page_indptr, const int64_t* __restrict__ page_indices,
                      const int64_t* __restrict__ cu_page_len, int64_t num_requests, int64_t page_size,
                      int64_t row_vecs) {
  const int64_t j = blockIdx.x;  // listed page
  // Its request: the last b with page_indptr[b] <= j, which has page_indptr[b + 1] > j even when
  // requests listing no page sit in between. Every thread searches; they all read the same words.
  int64_t b = 0, hi = num_requests;  // page_indptr[b] <= j < page_indptr[hi]
  while (hi - b > 1) {
    const int64_t mid = (b + hi) / 2;
    if (page_indptr[mid] <= j) {
      b = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t k = j - page_indptr[b];  // j is the k-th listed page of request b
  const int64_t offset = cu_page_len[b] % page_size;
  const int64_t n = indptr[b + 1] - indptr[b];
  // token positions counted from the start of the request's first listed page
  const int64_t lo = offset > k * page_size ? offset : k * page_size;
  const int64_t hi_pos = offset + n < (k + 1) * page_size ? offset + n : (k + 1) * page_size;
  const int64_t run = (hi_pos - lo) * row_vecs;  // Vecs to copy for this page
  Vec* page_run = pages + (page_indices[j] * page_size + (lo - k * page_size)) * row_vecs;
  Vec* row_run = rows + (indptr[b] + lo - offset) * row_vecs;
  const Vec* from = kToPages ? row_run : page_run;
  Vec* to = kToPages ? page_run : row_run;

  const int64_t threads = blockDim.x;
  const int64_t chunk = threads * kVecsPerThread;
  for (int64_t start = blockIdx.y * chunk; start < run; start += gridDim.y * chunk) {
    Vec v[kVecsPerThread];
#pragma unroll
    for (int u = 0; u < kVecsPerThread; ++u) {
      const int64_t i = start + u * threads + threadIdx.x;
      if (i < run) v[u] = from[i];
    }
#pragma unroll
    for (int u = 0; u < kVecsPerThread; ++u) {
      const int64_t i = start + u * threads + threadIdx.x;
      if (i < run) to[i] = v[u];
    }
  }
}

struct DeviceIndex {
  const int64_t* indptr;
  const int64_t* page_indptr;
  const int64_t* page_indices;
  const int64_t* cu_page_len;
  int64_t num_requests;
  int64_t num_entries;
  int64_t num_rows;  // pv_indptr[-1], read from the validated host copy
};

// The index checks of one CUDA call (same as the CPU kernel's), then the device pointers for the kernel.
// The buffer was checked by the caller.
DeviceIndex check_cuda(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                       const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  check_index_tensors(pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len, buffer.device());
  const int64_t B = pv_cu_page_len.size(0);
  const int64_t P = pv_page_indices.size(0);
  // One device-to-host copy for all four tensors (the op's one host sync, see the header comment).
  const at::Tensor host = at::cat({pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len}).cpu();
  const Index checked =
      check_index_values(host.narrow(0, 0, B + 1), host.narrow(0, B + 1, B + 1), host.narrow(0, 2 * B + 2, P),
                         host.narrow(0, 2 * B + 2 + P, B), buffer.size(0), buffer.size(1));
  TORCH_CHECK(P <= std::numeric_limits<int32_t>::max(), "too many listed pages for one launch: ", P);
  return {pv_indptr.data_ptr<int64_t>(), pv_page_indptr.data_ptr<int64_t>(), pv_page_indices.data_ptr<int64_t>(),
          pv_cu_page_len.data_ptr<int64_t>(), B, P, checked.indptr[B]};
}

template <bool kToPages, typename Vec>
void launch_as(void* pages, void* rows, int64_t page_size, int64_t row_bytes, const DeviceIndex& ix) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t page_vecs = page_size * row_vecs;  // the most one block's run can hold
  // one warp while a page holds <= 32 x kVecsPerThread Vecs, doubling up to kThreads, so blocks of small
  // pages (page_size 1 or 4) do not leave most of their warps idle
  int threads = kMinThreads;
  while (threads < kThreads && threads * int64_t{kVecsPerThread} < page_vecs) threads *= 2;
  const int64_t chunk = int64_t{threads} * kVecsPerThread;
  const int64_t chunks_per_page = (page_vecs + chunk - 1) / chunk;
  const dim3 grid(static_cast<unsigned>(ix.num_entries), static_cast<unsigned>(std::min(chunks_per_page, kMaxGridY)));
  paged_copy_kernel<kToPages, Vec><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<Vec*>(pages), static_cast<Vec*>(rows), ix.indptr, ix.page_indptr, ix.page_indices, ix.cu_page_len,
      ix.num_requests, page_size, row_vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Picks the widest copy unit that keeps every access aligned, and launches once.
template <bool kToPages>
void launch(void* pages, void* rows, int64_t page_size, int64_t row_bytes, const DeviceIndex& ix) {
  if (ix.num_entries == 0 || row_bytes == 0) return;  // nothing to move
  const auto aligned = [&](int64_t v) {
    return row_bytes % v == 0 && reinterpret_cast<uintptr_t>(pages) % v == 0 &&
           reinterpret_cast<uintptr_t>(rows) % v == 0;
  };
  if (aligned(16)) {
    launch_as<kToPages, uint4>(pages, rows, page_size, row_bytes, ix);
  } else if (aligned(8)) {
    launch_as<kToPages, uint2>(pages, rows, page_size, row_bytes, ix);
  } else if (aligned(4)) {
    launch_as<kToPages, uint32_t>(pages, rows, page_size, row_bytes, ix);
  } else if (aligned(2)) {
    launch_as<kToPages, uint16_t>(pages, rows, page_size, row_bytes, ix);
  } else {
    launch_as<kToPages, uint8_t>(pages, rows, page_size, row_bytes, ix);
  }
}

void paged_scatter_cuda(const at::Tensor& buffer, const at::Tensor& src, const at::Tensor& pv_indptr,
                        const at::Tensor& pv_page_indptr, const at::Tensor& pv_page_indices,
                        const at::Tensor& pv_cu_page_len) {
  // Every check before the device guard, as the fused ops do (the path seen raising cleanly on the device): a
  // bad input then throws with no guard to unwind. check_cuda's copy sets its own device.
  check_buffer(buffer, c10::DeviceType::CUDA);
  const DeviceIndex ix = check_cuda(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  check_src(buffer, src, ix.num_rows);
  const c10::cuda::CUDAGuard guard(buffer.device());
  const at::Tensor rows = src.contiguous();  // [N, ...]
  launch<true>(buffer.data_ptr(), rows.data_ptr(), buffer.size(1), row_bytes_of(buffer), ix);
}

at::Tensor paged_gather_cuda(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                             const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  check_buffer(buffer, c10::DeviceType::CUDA);  // every check before the guard, as in paged_scatter_cuda
  const DeviceIndex ix = check_cuda(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  const c10::cuda::CUDAGuard guard(buffer.device());
  std::vector<int64_t> shape(buffer.sizes().begin() + 1, buffer.sizes().end());
  shape[0] = ix.num_rows;
  at::Tensor out = at::empty(shape, buffer.options());  // [N, ...]
  launch<false>(buffer.data_ptr(), out.data_ptr(), buffer.size(1), row_bytes_of(buffer), ix);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CUDA, m) {
  m.impl("paged_scatter", &paged_scatter_cuda);
  m.impl("paged_gather", &paged_gather_cuda);
}

}  // namespace unifiedserve
