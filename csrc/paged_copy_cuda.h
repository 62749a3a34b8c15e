// The boundary between the paged-copy CUDA op's host code (paged_copy_cuda_host.cpp, compiled by the host
// compiler: every check, every tensor, every throw) and its kernel (paged_copy_cuda.cu, compiled by nvcc: one
// launch, no tensors, no exceptions), so no C++ exception unwinds through an nvcc-compiled frame.

#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace unifiedserve {

// Device pointers to the four validated int64 index tensors, and the counts the launch needs.
struct DeviceIndex {
  const int64_t* indptr;        // [B+1]
  const int64_t* page_indptr;   // [B+1]
  const int64_t* page_indices;  // [num_entries]
  const int64_t* cu_page_len;   // [B]
  int64_t num_requests;         // B
  int64_t num_entries;          // listed pages
  int64_t num_rows;             // pv_indptr[-1], read from the validated host copy
};

// Copies rows -> pages (to_pages) or pages -> rows on `stream` in one launch. Everything was checked by the
// caller; nothing is thrown: the launch's error (cudaSuccess when none) is returned for the caller to raise.
cudaError_t launch_paged_copy(bool to_pages, void* pages, void* rows, int64_t page_size, int64_t row_bytes,
                              const DeviceIndex& ix, cudaStream_t stream) noexcept;

}  // namespace unifiedserve
