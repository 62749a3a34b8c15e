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
// for silu_and_mul. Loads and stores are coalesced. Every kernel moves 16 bytes per access (8 bf16/fp16 or 4
// float32 values, `Pack`; for the rotary, a Pack of each half of a head) when the widths, the strides and the
// pointers allow it, else one element: on the H200 (2026-11-26) the one-element kernels ran at 22-35 % of the copy bandwidth over
// 8192 rows of the 7B's widths, too few bytes in flight per thread to cover the memory latency. Both paths
// round every element the same way; only the RMSNorm's sum of squares is summed in another order by each (which
// path a call takes depends only on its tensors, so a graph replays the path eager took for the same ones).
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

#include "fused_ops.h"

namespace unifiedserve {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kSiluThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// 16 bytes of T, loaded and stored as one access (ld/st.global.v4) where the address is 16-byte aligned.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Whether rows of `width` elements of `element_size` bytes, `stride` elements apart, starting at each of the
// pointers, can be read and written as whole Packs.
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

template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int64_t hidden, int64_t x_stride, float eps) {
  const T* row = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  T* o = out + static_cast<int64_t>(blockIdx.x) * hidden;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = static_cast<float>(row[i]);
    acc += v * v;
  }
  const float inv = fused::inv_rms(block_sum(acc), hidden, eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    o[i] = fused::rms_scale<T>(static_cast<float>(row[i]), inv, weight[i]);
}

template <typename T>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                          int64_t hidden, int64_t x_stride, int64_t r_stride, float eps) {
  T* xr = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  T* rr = residual + static_cast<int64_t>(blockIdx.x) * r_stride;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T h = static_cast<T>(fused::add_rn(static_cast<float>(xr[i]), static_cast<float>(rr[i])));
    rr[i] = h;
    const float v = static_cast<float>(h);
    acc += v * v;
  }
  const float inv = fused::inv_rms(block_sum(acc), hidden, eps);
  // each thread reads back only the elements it wrote above
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    xr[i] = fused::rms_scale<T>(static_cast<float>(rr[i]), inv, weight[i]);
}

// The second pass of both packed norms: this thread's Packs of row `in`, scaled by `inv` (1 / rms) and the
// weight, into row `out` (of another tensor; under add + RMSNorm `in` holds the Packs this thread just wrote).
template <typename T>
__device__ inline void scale_packs(Pack<T>* out, const Pack<T>* in, const Pack<T>* __restrict__ w, int64_t packs,
                                   float inv) {
  constexpr int kN = Pack<T>::kSize;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T> a = in[p];
    const Pack<T> ws = w[p];
    Pack<T> r;
#pragma unroll
    for (int j = 0; j < kN; ++j) r.v[j] = fused::rms_scale<T>(static_cast<float>(a.v[j]), inv, ws.v[j]);
    out[p] = r;
  }
}

// rms_norm_kernel over Packs: `packs` = hidden / Pack<T>::kSize per row.
template <typename T>
__global__ void rms_norm_pack_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                     int64_t packs, int64_t x_stride, float eps) {
  constexpr int kN = Pack<T>::kSize;
  const int64_t hidden = packs * kN;
  const auto* row = reinterpret_cast<const Pack<T>*>(x + static_cast<int64_t>(blockIdx.x) * x_stride);
  auto* o = reinterpret_cast<Pack<T>*>(out + static_cast<int64_t>(blockIdx.x) * hidden);
  const auto* w = reinterpret_cast<const Pack<T>*>(weight);
  float acc = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T> a = row[p];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float v = static_cast<float>(a.v[j]);
      acc += v * v;
    }
  }
  scale_packs(o, row, w, packs, fused::inv_rms(block_sum(acc), hidden, eps));
}

