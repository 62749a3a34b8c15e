// Paged embedding-buffer copies (patch buffer, visual-token buffer), CPU kernels.
//
// Ops (schemas in ops.cpp):
//   unifiedserve::paged_scatter(buffer, src, <index>)  writes src's rows into buffer's pages
//   unifiedserve::paged_gather(buffer, <index>)        reads them back into a packed [N, ...] tensor
// where <index> is the paper's RaggedIndex (§4.2, Fig. 10): pv_indptr [B+1], pv_page_indptr [B+1],
// pv_page_indices [P], pv_cu_page_len [B], all int64. Request b's chunk rows
// pv_indptr[b]..pv_indptr[b+1] are its tokens pv_cu_page_len[b].., starting at slot
// o = pv_cu_page_len[b] % page_size of its first listed page; its listed pages are exactly the
// ceil((o + n) / page_size) pages touched. The torch reference is unifiedserve/ops/reference.py.
//
// Work unit: one (request, listed page) pair = one contiguous run of rows inside one page, copied with
// a single memcpy. at::parallel_for splits the flat list of pages, so a long request is spread over
// threads as well as many short ones.
//
// The CPU kernels live here; csrc/paged_copy_cuda_host.cpp registers the CUDA kernels against the
// same schemas, and paged_copy.h holds the checks both run, so they reject exactly the same inputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check_msg.h"
#include "paged_copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace unifiedserve {
namespace {

// Aim for at least this many bytes per parallel task so thread start-up does not dominate.
constexpr int64_t kGrainBytes = 64 * 1024;

}  // namespace

void check_buffer(const at::Tensor& buffer, c10::DeviceType device_type) {
  US_CHECK(buffer.dim() >= 2, "buffer must be [num_pages, page_size, ...], got shape ", buffer.sizes());
  US_CHECK(buffer.device().type() == device_type, "buffer must be on ", c10::DeviceTypeName(device_type),
              " for this kernel, got ", buffer.device());
  US_CHECK(buffer.is_contiguous(), "buffer must be contiguous");
  US_CHECK(buffer.size(1) > 0, "buffer's page_size (dim 1) must be positive, got shape ", buffer.sizes());
}

