// Fused layer ops of the language model, CPU kernels (schemas in ops.cpp, shared checks and arithmetic in
// fused_ops.h, CUDA kernels in fused_ops_cuda.cu, torch reference in unifiedserve/ops/reference.py):
//
//   rms_norm(out, x, weight, eps)            out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
//   fused_add_rms_norm(x, residual, w, eps)  residual = x + residual; x = rms_norm(residual)   (in place)
//   silu_and_mul(out, gate_up)               out = silu(gate) * up, gate_up = [gate | up]   (CUDA only)
//   rotary_(q, k, cos, sin)                  q = q * cos + rotate_half(q) * sin, same for k    (in place)
//   rotary_cache_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows?)
//                                            rotary_ on q in place; the rotated k and v of row r (of row
//                                            write_rows[r] when given) into slot slot_mapping[r] of the caches
//
// silu_and_mul has no CPU kernel: torch's own silu and mul are vectorised (Sleef's exp) and beat a fused
// loop with a scalar exp on the CPU (0.3-0.9x, bench/kernels/bench_fused_ops.py), so the Python wrapper
// sends CPU tensors to the reference. Its checks live here with the others, for the CUDA kernel.
//
// Each replaces several torch ops of the decoder layer (eight for an RMSNorm, ten for a rotary) by one
// pass over the row; on the CPU that saves the per-op dispatch, which dominates a small model's decode
// step, and on the GPU the launches and HBM round trips between them. Rows are split over threads with
// at::parallel_for.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "check_msg.h"
#include "fused_ops.h"

namespace unifiedserve {

void check_fused_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  US_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", dtype);
}

static void check_device(const at::Tensor& t, const char* name, c10::DeviceType device_type) {
  US_CHECK(t.device().type() == device_type, name, " must be on ", c10::DeviceTypeName(device_type),
              " for this kernel, got ", t.device());
}

static void check_same(const at::Tensor& t, const at::Tensor& like, const char* name, const char* like_name) {
  US_CHECK(t.device() == like.device(), name, " is on ", t.device(), " but ", like_name, " is on ", like.device());
  US_CHECK(t.scalar_type() == like.scalar_type(), name, " is ", t.scalar_type(), " but ", like_name, " is ",
              like.scalar_type());
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps, c10::DeviceType device_type) {
  check_device(x, "x", device_type);
  check_fused_dtype(x, "x");
  US_CHECK(x.dim() == 2, "x must be [N, hidden], got shape ", x.sizes());
  US_CHECK(x.size(1) > 0, "x's hidden size must be positive, got shape ", x.sizes());
  US_CHECK(x.stride(1) == 1, "x's last dim must be contiguous");
  check_same(weight, x, "weight", "x");
  US_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [", x.size(1), "], got shape ",
              weight.sizes());
  US_CHECK(weight.is_contiguous(), "weight must be contiguous");
  US_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
}

void check_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                    c10::DeviceType device_type) {
  check_norm_args(x, weight, eps, device_type);
  check_same(out, x, "out", "x");
  US_CHECK(out.sizes() == x.sizes(), "out must be shaped like x ", x.sizes(), ", got ", out.sizes());
  US_CHECK(out.is_contiguous(), "out must be contiguous");
}

void check_fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                              double eps, c10::DeviceType device_type) {
  check_norm_args(x, weight, eps, device_type);
  check_same(residual, x, "residual", "x");
  US_CHECK(residual.sizes() == x.sizes(), "residual must be shaped like x ", x.sizes(), ", got ",
              residual.sizes());
  US_CHECK(residual.stride(1) == 1, "residual's last dim must be contiguous");
}

void check_silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up, c10::DeviceType device_type) {
  check_device(gate_up, "gate_up", device_type);
  check_fused_dtype(gate_up, "gate_up");
  US_CHECK(gate_up.dim() == 2 && gate_up.size(1) > 0 && gate_up.size(1) % 2 == 0,
              "gate_up must be [N, 2 * intermediate] with intermediate > 0, got shape ", gate_up.sizes());
  US_CHECK(gate_up.stride(1) == 1, "gate_up's last dim must be contiguous");
  check_same(out, gate_up, "out", "gate_up");
  US_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2,
              "out must be [", gate_up.size(0), ", ", gate_up.size(1) / 2, "], got shape ", out.sizes());
  US_CHECK(out.is_contiguous(), "out must be contiguous");
}