// fused_add_rms_norm_kernel over Packs; as there, each thread reads back only the Packs it wrote.
template <typename T>
__global__ void fused_add_rms_norm_pack_kernel(T* __restrict__ x, T* __restrict__ residual,
                                               const T* __restrict__ weight, int64_t packs, int64_t x_stride,
                                               int64_t r_stride, float eps) {
  constexpr int kN = Pack<T>::kSize;
  auto* xr = reinterpret_cast<Pack<T>*>(x + static_cast<int64_t>(blockIdx.x) * x_stride);
  auto* rr = reinterpret_cast<Pack<T>*>(residual + static_cast<int64_t>(blockIdx.x) * r_stride);
  const auto* w = reinterpret_cast<const Pack<T>*>(weight);
  float acc = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
    const Pack<T> a = xr[p];
    const Pack<T> b = rr[p];
    Pack<T> h;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      h.v[j] = static_cast<T>(fused::add_rn(static_cast<float>(a.v[j]), static_cast<float>(b.v[j])));
      const float v = static_cast<float>(h.v[j]);
      acc += v * v;
    }
    rr[p] = h;
  }
  scale_packs(xr, rr, w, packs, fused::inv_rms(block_sum(acc), packs * kN, eps));
}

// silu_and_mul_kernel over Packs: thread p of row blockIdx.x makes out's Pack p from gate's and up's Pack p.
template <typename T>
__global__ void silu_and_mul_pack_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t packs,
                                         int64_t stride) {
  constexpr int kN = Pack<T>::kSize;
  const int64_t p = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (p >= packs) return;
  const int64_t inter = packs * kN;
  const T* row = gate_up + static_cast<int64_t>(blockIdx.x) * stride;
  const Pack<T> g = reinterpret_cast<const Pack<T>*>(row)[p];
  const Pack<T> u = reinterpret_cast<const Pack<T>*>(row + inter)[p];
  Pack<T> o;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float s = fused::rnd<T>(fused::silu(static_cast<float>(g.v[j])));
    o.v[j] = static_cast<T>(fused::mul_rn(s, static_cast<float>(u.v[j])));
  }
  reinterpret_cast<Pack<T>*>(out + static_cast<int64_t>(blockIdx.x) * inter)[p] = o;
}

template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t inter,
                                    int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (i >= inter) return;
  const T* gate = gate_up + static_cast<int64_t>(blockIdx.x) * stride;
  const float s = fused::rnd<T>(fused::silu(static_cast<float>(gate[i])));
  out[static_cast<int64_t>(blockIdx.x) * inter + i] = static_cast<T>(fused::mul_rn(s, static_cast<float>(gate[inter + i])));
}

// One block per token: pairs (head, i) of q's heads then k's heads.
template <typename T, typename C>
__global__ void rotary_kernel(T* q, T* k, const C* __restrict__ cos, const C* __restrict__ sin, int64_t q_heads,
                              int64_t k_heads, int64_t q_row, int64_t q_head, int64_t k_row, int64_t k_head,
                              int64_t dim) {
  const int64_t half = dim / 2;
  const C* c = cos + static_cast<int64_t>(blockIdx.x) * dim;
  const C* s = sin + static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t pairs = (q_heads + k_heads) * half;
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int64_t head = p / half, i = p % half;
    T* x = head < q_heads ? q + blockIdx.x * q_row + head * q_head
                          : k + blockIdx.x * k_row + (head - q_heads) * k_head;
    fused::rotate_pair(x + i, x + i + half, x + i, x + i + half, c[i], s[i], c[i + half], s[i + half]);
  }
}

// kN values of C from p (16-byte aligned): kN / Pack<C>::kSize whole Packs (C is float32 or T, so kN, T's Pack
// size, is a multiple of C's).
template <typename C, int kN>
__device__ inline void load_values(const C* p, C (&out)[kN]) {
  constexpr int kC = Pack<C>::kSize;
  static_assert(kN % kC == 0, "a table Pack must divide a storage Pack");
#pragma unroll
  for (int b = 0; b < kN / kC; ++b) {
    const Pack<C> v = reinterpret_cast<const Pack<C>*>(p)[b];
#pragma unroll
    for (int j = 0; j < kC; ++j) out[b * kC + j] = v.v[j];
  }
}

