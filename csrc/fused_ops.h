// Fused layer ops of the language model (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary): what
// the CPU kernels (fused_ops.cpp) and the CUDA kernels (fused_ops_cuda.cu) share. That is the metadata
// checks, so both reject exactly the same inputs, and the per-element arithmetic, so both round exactly
// where the torch reference (unifiedserve/ops/reference.py) rounds.
//
// Rounding. The reference is the model's unfused torch code, in which every op reads and writes the
// model dtype: `x * cos` is rounded to bf16 before `+ rotate_half(x) * sin` is added to it. The fused
// kernels compute in float32 and round to the storage dtype after each op the reference rounds after
// (rnd<T>), so for float32 they give the reference's bits and for bf16/fp16 the same roundings. Products
// and sums go through mul_rn/add_rn, which are never contracted into a fused multiply-add (nvcc contracts
// by default and g++ does at -O3 unless -ffp-contract=off): a fused multiply-add rounds once where the
// reference rounds twice. Only the RMSNorm's sum of squares may differ from the reference in its last
// bits, because it is summed in another order.

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

// The three storage dtypes the kernels cover (ATen's FLOATING_TYPES_AND2 would also build float64 ones).
#define UNIFIEDSERVE_DISPATCH_FUSED(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)      \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace unifiedserve {
namespace fused {

template <typename T>
C10_HOST_DEVICE inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));  // round to nearest even in T, back to float (exact)
}

template <>
C10_HOST_DEVICE inline float rnd<float>(float v) {
  return v;
}

C10_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

C10_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// torch's silu: x / (1 + exp(-x)) in float32 (ATen's CPU and CUDA kernels), then the store's rounding.
C10_HOST_DEVICE inline float silu(float x) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
#else
  return x / (1.0f + std::exp(-x));
#endif
}

// One output of RMSNorm given the row's 1/rms: `weight * (x * inv_rms).to(T)` as Qwen2RMSNorm computes it.
template <typename T>
C10_HOST_DEVICE inline T rms_scale(float x, float inv_rms, T weight) {
  return static_cast<T>(mul_rn(static_cast<float>(weight), rnd<T>(mul_rn(x, inv_rms))));
}

// 1 / sqrt(mean + eps), rounded as torch's rsqrt (a correctly rounded sqrt, then a correctly rounded divide).
C10_HOST_DEVICE inline float inv_rms(float sum_squares, int64_t hidden, float eps) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, static_cast<float>(hidden)), eps)));
#else
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
#endif
}

// Rotary of one (first-half, second-half) pair: `x * cos + rotate_half(x) * sin` with the products and the
// sum rounded to C (the dtype of cos/sin: the model dtype for the language model) and the result to T.
// `in_*` and `out_*` may be the same (in place): both inputs are read before either output is written.
template <typename T, typename C>
C10_HOST_DEVICE inline void rotate_pair(const T* in_lo, const T* in_hi, T* lo, T* hi, C cos_lo, C sin_lo, C cos_hi,
                                        C sin_hi) {
  const float a = static_cast<float>(*in_lo);
  const float b = static_cast<float>(*in_hi);
  const float new_lo = rnd<C>(add_rn(rnd<C>(mul_rn(a, static_cast<float>(cos_lo))),
                                     rnd<C>(mul_rn(-b, static_cast<float>(sin_lo)))));
  const float new_hi = rnd<C>(add_rn(rnd<C>(mul_rn(b, static_cast<float>(cos_hi))),
                                     rnd<C>(mul_rn(a, static_cast<float>(sin_hi)))));
  *lo = static_cast<T>(new_lo);
  *hi = static_cast<T>(new_hi);
}

// Calls f(cos_ptr, sin_ptr) with the rotary tables typed as they are: float32, or T (the model dtype).
// check_rotary has already refused any other dtype.
template <typename T, typename F>
void with_tables(const at::Tensor& cos, const at::Tensor& sin, F&& f) {
  if (cos.scalar_type() == at::kFloat) {
    f(cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    f(cos.data_ptr<T>(), sin.data_ptr<T>());
  }
}

}  // namespace fused

// ---- metadata checks (host side; no tensor value is read) -------------------------------------------

void check_fused_dtype(const at::Tensor& t, const char* name);

// x [N, H] (last dim contiguous), weight [H] (contiguous, x's dtype), on x's device; eps finite and >= 0.
void check_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps, c10::DeviceType device_type);

// out and x [N, H]: out contiguous, same dtype and device.
void check_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                    c10::DeviceType device_type);

// x and residual [N, H], last dims contiguous, same dtype and device.
void check_fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                              double eps, c10::DeviceType device_type);

// rotary_cache_: check_rotary's q/k/cos/sin; v like k; caches [slots, Hk, D] contiguous in k's dtype; slot_mapping
// and write_rows (optional) int64 [N] contiguous; all on q's device.
void check_rotary_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& write_rows,
                        c10::DeviceType device_type);

// gate_up [N, 2I] (last dim contiguous), out [N, I] contiguous, same dtype and device.
void check_silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up, c10::DeviceType device_type);

// q [N, Hq, D], k [N, Hk, D] (last dims contiguous, same dtype), cos and sin [N, D] contiguous, in q's dtype
// or float32; D even.
void check_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                  c10::DeviceType device_type);

}  // namespace unifiedserve
