// Shared between the CPU kernel (paged_copy.cpp) and the CUDA op (paged_copy_cuda_host.cpp): the index
// layout and the checks, so both raise on exactly the same inputs. Index semantics: paged_copy.cpp's
// header comment and unifiedserve/memory/pages.py (RaggedIndex).
//
// Order of the checks matters: every tensor's metadata (dim, dtype, device, contiguity, length) is
// checked before any index value is read, and every index value before any byte of the buffer moves.
// A failed check throws c10::Error (US_CHECK, check_msg.h), which the dispatcher turns into a Python RuntimeError;
// nothing is ever thrown from inside a parallel region or a kernel.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace unifiedserve {

// Host pointers into the four int64 index tensors, after check_index_values.
struct Index {
  const int64_t* indptr;        // [B+1] row offsets of the requests in the packed chunk
  const int64_t* page_indptr;   // [B+1] offsets of the requests' runs of listed pages
  const int64_t* page_indices;  // [num_entries] buffer page of each listed page
  const int64_t* cu_page_len;   // [B] token position of each request's first chunk row
  int64_t num_requests;         // B
  int64_t num_entries;          // listed pages, all requests together
};

// buffer is [num_pages, page_size, ...], contiguous, on a device of `device_type`, page_size > 0.
void check_buffer(const at::Tensor& buffer, c10::DeviceType device_type);

// Each index tensor is 1-D, int64, contiguous and on `device`; pv_indptr and pv_page_indptr have
// len(pv_cu_page_len) + 1 entries. Reads no values, so it is safe for device tensors.
void check_index_tensors(const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                         const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len, c10::Device device);

// Validates the index values (host tensors that passed check_index_tensors) against a buffer of
// num_pages x page_size rows: offsets start at 0, counts are non-negative, each request lists exactly the
// pages its rows touch, every page is in range.
Index check_index_values(const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                         const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len, int64_t num_pages,
                         int64_t page_size);

// src is [num_rows, <buffer's trailing dims>] of buffer's dtype on buffer's device.
void check_src(const at::Tensor& buffer, const at::Tensor& src, int64_t num_rows);

// Bytes of one row (one token's trailing dims) of a [num_pages, page_size, ...] buffer.
int64_t row_bytes_of(const at::Tensor& buffer);

// An uninitialised [num_rows, <buffer's trailing dims>] tensor like buffer: a gather's output.
at::Tensor empty_rows(const at::Tensor& buffer, int64_t num_rows);

}  // namespace unifiedserve