// rotate_pair over one Pack of first-half values and the matching Pack of second-half values (each pair (j, j)
// of the two Packs is one (i, i + half) pair); in and out may be the same memory.
template <typename T, typename C>
__device__ inline void rotate_packs(const T* in_lo, const T* in_hi, T* lo, T* hi, const C* cos_lo, const C* sin_lo,
                                    const C* cos_hi, const C* sin_hi) {
  constexpr int kN = Pack<T>::kSize;
  const Pack<T> a = *reinterpret_cast<const Pack<T>*>(in_lo);
  const Pack<T> b = *reinterpret_cast<const Pack<T>*>(in_hi);
  C cl[kN], sl[kN], ch[kN], sh[kN];
  load_values(cos_lo, cl);
  load_values(sin_lo, sl);
  load_values(cos_hi, ch);
  load_values(sin_hi, sh);
  Pack<T> na, nb;
#pragma unroll
  for (int j = 0; j < kN; ++j) fused::rotate_pair(&a.v[j], &b.v[j], &na.v[j], &nb.v[j], cl[j], sl[j], ch[j], sh[j]);
  *reinterpret_cast<Pack<T>*>(lo) = na;
  *reinterpret_cast<Pack<T>*>(hi) = nb;
}

// rotary_kernel over Packs: `hp` = (dim / 2) / Pack<T>::kSize Packs per half head.
template <typename T, typename C>
__global__ void rotary_pack_kernel(T* q, T* k, const C* __restrict__ cos, const C* __restrict__ sin, int64_t q_heads,
                                   int64_t k_heads, int64_t q_row, int64_t q_head, int64_t k_row, int64_t k_head,
                                   int64_t dim) {
  constexpr int kN = Pack<T>::kSize;
  const int64_t half = dim / 2, hp = half / kN;
  const C* c = cos + static_cast<int64_t>(blockIdx.x) * dim;
  const C* s = sin + static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t work = (q_heads + k_heads) * hp;
  for (int64_t p = threadIdx.x; p < work; p += blockDim.x) {
    const int64_t head = p / hp, i = (p % hp) * kN;
    T* x = head < q_heads ? q + blockIdx.x * q_row + head * q_head
                          : k + blockIdx.x * k_row + (head - q_heads) * k_head;
    rotate_packs(x + i, x + i + half, x + i, x + i + half, c + i, s + i, c + i + half, s + i + half);
  }
}

// rotary_cache_kernel over Packs (the same rows, slots and skips).
template <typename T, typename C>
__global__ void rotary_cache_pack_kernel(T* q, const T* __restrict__ k, const T* __restrict__ v,
                                         const C* __restrict__ cos, const C* __restrict__ sin, T* __restrict__ k_cache,
                                         T* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping,
                                         const int64_t* __restrict__ write_rows, int64_t rows, int64_t slots,
                                         int64_t q_heads, int64_t heads, int64_t q_row, int64_t q_head, int64_t k_row,
                                         int64_t k_head, int64_t v_row, int64_t v_head, int64_t dim) {
  constexpr int kN = Pack<T>::kSize;
  const int64_t r = blockIdx.x, half = dim / 2, hp = half / kN;
  const C* c = cos + r * dim;
  const C* s = sin + r * dim;
  for (int64_t p = threadIdx.x; p < q_heads * hp; p += blockDim.x) {
    T* x = q + r * q_row + (p / hp) * q_head;
    const int64_t i = (p % hp) * kN;
    rotate_packs(x + i, x + i + half, x + i, x + i + half, c + i, s + i, c + i + half, s + i + half);
  }
  const int64_t slot = slot_mapping[r];
  const int64_t src = write_rows != nullptr ? write_rows[r] : r;
  if (slot < 0 || slot >= slots || src < 0 || src >= rows) return;
  const C* cs = cos + src * dim;
  const C* ss = sin + src * dim;
  for (int64_t p = threadIdx.x; p < heads * hp; p += blockDim.x) {
    const int64_t h = p / hp, i = (p % hp) * kN;
    const T* x = k + src * k_row + h * k_head;
    T* out = k_cache + (slot * heads + h) * dim;
    rotate_packs(x + i, x + i + half, out + i, out + i + half, cs + i, ss + i, cs + i + half, ss + i + half);
  }
  const int64_t dp = dim / kN;
  for (int64_t e = threadIdx.x; e < heads * dp; e += blockDim.x) {
    const int64_t h = e / dp, j = (e % dp) * kN;
    *reinterpret_cast<Pack<T>*>(v_cache + (slot * heads + h) * dim + j) =
        *reinterpret_cast<const Pack<T>*>(v + src * v_row + h * v_head + j);
  }
}

