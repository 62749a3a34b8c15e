// Fused layer ops of the language model, CUDA kernels: the CUDA dispatch key of unifiedserve::rms_norm,
// fused_add_rms_norm, silu_and_mul, rotary_ and rotary_cache_ (schemas in ops.cpp, semantics and CPU kernels in
// fused_ops.cpp, shared checks and per-element arithmetic in fused_ops.h).
//
// Why: a Qwen2 decoder layer in plain torch launches about 35 kernels, of which only the four GEMMs and
// attention move real bytes; at decode batch sizes the other thirty (the RMSNorm's float/pow/mean/rsqrt/
// mul/cast/mul, rotate_half's chunk/neg/cat and the rotary's mul/mul/add twice, silu, mul, the residual
// adds) cost a launch each even inside a CUDA graph. These kernels make that four launches per layer.
//
// One block per row for the norms (the row's sum of squares is a block reduction: warp shuffles, then one
// warp over the warps' sums) and the rotary (all heads of q and k of one token), a (row, column-chunk) grid
// for silu_and_mul. Loads and stores are coalesced. Each kernel is templated on kN, the values one access moves
// (`Pack`): 16 bytes (8 bf16/fp16 or 4 float32; for the rotary, a Pack of each half of a head) when the widths,
// the strides and the pointers allow it, else one element. On the H200 (2026-11-26) one-element accesses ran at
// 22-35 % of the copy bandwidth over 8192 rows of the 7B's widths: too few bytes in flight per thread to cover
// the memory latency. Both widths round every element the same way; only the RMSNorm's sum of squares is summed
// in another order by each (which width a call takes depends only on its tensors, so a graph replays the one
// eager took for the same tensors).
// No kernel reads a value on the host, so all four are capturable in a CUDA graph; the checks read only
// metadata.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "check_msg.h"
#include "fused_ops.h"

namespace unifiedserve {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kSiluThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// kN values of T moved as one access: 16 bytes (ld/st.global.v4) for kN = kWide<T>, one element for kN = 1.
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Pack {
  T v[kN];
};

template <typename T>
constexpr int kWide = 16 / sizeof(T);

// Whether rows of `width` elements of `element_size` bytes, `stride` elements apart, starting at each of the
// pointers, can be read and written as whole 16-byte Packs.
bool packs_fit(int64_t width, int64_t element_size, std::initializer_list<int64_t> strides,
               std::initializer_list<const void*> pointers) {
  const int64_t n = 16 / element_size;
  if (width % n != 0) return false;
  for (const int64_t stride : strides)
    if (stride % n != 0) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// f(std::integral_constant<int, kN>{}) with kN = kWide<T> when `wide`, else 1: the kernel's access width.
template <typename T, typename F>
void with_width(bool wide, F&& f) {
  if (wide) {
    f(std::integral_constant<int, kWide<T>>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// Threads for one row of `work` items: a whole number of warps, at most kMaxThreads.
int threads_for(int64_t work) {
  const int64_t warps = std::min<int64_t>(kMaxThreads / 32, std::max<int64_t>(1, (work + 31) / 32));
  return static_cast<int>(warps * 32);
}

// Sum of `v` over the block (blockDim.x a multiple of 32); every thread gets the total.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// The second pass of both norms: this thread's Packs of row `in`, scaled by `inv` (1 / rms) and the weight, into
// row `out` (of another tensor; under add + RMSNorm `in` holds the Packs this thread just wrote).
template <typename T, int kN>
__device__ inline void scale_packs(Pack<T, kN>* out, const Pack<T, kN>* in, const Pack<T, kN>* __restrict__ w,
                                   int64_t packs, float inv) {
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, kN> a = in[p];
    const Pack<T, kN> ws = w[p];
    Pack<T, kN> r;
#pragma unroll
    for (int j = 0; j < kN; ++j) r.v[j] = fused::rms_scale<T>(static_cast<float>(a.v[j]), inv, ws.v[j]);
    out[p] = r;
  }
}

// One block per row of `packs` Packs (hidden = packs * kN).
template <typename T, int kN>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int64_t packs, int64_t x_stride, float eps) {
  const int64_t hidden = packs * kN;
  const auto* row = reinterpret_cast<const Pack<T, kN>*>(x + static_cast<int64_t>(blockIdx.x) * x_stride);
  auto* o = reinterpret_cast<Pack<T, kN>*>(out + static_cast<int64_t>(blockIdx.x) * hidden);
  float acc = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, kN> a = row[p];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float v = static_cast<float>(a.v[j]);
      acc += v * v;
    }
  }
  scale_packs(o, row, reinterpret_cast<const Pack<T, kN>*>(weight), packs,
              fused::inv_rms(block_sum(acc), hidden, eps));
}

// residual = x + residual (rounded once, as torch's add), then x = RMSNorm(residual); each thread reads back
// only the Packs it wrote.
template <typename T, int kN>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                          int64_t packs, int64_t x_stride, int64_t r_stride, float eps) {
  auto* xr = reinterpret_cast<Pack<T, kN>*>(x + static_cast<int64_t>(blockIdx.x) * x_stride);
  auto* rr = reinterpret_cast<Pack<T, kN>*>(residual + static_cast<int64_t>(blockIdx.x) * r_stride);
  float acc = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T, kN> a = xr[p];
    const Pack<T, kN> b = rr[p];
    Pack<T, kN> h;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      h.v[j] = static_cast<T>(fused::add_rn(static_cast<float>(a.v[j]), static_cast<float>(b.v[j])));
      const float v = static_cast<float>(h.v[j]);
      acc += v * v;
    }
    rr[p] = h;
  }
  scale_packs(xr, rr, reinterpret_cast<const Pack<T, kN>*>(weight), packs,
              fused::inv_rms(block_sum(acc), packs * kN, eps));
}

