// New K/V rows to their slots of one layer's paged cache, rounded to the cache's dtype (fp32,
// bf16, fp16 or fp8 e5m2) as torch rounds: the attention backend's store for a prefill step
// (`torch.ops.conveyor.store_kv`), and the routine the fused decode layers store through.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"

namespace {

// New tokens a thread stores at least, when a step stores many (a prefill's).
constexpr int64_t kStoreGrain = 256;

// Copies rows [begin, end)'s new K (or V), `kv_heads * dim` floats at `src + row * src_stride`,
// to their slots of one layer's cache, rounded to the nearest value of a 16- or 8-bit cache as
// torch rounds.
template <typename C>
void store_rows(const float* src, int64_t src_stride, const int64_t* slots, int64_t begin,
                int64_t end, int64_t row_size, C* cache) {
  for (int64_t r = begin; r < end; ++r) {
    const float* in = src + r * src_stride;
    C* out = cache + slots[r] * row_size;
    if constexpr (std::is_same_v<C, float>) {
      std::memcpy(out, in, row_size * sizeof(float));
    } else {
      for (int64_t i = 0; i < row_size; ++i) out[i] = static_cast<C>(in[i]);
    }
  }
}

template <typename C>
void store_both(const float* key_rows, int64_t key_stride, const float* value_rows,
                int64_t value_stride, const int64_t* slots, int64_t begin, int64_t end,
                int64_t row_size, at::Tensor& key, at::Tensor& value) {
  store_rows(key_rows, key_stride, slots, begin, end, row_size, key.data_ptr<C>());
  store_rows(value_rows, value_stride, slots, begin, end, row_size, value.data_ptr<C>());
}

}  // namespace

namespace conveyor {

void store_kv(const float* key_rows, int64_t key_stride, const float* value_rows,
              int64_t value_stride, const int64_t* slots, int64_t begin, int64_t end,
              int64_t row_size, at::Tensor& key, at::Tensor& value) {
  switch (key.scalar_type()) {
    case at::kFloat:
      store_both<float>(key_rows, key_stride, value_rows, value_stride, slots, begin, end, row_size,
                        key, value);
      break;
    case at::kBFloat16:
      store_both<c10::BFloat16>(key_rows, key_stride, value_rows, value_stride, slots, begin, end,
                                row_size, key, value);
      break;
    case at::kFloat8_e5m2:
      store_both<c10::Float8_e5m2>(key_rows, key_stride, value_rows, value_stride, slots, begin,
                                   end, row_size, key, value);
      break;
    default:
      store_both<c10::Half>(key_rows, key_stride, value_rows, value_stride, slots, begin, end,
                            row_size, key, value);
  }
}

// One layer's cache as the ops store into it and read it: K and V of one shape and dtype.
void check_cache(const at::Tensor& key, const at::Tensor& value, const char* op) {
  const auto dtype = key.scalar_type();
  TORCH_CHECK(key.dim() == 4 && value.sizes() == key.sizes() && value.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                   dtype == at::kFloat8_e5m2) &&
                  key.is_contiguous() && value.is_contiguous(),
              op,
              ": the cache must be contiguous fp32, bf16, fp16 or fp8 (e5m2) "
              "[blocks, block_size, kv_heads, dim]");
}

// One int64 slot per row, each inside a cache of `key`'s size.
void check_slots(const at::Tensor& slots, int64_t rows, const at::Tensor& key, const char* op) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              op, ": one int64 slot per row");
  const int64_t capacity = key.size(0) * key.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(s[r] >= 0 && s[r] < capacity, op, ": slot out of range");
}

}  // namespace conveyor

namespace {

// New K and V [tokens, kv_heads, dim] fp32 (rows may be strided; heads and dims contiguous) to
// their slots of one layer's cache, rounded to its dtype as torch rounds: a prefill step's
// store, in place of a cast and an index copy each.
void store_new_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, const at::Tensor& slots) {
  conveyor::check_cache(key_cache, value_cache, "store_kv");
  for (const at::Tensor* rows : {&key, &value})
    TORCH_CHECK(rows->dim() == 3 && rows->scalar_type() == at::kFloat &&
                    rows->size(1) == key_cache.size(2) && rows->size(2) == key_cache.size(3) &&
                    rows->stride(2) == 1 && rows->stride(1) == rows->size(2),
                "store_kv: new K and V must be fp32 [tokens, kv_heads, dim] with heads and "
                "dims contiguous, as the cache holds them");
  const int64_t tokens = key.size(0);
  TORCH_CHECK(value.size(0) == tokens, "store_kv: new K and V must have one row per token");
  conveyor::check_slots(slots, tokens, key_cache, "store_kv");
  const int64_t* s = slots.data_ptr<int64_t>();
  at::parallel_for(0, tokens, kStoreGrain, [&](int64_t begin, int64_t end) {
    conveyor::store_kv(key.data_ptr<float>(), key.stride(0), value.data_ptr<float>(),
                       value.stride(0), s, begin, end, key.size(1) * key.size(2), key_cache,
                       value_cache);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slots) -> ()");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("store_kv", &store_new_kv); }