// One block per token r: q's pairs rotated in place, then k's pairs of row src = write_rows[r] (or r) rotated
// with row src's cos/sin into slot slot_mapping[r] of k_cache, then v's elements of row src copied into v_cache. k and v are only
// read, so a padding row that repeats row 0's write reads the same k as row 0 (no race). A slot or source
// row out of range skips the write: a kernel cannot raise, and the planner that builds these indices
// checks them on the host (the CPU kernel raises).
template <typename T, typename C>
__global__ void rotary_cache_kernel(T* q, const T* __restrict__ k, const T* __restrict__ v, const C* __restrict__ cos,
                                    const C* __restrict__ sin, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                    const int64_t* __restrict__ slot_mapping, const int64_t* __restrict__ write_rows,
                                    int64_t rows, int64_t slots, int64_t q_heads, int64_t heads, int64_t q_row,
                                    int64_t q_head, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head,
                                    int64_t dim) {
  const int64_t r = blockIdx.x, half = dim / 2;
  const C* c = cos + r * dim;
  const C* s = sin + r * dim;
  const int64_t q_pairs = q_heads * half;
  for (int64_t p = threadIdx.x; p < q_pairs; p += blockDim.x) {
    T* x = q + r * q_row + (p / half) * q_head;
    const int64_t i = p % half;
    fused::rotate_pair(x + i, x + i + half, x + i, x + i + half, c[i], s[i], c[i + half], s[i + half]);
  }
  const int64_t slot = slot_mapping[r];
  const int64_t src = write_rows != nullptr ? write_rows[r] : r;
  if (slot < 0 || slot >= slots || src < 0 || src >= rows) return;
  const C* cs = cos + src * dim;  // row src's own rotation: a padding row repeats row 0's write exactly
  const C* ss = sin + src * dim;
  for (int64_t p = threadIdx.x; p < heads * half; p += blockDim.x) {
    const int64_t h = p / half, i = p % half;
    const T* x = k + src * k_row + h * k_head;
    T* out = k_cache + (slot * heads + h) * dim;
    fused::rotate_pair(x + i, x + i + half, out + i, out + i + half, cs[i], ss[i], cs[i + half], ss[i + half]);
  }
  for (int64_t e = threadIdx.x; e < heads * dim; e += blockDim.x)
    v_cache[slot * heads * dim + e] = v[src * v_row + (e / dim) * v_head + e % dim];
}