// Grid (row, chunk of kSiluThreads Packs): out's Pack p of a row from gate's and up's Pack p.
template <typename T, int kN>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t packs,
                                    int64_t stride) {
  const int64_t p = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (p >= packs) return;
  const int64_t inter = packs * kN;
  const T* row = gate_up + static_cast<int64_t>(blockIdx.x) * stride;
  const Pack<T, kN> g = reinterpret_cast<const Pack<T, kN>*>(row)[p];
  const Pack<T, kN> u = reinterpret_cast<const Pack<T, kN>*>(row + inter)[p];
  Pack<T, kN> o;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float s = fused::rnd<T>(fused::silu(static_cast<float>(g.v[j])));
    o.v[j] = static_cast<T>(fused::mul_rn(s, static_cast<float>(u.v[j])));
  }
  reinterpret_cast<Pack<T, kN>*>(out + static_cast<int64_t>(blockIdx.x) * inter)[p] = o;
}

// kN values of a rotary table (C: float32 or T) from p, in Packs of up to 16 bytes (C's Pack divides T's).
template <typename C, int kN>
__device__ inline void load_values(const C* p, C (&out)[kN]) {
  constexpr int kC = kN < kWide<C> ? kN : kWide<C>;
  static_assert(kN % kC == 0, "a table Pack must divide a storage Pack");
#pragma unroll
  for (int b = 0; b < kN / kC; ++b) {
    const Pack<C, kC> v = reinterpret_cast<const Pack<C, kC>*>(p)[b];
#pragma unroll
    for (int j = 0; j < kC; ++j) out[b * kC + j] = v.v[j];
  }
}

// rotate_pair over a Pack of first-half values and the matching Pack of second-half values (each pair (j, j) of
// the two Packs is one (i, i + half) pair); in and out may be the same memory.
template <int kN, typename T, typename C>
__device__ inline void rotate_packs(const T* in_lo, const T* in_hi, T* lo, T* hi, const C* cos_lo, const C* sin_lo,
                                    const C* cos_hi, const C* sin_hi) {
  const Pack<T, kN> a = *reinterpret_cast<const Pack<T, kN>*>(in_lo);
  const Pack<T, kN> b = *reinterpret_cast<const Pack<T, kN>*>(in_hi);
  C cl[kN], sl[kN], ch[kN], sh[kN];
  load_values(cos_lo, cl);
  load_values(sin_lo, sl);
  load_values(cos_hi, ch);
  load_values(sin_hi, sh);
  Pack<T, kN> na, nb;
#pragma unroll
  for (int j = 0; j < kN; ++j) fused::rotate_pair(&a.v[j], &b.v[j], &na.v[j], &nb.v[j], cl[j], sl[j], ch[j], sh[j]);
  *reinterpret_cast<Pack<T, kN>*>(lo) = na;
  *reinterpret_cast<Pack<T, kN>*>(hi) = nb;
}

