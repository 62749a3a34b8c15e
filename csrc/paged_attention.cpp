// Decode attention over the paged KV cache, CPU kernel (schema in ops.cpp, torch reference in
// unifiedserve/ops/reference.py: gather the keys, then SDPA):
//
//   paged_decode_attention(q, k_cache, v_cache, slots, valid, scale) -> out
//     q [B, Hq, D] (one new token per sequence; last dim contiguous), k_cache/v_cache [S, Hkv, D] contiguous,
//     slots int64 [B, L] (cache slot of key position l of sequence b), valid bool [B, L] (which positions
//     count), out [B, Hq, D]: softmax(q . k * scale) . v over the valid positions, per head; query head h
//     reads KV head h / (Hq / Hkv) (grouped-query attention).
//
// The reference gathers every sequence's keys and values into new [B, L, Hkv, D] tensors before SDPA: two
// copies of the whole context per layer per step, which dominate a CPU decode step once contexts are long
// (a video's 20k+ tokens). This kernel reads each key and value row where it lies, once per KV head for all
// the query heads that share it. Scores are kept per (query head, position) in float32 and normalised with
// the max subtracted, as SDPA does; the result matches it to float32 rounding, not bit for bit.
//
// The slots are checked (in range, on valid positions) before anything is computed, so a bad index raises.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "check_msg.h"

namespace unifiedserve {
namespace {

void check_decode_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slots, const at::Tensor& valid) {
  US_CHECK(q.device().is_cpu(), "paged_decode_attention: this kernel runs on CPU tensors, got ", q.device());
  const auto dtype = q.scalar_type();
  US_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "q must be float32, bfloat16 or float16, got ", dtype);
  US_CHECK(q.dim() == 3 && q.size(2) > 0, "q must be [B, q_heads, head_dim], got shape ", q.sizes());
  US_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  for (const auto* pair : {&k_cache, &v_cache}) {
    const at::Tensor& c = *pair;
    const char* name = pair == &k_cache ? "k_cache" : "v_cache";
    US_CHECK(c.device() == q.device(), name, " is on ", c.device(), " but q is on ", q.device());
    US_CHECK(c.scalar_type() == dtype, name, " is ", c.scalar_type(), " but q is ", dtype);
    US_CHECK(c.dim() == 3 && c.size(2) == q.size(2) && c.size(1) > 0, name, " must be [slots, kv_heads, ",
                q.size(2), "], got shape ", c.sizes());
    US_CHECK(c.is_contiguous(), name, " must be contiguous");
  }
  US_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must be shaped like k_cache ", k_cache.sizes(), ", got ",
              v_cache.sizes());
  US_CHECK(q.size(1) % k_cache.size(1) == 0, "q_heads (", q.size(1), ") must be a multiple of kv_heads (",
              k_cache.size(1), ")");
  US_CHECK(slots.device() == q.device() && slots.scalar_type() == at::kLong && slots.dim() == 2 &&
                  slots.size(0) == q.size(0) && slots.is_contiguous(),
              "slots must be a contiguous int64 [", q.size(0), ", L] on q's device, got ", slots.scalar_type(), " ",
              slots.sizes());
  US_CHECK(valid.device() == q.device() && valid.scalar_type() == at::kBool && valid.sizes() == slots.sizes() &&
                  valid.is_contiguous(),
              "valid must be a contiguous bool tensor shaped like slots ", slots.sizes(), ", got ",
              valid.scalar_type(), " ", valid.sizes());
}

// q . k in float32 with 8 independent partial sums: vectorisable without reassociating a single sum
// (the build keeps strict float semantics), and the same order on every call.
template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += q[d + l] * static_cast<float>(k[d + l]);
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; d < dim; ++d) total += q[d] * static_cast<float>(k[d]);
  return total;
}

// acc += p * value over one head's row (restrict: the accumulator never aliases the cache, so it vectorises)
template <typename T>
inline void axpy(float* __restrict__ acc, float p, const T* __restrict__ value, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(value[d]);
}

template <typename T>
void decode_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slots, const at::Tensor& valid, float scale) {
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t group = q_heads / kv_heads, len = slots.size(1);
  const T* qs = q.data_ptr<T>();
  const T* ks = k_cache.data_ptr<T>();
  const T* vs = v_cache.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* ok = valid.data_ptr<bool>();
  T* os = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  // one task per (sequence, KV head): its group of query heads share every key and value row read
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), scores, acc(group * dim);
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = static_cast<float>(qs[b * q_row + (h * group + g) * q_head + d]);
      rows.clear();
      for (int64_t l = 0; l < len; ++l)
        if (ok[b * len + l]) rows.push_back(sl[b * len + l] * kv_heads + h);  // row of [S * Hkv, D]
      const int64_t n = static_cast<int64_t>(rows.size());
      scores.assign(group * n, 0.0f);
      for (int64_t t = 0; t < n; ++t) {
        const T* key = ks + rows[t] * dim;
        for (int64_t g = 0; g < group; ++g) {
          scores[g * n + t] = dot(query.data() + g * dim, key, dim) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::vector<float> total(group, 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) top = std::max(top, sg[t]);
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - top);
          total[g] += sg[t];
        }
      }
      for (int64_t t = 0; t < n; ++t) {
        const T* __restrict__ value = vs + rows[t] * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          axpy(acc.data() + g * dim, p, value, dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        // no valid position (never so for a decode row, which sees itself): zeros, as torch's SDPA gives
        const float inv = n > 0 ? 1.0f / total[g] : 0.0f;
        T* o = os + (b * q_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& slots, const at::Tensor& valid, double scale) {
  check_decode_args(q, k_cache, v_cache, slots, valid);
  US_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  const int64_t num_slots = k_cache.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* ok = valid.data_ptr<bool>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    US_CHECK(!ok[i] || (sl[i] >= 0 && sl[i] < num_slots), "slots[", i / slots.size(1), ", ", i % slots.size(1),
                "] = ", sl[i], " is outside the cache's ", num_slots, " slots");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode_attention_cpu",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       decode_attention<scalar_t>(out, q, k_cache, v_cache, slots, valid, static_cast<float>(scale));
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       decode_attention<scalar_t>(out, q, k_cache, v_cache, slots, valid, static_cast<float>(scale));
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       decode_attention<scalar_t>(out, q, k_cache, v_cache, slots, valid, static_cast<float>(scale));
                     }));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(unifiedserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_cpu);
}

}  // namespace unifiedserve