void rms_norm_cuda(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(out, x, weight, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = 16 / x.element_size();
  if (packs_fit(hidden, x.element_size(), {x.stride(0)}, {x.data_ptr(), out.data_ptr(), weight.data_ptr()})) {
    UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "rms_norm_cuda", [&] {
      rms_norm_pack_kernel<scalar_t><<<rows, threads_for(hidden / n), 0, stream>>>(
          out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), hidden / n, x.stride(0),
          static_cast<float>(eps));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int threads = threads_for(hidden);
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "rms_norm_cuda", [&] {
    rms_norm_kernel<scalar_t><<<rows, threads, 0, stream>>>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                                            weight.data_ptr<scalar_t>(), hidden, x.stride(0),
                                                            static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_fused_add_rms_norm(x, residual, weight, eps, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = 16 / x.element_size();
  if (packs_fit(hidden, x.element_size(), {x.stride(0), residual.stride(0)},
                {x.data_ptr(), residual.data_ptr(), weight.data_ptr()})) {
    UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "fused_add_rms_norm_cuda", [&] {
      fused_add_rms_norm_pack_kernel<scalar_t><<<rows, threads_for(hidden / n), 0, stream>>>(
          x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), hidden / n,
          x.stride(0), residual.stride(0), static_cast<float>(eps));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int threads = threads_for(hidden);
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "fused_add_rms_norm_cuda", [&] {
    fused_add_rms_norm_kernel<scalar_t><<<rows, threads, 0, stream>>>(
        x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), hidden, x.stride(0),
        residual.stride(0), static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void silu_and_mul_cuda(const at::Tensor& out, const at::Tensor& gate_up) {
  check_silu_and_mul(out, gate_up, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t rows = out.size(0), inter = out.size(1);
  if (rows == 0) return;
  const int64_t chunks = (inter + kSiluThreads - 1) / kSiluThreads;
  TORCH_CHECK(chunks <= kMaxGridY, "silu_and_mul: intermediate size ", inter, " is over the kernel's limit of ",
              kMaxGridY * kSiluThreads);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = 16 / gate_up.element_size();
  if (packs_fit(inter, gate_up.element_size(), {gate_up.stride(0)}, {gate_up.data_ptr(), out.data_ptr()})) {
    const int64_t packs = inter / n;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((packs + kSiluThreads - 1) / kSiluThreads));
    UNIFIEDSERVE_DISPATCH_FUSED(gate_up.scalar_type(), "silu_and_mul_cuda", [&] {
      silu_and_mul_pack_kernel<scalar_t><<<grid, kSiluThreads, 0, stream>>>(out.data_ptr<scalar_t>(),
                                                                            gate_up.data_ptr<scalar_t>(), packs,
                                                                            gate_up.stride(0));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  UNIFIEDSERVE_DISPATCH_FUSED(gate_up.scalar_type(), "silu_and_mul_cuda", [&] {
    silu_and_mul_kernel<scalar_t><<<grid, kSiluThreads, 0, stream>>>(out.data_ptr<scalar_t>(),
                                                                     gate_up.data_ptr<scalar_t>(), inter,
                                                                     gate_up.stride(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rotary_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(q, k, cos, sin, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t rows = q.size(0), dim = q.size(2);
  if (rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = 16 / q.element_size();
  const bool packed = packs_fit(dim / 2, q.element_size(), {q.stride(0), q.stride(1), k.stride(0), k.stride(1)},
                                {q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr()});
  const int threads = threads_for((q.size(1) + k.size(1)) * dim / 2 / (packed ? n : 1));
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cuda", [&] {
    using T = scalar_t;
    auto launch = [&](auto* c, auto* s) {
      if (packed) {
        rotary_pack_kernel<<<rows, threads, 0, stream>>>(q.data_ptr<T>(), k.data_ptr<T>(), c, s, q.size(1),
                                                         k.size(1), q.stride(0), q.stride(1), k.stride(0),
                                                         k.stride(1), dim);
      } else {
        rotary_kernel<<<rows, threads, 0, stream>>>(q.data_ptr<T>(), k.data_ptr<T>(), c, s, q.size(1), k.size(1),
                                                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), dim);
      }
    };
    fused::with_tables<T>(cos, sin, launch);
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
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* sources = write_rows.has_value() ? write_rows->data_ptr<int64_t>() : nullptr;
  const int64_t n = 16 / q.element_size();
  const bool packed = packs_fit(dim / 2, q.element_size(),
                                {q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)},
                                {q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 k_cache.data_ptr(), v_cache.data_ptr()});
  const int threads = threads_for(std::max((q.size(1) + heads) * dim / 2, heads * dim) / (packed ? n : 1));
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cache_cuda", [&] {
    using T = scalar_t;
    auto launch = [&](auto* c, auto* s) {
      if (packed) {
        rotary_cache_pack_kernel<<<rows, threads, 0, stream>>>(
            q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), c, s, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
            slot_mapping.data_ptr<int64_t>(), sources, rows, k_cache.size(0), q.size(1), heads, q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dim);
        return;
      }
      rotary_cache_kernel<<<rows, threads, 0, stream>>>(
          q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), c, s, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
          slot_mapping.data_ptr<int64_t>(), sources, rows, k_cache.size(0), q.size(1), heads, q.stride(0),
          q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dim);
    };
    fused::with_tables<T>(cos, sin, launch);
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