// One block per token: Packs of pairs (head, i) of q's heads then k's heads, `hp` = (dim / 2) / kN per head.
template <int kN, typename T, typename C>
__global__ void rotary_kernel(T* q, T* k, const C* __restrict__ cos, const C* __restrict__ sin, int64_t q_heads,
                              int64_t k_heads, int64_t q_row, int64_t q_head, int64_t k_row, int64_t k_head,
                              int64_t dim) {
  const int64_t half = dim / 2, hp = half / kN;
  const C* c = cos + static_cast<int64_t>(blockIdx.x) * dim;
  const C* s = sin + static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t work = (q_heads + k_heads) * hp;
  for (int64_t p = threadIdx.x; p < work; p += blockDim.x) {
    const int64_t head = p / hp, i = (p % hp) * kN;
    T* x = head < q_heads ? q + blockIdx.x * q_row + head * q_head
                          : k + blockIdx.x * k_row + (head - q_heads) * k_head;
    rotate_packs<kN>(x + i, x + i + half, x + i, x + i + half, c + i, s + i, c + i + half, s + i + half);
  }
}

// One block per token r: q's pairs rotated in place, then k's pairs of row src = write_rows[r] (or r) rotated
// with row src's cos/sin into slot slot_mapping[r] of k_cache, then v's elements of row src copied into v_cache. k and v are only
// read, so a padding row that repeats row 0's write reads the same k as row 0 (no race). A slot or source
// row out of range skips the write: a kernel cannot raise, and the planner that builds these indices
// checks them on the host (the CPU kernel raises).
template <int kN, typename T, typename C>
__global__ void rotary_cache_kernel(T* q, const T* __restrict__ k, const T* __restrict__ v, const C* __restrict__ cos,
                                    const C* __restrict__ sin, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                    const int64_t* __restrict__ slot_mapping, const int64_t* __restrict__ write_rows,
                                    int64_t rows, int64_t slots, int64_t q_heads, int64_t heads, int64_t q_row,
                                    int64_t q_head, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head,
                                    int64_t dim) {
  const int64_t r = blockIdx.x, half = dim / 2, hp = half / kN;
  const C* c = cos + r * dim;
  const C* s = sin + r * dim;
  for (int64_t p = threadIdx.x; p < q_heads * hp; p += blockDim.x) {
    T* x = q + r * q_row + (p / hp) * q_head;
    const int64_t i = (p % hp) * kN;
    rotate_packs<kN>(x + i, x + i + half, x + i, x + i + half, c + i, s + i, c + i + half, s + i + half);
  }
  const int64_t slot = slot_mapping[r];
  const int64_t src = write_rows != nullptr ? write_rows[r] : r;
  if (slot < 0 || slot >= slots || src < 0 || src >= rows) return;
  const C* cs = cos + src * dim;  // row src's own rotation: a padding row repeats row 0's write exactly
  const C* ss = sin + src * dim;
  for (int64_t p = threadIdx.x; p < heads * hp; p += blockDim.x) {
    const int64_t h = p / hp, i = (p % hp) * kN;
    const T* x = k + src * k_row + h * k_head;
    T* out = k_cache + (slot * heads + h) * dim;
    rotate_packs<kN>(x + i, x + i + half, out + i, out + i + half, cs + i, ss + i, cs + i + half, ss + i + half);
  }
  const int64_t dp = dim / kN;
  for (int64_t e = threadIdx.x; e < heads * dp; e += blockDim.x) {
    const int64_t h = e / dp, j = (e % dp) * kN;
    *reinterpret_cast<Pack<T, kN>*>(v_cache + (slot * heads + h) * dim + j) =
        *reinterpret_cast<const Pack<T, kN>*>(v + src * v_row + h * v_head + j);
  }
}