static void check_index_tensor(const at::Tensor& t, const char* name, c10::Device device) {
  US_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  US_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  US_CHECK(t.device() == device, name, " must be on the buffer's device ", device, ", got ", t.device());
  US_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_index_tensors(const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                         const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len, c10::Device device) {
  check_index_tensor(pv_indptr, "pv_indptr", device);
  check_index_tensor(pv_page_indptr, "pv_page_indptr", device);
  check_index_tensor(pv_page_indices, "pv_page_indices", device);
  check_index_tensor(pv_cu_page_len, "pv_cu_page_len", device);
  const int64_t B = pv_cu_page_len.size(0);
  US_CHECK(pv_indptr.size(0) == B + 1, "pv_indptr must have ", B + 1, " entries (B+1), got ", pv_indptr.size(0));
  US_CHECK(pv_page_indptr.size(0) == B + 1, "pv_page_indptr must have ", B + 1, " entries (B+1), got ",
              pv_page_indptr.size(0));
}

Index check_index_values(const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                         const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len, int64_t num_pages,
                         int64_t page_size) {
  // Only now are values read: the lengths were checked by check_index_tensors, and the data_ptr<int64_t>()
  // calls cannot throw on a dtype mismatch any more.
  US_CHECK(page_size > 0, "page_size must be positive, got ", page_size);
  Index ix{pv_indptr.data_ptr<int64_t>(), pv_page_indptr.data_ptr<int64_t>(),
           pv_page_indices.data_ptr<int64_t>(), pv_cu_page_len.data_ptr<int64_t>(),
           pv_cu_page_len.size(0), pv_page_indices.size(0)};
  const int64_t B = ix.num_requests;
  US_CHECK(ix.indptr[0] == 0 && ix.page_indptr[0] == 0, "pv_indptr and pv_page_indptr must start at 0");
  US_CHECK(ix.page_indptr[B] == ix.num_entries, "pv_page_indptr[-1] (", ix.page_indptr[B],
              ") must equal len(pv_page_indices) (", ix.num_entries, ")");
  for (int64_t b = 0; b < B; ++b) {
    // Compare before subtracting: both offsets are then >= 0 (induction from [0] == 0), so no overflow.
    US_CHECK(ix.indptr[b + 1] >= ix.indptr[b] && ix.page_indptr[b + 1] >= ix.page_indptr[b] &&
                    ix.cu_page_len[b] >= 0,
                "request ", b, ": negative row count, page count or pv_cu_page_len");
    const int64_t n = ix.indptr[b + 1] - ix.indptr[b];
    const int64_t have = ix.page_indptr[b + 1] - ix.page_indptr[b];
    // have <= num_entries (page_indptr is non-decreasing up to num_entries), so a request with
    // need == have has n < (have + 1) * page_size: offsets computed from n cannot overflow either.
    US_CHECK(have <= ix.num_entries && n <= (have + 1) * page_size, "request ", b, ": ", n, " rows cannot fit in ",
                have, " listed pages of ", page_size);
    const int64_t need = n == 0 ? 0 : (ix.cu_page_len[b] % page_size + n + page_size - 1) / page_size;
    US_CHECK(have == need, "request ", b, ": ", n, " rows from token ", ix.cu_page_len[b], " span ", need,
                " pages of ", page_size, ", but the index lists ", have);
  }
  for (int64_t j = 0; j < ix.num_entries; ++j) {
    US_CHECK(ix.page_indices[j] >= 0 && ix.page_indices[j] < num_pages, "pv_page_indices[", j, "] = ",
                ix.page_indices[j], " is out of range for a buffer of ", num_pages, " pages");
  }
  return ix;
}

void check_src(const at::Tensor& buffer, const at::Tensor& src, int64_t num_rows) {
  US_CHECK(src.scalar_type() == buffer.scalar_type(), "src dtype ", src.scalar_type(), " must match buffer dtype ",
              buffer.scalar_type());
  US_CHECK(src.device() == buffer.device(), "src must be on the buffer's device ", buffer.device(), ", got ",
              src.device());
  US_CHECK(src.dim() == buffer.dim() - 1 && src.sizes().slice(1) == buffer.sizes().slice(2),
              "src must be [N, ", buffer.sizes().slice(2), "] to match buffer ", buffer.sizes(), ", got ", src.sizes());
  US_CHECK(src.size(0) == num_rows, "src has ", src.size(0), " rows, pv_indptr[-1] is ", num_rows);
}

int64_t row_bytes_of(const at::Tensor& buffer) {
  int64_t row_elems = 1;  // buffer is [num_pages, page_size, ...]: a row is one token's trailing dims
  for (int64_t d = 2; d < buffer.dim(); ++d) row_elems *= buffer.size(d);
  return row_elems * static_cast<int64_t>(buffer.element_size());
}

at::Tensor empty_rows(const at::Tensor& buffer, int64_t num_rows) {
  std::vector<int64_t> shape(buffer.sizes().begin() + 1, buffer.sizes().end());
  shape[0] = num_rows;
  return at::empty(shape, buffer.options());
}

namespace {

// All checks of one CPU call, in order: buffer, index metadata, index values.
Index check_cpu(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  check_buffer(buffer, c10::DeviceType::CPU);
  check_index_tensors(pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len, buffer.device());
  return check_index_values(pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len, buffer.size(0),
                            buffer.size(1));
}

// kToPages: rows -> pages (scatter); otherwise pages -> rows (gather).
template <bool kToPages>
void copy_runs(char* pages, char* rows, int64_t page_size, int64_t row_bytes, const Index& ix) {
  const int64_t page_bytes = page_size * row_bytes;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(page_bytes, 1));
  at::parallel_for(0, ix.num_entries, grain, [&](int64_t begin, int64_t end) {
    // the request owning listed page `begin`: the last b with page_indptr[b] <= begin
    int64_t b = std::upper_bound(ix.page_indptr, ix.page_indptr + ix.num_requests + 1, begin) - ix.page_indptr - 1;
    for (int64_t j = begin; j < end; ++j) {
      while (ix.page_indptr[b + 1] <= j) ++b;
      const int64_t k = j - ix.page_indptr[b];  // k-th page of request b this iteration
      const int64_t offset = ix.cu_page_len[b] % page_size;
      const int64_t n = ix.indptr[b + 1] - ix.indptr[b];
      // token positions counted from the start of the request's first listed page
      const int64_t lo = std::max(offset, k * page_size);
      const int64_t hi = std::min(offset + n, (k + 1) * page_size);
      char* page_ptr = pages + ix.page_indices[j] * page_bytes + (lo - k * page_size) * row_bytes;
      char* row_ptr = rows + (ix.indptr[b] + lo - offset) * row_bytes;
      const size_t num_bytes = static_cast<size_t>((hi - lo) * row_bytes);
      if (kToPages) {
        std::memcpy(page_ptr, row_ptr, num_bytes);
      } else {
        std::memcpy(row_ptr, page_ptr, num_bytes);
      }
    }
  });
}

void paged_scatter_cpu(const at::Tensor& buffer, const at::Tensor& src, const at::Tensor& pv_indptr,
                       const at::Tensor& pv_page_indptr, const at::Tensor& pv_page_indices,
                       const at::Tensor& pv_cu_page_len) {
  const Index ix = check_cpu(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  check_src(buffer, src, ix.indptr[ix.num_requests]);
  const at::Tensor rows = src.contiguous();  // [N, dim]
  copy_runs<true>(static_cast<char*>(buffer.data_ptr()), static_cast<char*>(rows.data_ptr()), buffer.size(1),
                  row_bytes_of(buffer), ix);
}

at::Tensor paged_gather_cpu(const at::Tensor& buffer, const at::Tensor& pv_indptr, const at::Tensor& pv_page_indptr,
                            const at::Tensor& pv_page_indices, const at::Tensor& pv_cu_page_len) {
  const Index ix = check_cpu(buffer, pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len);
  at::Tensor out = empty_rows(buffer, ix.indptr[ix.num_requests]);  // [N, ...]
  copy_runs<false>(static_cast<char*>(buffer.data_ptr()), static_cast<char*>(out.data_ptr()), buffer.size(1),
                   row_bytes_of(buffer), ix);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CPU, m) {
  m.impl("paged_scatter", &paged_scatter_cpu);
  m.impl("paged_gather", &paged_gather_cpu);
}

}  // namespace unifiedserve