void check_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                  c10::DeviceType device_type) {
  check_device(q, "q", device_type);
  check_fused_dtype(q, "q");
  US_CHECK(q.dim() == 3, "q must be [N, heads, head_dim], got shape ", q.sizes());
  US_CHECK(q.size(2) > 0 && q.size(2) % 2 == 0, "head_dim must be even and positive, got shape ", q.sizes());
  check_same(k, q, "k", "q");
  US_CHECK(k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2), "k must be [", q.size(0),
              ", heads, ", q.size(2), "], got shape ", k.sizes());
  US_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q's and k's last dims must be contiguous");
  for (const auto* pair : {&cos, &sin}) {
    const at::Tensor& t = *pair;
    const char* name = pair == &cos ? "cos" : "sin";
    US_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
    US_CHECK(t.scalar_type() == q.scalar_type() || t.scalar_type() == at::kFloat, name, " must be float32 or ",
                q.scalar_type(), " (q's dtype), got ", t.scalar_type());
    US_CHECK(t.dim() == 2 && t.size(0) == q.size(0) && t.size(1) == q.size(2), name, " must be [", q.size(0),
                ", ", q.size(2), "], got shape ", t.sizes());
    US_CHECK(t.is_contiguous(), name, " must be contiguous");
  }
  US_CHECK(cos.scalar_type() == sin.scalar_type(), "cos and sin must share a dtype, got ", cos.scalar_type(),
              " and ", sin.scalar_type());
}

void check_rotary_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& write_rows,
                        c10::DeviceType device_type) {
  check_rotary(q, k, cos, sin, device_type);
  check_same(v, k, "v", "k");
  US_CHECK(v.sizes() == k.sizes(), "v must be shaped like k ", k.sizes(), ", got ", v.sizes());
  US_CHECK(v.stride(2) == 1, "v's last dim must be contiguous");
  for (const auto* pair : {&k_cache, &v_cache}) {
    const at::Tensor& c = *pair;
    const char* name = pair == &k_cache ? "k_cache" : "v_cache";
    check_same(c, k, name, "k");
    US_CHECK(c.dim() == 3 && c.size(1) == k.size(1) && c.size(2) == k.size(2), name, " must be [slots, ",
                k.size(1), ", ", k.size(2), "], got shape ", c.sizes());
    US_CHECK(c.is_contiguous(), name, " must be contiguous");
  }
  US_CHECK(v_cache.size(0) == k_cache.size(0), "k_cache and v_cache must have as many slots, got ",
              k_cache.size(0), " and ", v_cache.size(0));
  const int64_t rows = q.size(0);
  auto check_index = [&](const at::Tensor& t, const char* name) {
    US_CHECK(t.device() == q.device(), name, " is on ", t.device(), " but q is on ", q.device());
    US_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
    US_CHECK(t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), name, " must be a contiguous [", rows,
                "], got shape ", t.sizes());
  };
  check_index(slot_mapping, "slot_mapping");
  if (write_rows.has_value()) check_index(*write_rows, "write_rows");
}

namespace {

// Rows per parallel task: about 16K elements each, so that thread start-up does not dominate small rows.
int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(1, row_elements));
}

template <typename T>
float sum_squares(const T* row, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes: vectorisable, and closer to torch's pairwise sum
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const float v = static_cast<float>(row[i + l]);
      acc[l] += v * v;
    }
  }
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    total += v * v;
  }
  return total;
}

void rms_norm_cpu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(out, x, weight, eps, c10::DeviceType::CPU);
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = src + r * stride;
        scalar_t* o = dst + r * hidden;
        const float inv = fused::inv_rms(sum_squares(row, hidden), hidden, static_cast<float>(eps));
        for (int64_t i = 0; i < hidden; ++i) o[i] = fused::rms_scale<scalar_t>(static_cast<float>(row[i]), inv, w[i]);
      }
    });
  });
}

void fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_fused_add_rms_norm(x, residual, weight, eps, c10::DeviceType::CPU);
  const int64_t rows = x.size(0), hidden = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  UNIFIEDSERVE_DISPATCH_FUSED(x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* rs = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xs + r * x_stride;
        scalar_t* rr = rs + r * r_stride;
        for (int64_t i = 0; i < hidden; ++i)
          rr[i] = static_cast<scalar_t>(fused::add_rn(static_cast<float>(xr[i]), static_cast<float>(rr[i])));
        const float inv = fused::inv_rms(sum_squares(rr, hidden), hidden, static_cast<float>(eps));
        for (int64_t i = 0; i < hidden; ++i) xr[i] = fused::rms_scale<scalar_t>(static_cast<float>(rr[i]), inv, w[i]);
      }
    });
  });
}

template <typename T, typename C>
void rotate_heads_cpu(T* base, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t dim,
                      const C* cos, const C* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const C* c = cos + r * dim;
      const C* s = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = base + r * row_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i)
          fused::rotate_pair(x + i, x + i + half, x + i, x + i + half, c[i], s[i], c[i + half], s[i + half]);
      }
    }
  });
}

void rotary_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(q, k, cos, sin, c10::DeviceType::CPU);
  const int64_t dim = q.size(2);
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cpu", [&] {
    using T = scalar_t;
    auto run = [&](auto* c, auto* s) {
      rotate_heads_cpu(q.data_ptr<T>(), q.size(0), q.size(1), q.stride(0), q.stride(1), dim, c, s);
      rotate_heads_cpu(k.data_ptr<T>(), k.size(0), k.size(1), k.stride(0), k.stride(1), dim, c, s);
    };
    fused::with_tables<T>(cos, sin, run);
  });
}

void rotary_cache_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& write_rows) {
  check_rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows, c10::DeviceType::CPU);
  // every index before any byte moves (the values are on the host here)
  const int64_t rows = q.size(0), slots = k_cache.size(0);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t* source = write_rows.has_value() ? write_rows->data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    US_CHECK(slot[r] >= 0 && slot[r] < slots, "slot_mapping[", r, "] = ", slot[r], " is outside the cache's ",
                slots, " slots");
    US_CHECK(source == nullptr || (source[r] >= 0 && source[r] < rows), "write_rows[", r, "] = ",
                source ? source[r] : 0, " is not a row of q (", rows, " rows)");
  }
  const int64_t heads = k.size(1), dim = q.size(2), half = dim / 2;
  UNIFIEDSERVE_DISPATCH_FUSED(q.scalar_type(), "rotary_cache_cpu", [&] {
    using T = scalar_t;
    auto run = [&](auto* c, auto* s) {
      rotate_heads_cpu(q.data_ptr<T>(), rows, q.size(1), q.stride(0), q.stride(1), dim, c, s);
      const T* ks = k.data_ptr<T>();
      const T* vs = v.data_ptr<T>();
      T* kc = k_cache.data_ptr<T>();
      T* vc = v_cache.data_ptr<T>();
      // the rotated k goes into its slot (k itself is left as it was: a padding row reads row 0's k)
      at::parallel_for(0, rows, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t src = source ? source[r] : r;
          const auto* cr = c + src * dim;  // row src's own rotation: a padding row repeats row 0's write exactly
          const auto* sr = s + src * dim;
          for (int64_t h = 0; h < heads; ++h) {
            const T* kin = ks + src * k.stride(0) + h * k.stride(1);
            T* kout = kc + (slot[r] * heads + h) * dim;
            for (int64_t i = 0; i < half; ++i)
              fused::rotate_pair(kin + i, kin + i + half, kout + i, kout + i + half, cr[i], sr[i], cr[i + half],
                                 sr[i + half]);
            std::copy_n(vs + src * v.stride(0) + h * v.stride(1), dim, vc + (slot[r] * heads + h) * dim);
          }
        }
      });
    };
    fused::with_tables<T>(cos, sin, run);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
  m.impl("rotary_", &rotary_cpu);
  m.impl("rotary_cache_", &rotary_cache_cpu);
}

}  // namespace unifiedserve