void rms_norm_cuda(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(out, x, weight, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (rows == 0) return;
  const bool wide = packs_fit(hidden, x.element_size(), {x.stride(0)}, {x.data_ptr(), out.data_ptr(), weight.data_ptr()});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "rms_norm_cuda", [&] {
    with_width<scalar_t>(wide, [&](auto width) {
      constexpr int kN = decltype(width)::value;
      rms_norm_kernel<scalar_t, kN><<<rows, threads_for(hidden / kN), 0, stream>>>(
          out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), hidden / kN, x.stride(0),
          static_cast<float>(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_fused_add_rms_norm(x, residual, weight, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (rows == 0) return;
  const bool wide = packs_fit(hidden, x.element_size(), {x.stride(0), residual.stride(0)},
                              {x.data_ptr(), residual.data_ptr(), weight.data_ptr()});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "fused_add_rms_norm_cuda", [&] {
    with_width<scalar_t>(wide, [&](auto width) {
      constexpr int kN = decltype(width)::value;
      fused_add_rms_norm_kernel<scalar_t, kN><<<rows, threads_for(hidden / kN), 0, stream>>>(
          x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), hidden / kN,
          x.stride(0), residual.stride(0), static_cast<float>(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void silu_and_mul_cuda(const at::Tensor& out, const at::Tensor& gate_up) {
  check_silu_and_mul(out, gate_up, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t rows = out.size(0), inter = out.size(1);
  if (rows == 0) return;
  const int64_t chunks = (inter + kSiluThreads - 1) / kSiluThreads;  // one-element chunks: the most there can be
  US_CHECK(chunks <= kMaxGridY, "silu_and_mul: intermediate size ", inter, " is over the kernel's limit of ",
              kMaxGridY * kSiluThreads);
  const bool wide = packs_fit(inter, gate_up.element_size(), {gate_up.stride(0)}, {gate_up.data_ptr(), out.data_ptr()});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  UNIFIEDSERVE_DISPATCH_FUSED(gate_up.scalar_type(), "silu_and_mul_cuda", [&] {
    with_width<scalar_t>(wide, [&](auto width) {
      constexpr int kN = decltype(width)::value;
      const int64_t packs = inter / kN;
      const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((packs + kSiluThreads - 1) / kSiluThreads));
      silu_and_mul_kernel<scalar_t, kN><<<grid, kSiluThreads, 0, stream>>>(out.data_ptr<scalar_t>(),
                                                                          gate_up.data_ptr<scalar_t>(), packs,
                                                                          gate_up.stride(0));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(q, k, cos, sin, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), dim = q.size(2);
  if (rows == 0) return;
  const bool wide = packs_fit(dim / 2, q.element_size(), {q.stride(0), q.stride(1), k.stride(0), k.stride(1)},
                              {q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr()});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cuda", [&] {
    using T = scalar_t;
    with_width<T>(wide, [&](auto width) {
      constexpr int kN = decltype(width)::value;
      const int threads = threads_for((q.size(1) + k.size(1)) * dim / 2 / kN);
      fused::with_tables<T>(cos, sin, [&](auto* c, auto* s) {
        rotary_kernel<kN><<<rows, threads, 0, stream>>>(q.data_ptr<T>(), k.data_ptr<T>(), c, s, q.size(1),
                                                        k.size(1), q.stride(0), q.stride(1), k.stride(0),
                                                        k.stride(1), dim);
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_cache_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& write_rows) {
  check_rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), dim = q.size(2), heads = k.size(1);
  if (rows == 0) return;
  const int64_t* sources = write_rows.has_value() ? write_rows->data_ptr<int64_t>() : nullptr;
  const bool wide = packs_fit(dim / 2, q.element_size(),
                              {q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)},
                              {q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                               k_cache.data_ptr(), v_cache.data_ptr()});
  const auto stream = c10::cuda::getCurrentCUDAStream();
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cache_cuda", [&] {
    using T = scalar_t;
    with_width<T>(wide, [&](auto width) {
      constexpr int kN = decltype(width)::value;
      const int threads = threads_for(std::max((q.size(1) + heads) * dim / 2, heads * dim) / kN);
      fused::with_tables<T>(cos, sin, [&](auto* c, auto* s) {
        rotary_cache_kernel<kN><<<rows, threads, 0, stream>>>(
            q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), c, s, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
            slot_mapping.data_ptr<int64_t>(), sources, rows, k_cache.size(0), q.size(1), heads, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dim);
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &silu_and_mul_cuda);
  m.impl("rotary_", &rotary_cuda);
  m.impl("rotary_cache_", &rotary_cache_cuda);
}

}  // namespace unifiedserve
