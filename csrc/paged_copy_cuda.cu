// Paged embedding-buffer copies, the CUDA kernel of unifiedserve::paged_scatter and unifiedserve::paged_gather
// (schemas in ops.cpp, index semantics in paged_copy.cpp, checks in paged_copy.h, host side in
// paged_copy_cuda_host.cpp).
//
// One launch per call. Block (j, c) copies chunk c of listed page j's run: the rows of one request that
// fall in that page, which are contiguous on both sides (a run of whole rows inside one page, and a
// run of whole rows of the packed chunk). Each thread moves up to kVecsPerThread vectors of the widest
// type (16, 8, 4, 2 or 1 bytes) that divides the row size and both base addresses; every run starts at a
// whole row, so one choice per call keeps every access aligned.
//
// This file is the kernel and its launch only; the op's entry points, checks and registration are host
// code in paged_copy_cuda_host.cpp (why: paged_copy_cuda.h). Nothing here throws or touches a tensor.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "paged_copy_cuda.h"

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

template <bool kToPages, typename Vec>
cudaError_t launch_as(void* pages, void* rows, int64_t page_size, int64_t row_bytes, const DeviceIndex& ix,
                      cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t page_vecs = page_size * row_vecs;  // the most one block's run can hold
  // one warp while a page holds <= 32 x kVecsPerThread Vecs, doubling up to kThreads, so blocks of small
  // pages (page_size 1 or 4) do not leave most of their warps idle
  int threads = kMinThreads;
  while (threads < kThreads && threads * int64_t{kVecsPerThread} < page_vecs) threads *= 2;
  const int64_t chunk = int64_t{threads} * kVecsPerThread;
  const int64_t chunks_per_page = (page_vecs + chunk - 1) / chunk;
  const dim3 grid(static_cast<unsigned>(ix.num_entries), static_cast<unsigned>(std::min(chunks_per_page, kMaxGridY)));
  paged_copy_kernel<kToPages, Vec><<<grid, threads, 0, stream>>>(
      static_cast<Vec*>(pages), static_cast<Vec*>(rows), ix.indptr, ix.page_indptr, ix.page_indices, ix.cu_page_len,
      ix.num_requests, page_size, row_vecs);
  return cudaGetLastError();
}

// Picks the widest copy unit that keeps every access aligned, and launches once.
template <bool kToPages>
cudaError_t launch(void* pages, void* rows, int64_t page_size, int64_t row_bytes, const DeviceIndex& ix,
                   cudaStream_t stream) {
  if (ix.num_entries == 0 || row_bytes == 0) return cudaSuccess;  // nothing to move
  const auto aligned = [&](int64_t v) {
    return row_bytes % v == 0 && reinterpret_cast<uintptr_t>(pages) % v == 0 &&
           reinterpret_cast<uintptr_t>(rows) % v == 0;
  };
  if (aligned(16)) return launch_as<kToPages, uint4>(pages, rows, page_size, row_bytes, ix, stream);
  if (aligned(8)) return launch_as<kToPages, uint2>(pages, rows, page_size, row_bytes, ix, stream);
  if (aligned(4)) return launch_as<kToPages, uint32_t>(pages, rows, page_size, row_bytes, ix, stream);
  if (aligned(2)) return launch_as<kToPages, uint16_t>(pages, rows, page_size, row_bytes, ix, stream);
  return launch_as<kToPages, uint8_t>(pages, rows, page_size, row_bytes, ix, stream);
}

}  // namespace

cudaError_t launch_paged_copy(bool to_pages, void* pages, void* rows, int64_t page_size, int64_t row_bytes,
                              const DeviceIndex& ix, cudaStream_t stream) noexcept {
  return to_pages ? launch<true>(pages, rows, page_size, row_bytes, ix, stream)
                  : launch<false>(pages, rows, page_size, row_bytes, ix, stream);
}

}  // namespace unifiedserve
