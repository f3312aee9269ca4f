// What a gated MLP makes of its gate and up values: silu(gate) * up, gelu(gate) * up under
// tanh's approximation (Gemma's) or gpt-oss's clamped SwiGLU, eight lanes at a time and one at
// a time in the same operations (`fast_exp.h`), so that a value does not depend on its lane.
// Shared by the activation's own pass (`silu_mul.cpp`), the products over gate/up panel pairs
// (`bf16_panels.cpp`) and the layer of experts (`expert_mlps.cpp`).
#pragma once

#include <cstdint>

#include "fast_exp.h"

namespace conveyor {

struct GateActivation {
  enum class Kind : uint8_t { kSilu, kGelu, kClamped };
  Kind kind = Kind::kSilu;
  // The clamped SwiGLU's sigmoid scale and clamp (`clamped_swiglu`).
  float alpha = 0.f, limit = 0.f;

  static GateActivation silu_or_gelu(bool gelu) {
    return {gelu ? Kind::kGelu : Kind::kSilu, 0.f, 0.f};
  }

  static GateActivation clamped(double alpha, double limit) {
    return {Kind::kClamped, static_cast<float>(alpha), static_cast<float>(limit)};
  }

  float operator()(float gate, float up) const {
    switch (kind) {
      case Kind::kGelu: return gelu_tanh(gate) * up;
      case Kind::kClamped: return clamped_swiglu(gate, up, alpha, limit);
      default: return silu(gate) * up;
    }
  }

#ifdef CONVEYOR_EXP8
  __m256 operator()(__m256 gate, __m256 up) const {
    switch (kind) {
      case Kind::kGelu: return _mm256_mul_ps(gelu_tanh8(gate), up);
      case Kind::kClamped: return clamped_swiglu8(gate, up, alpha, limit);
      default: return _mm256_mul_ps(silu8(gate), up);
    }
  }
#endif
};

// The activation of rows [begin, end) of x [rows, 2 * inter] (each row's gate, then its up)
// to out [rows, inter].
inline void gate_rows(const GateActivation& act, const float* x, float* out, int64_t inter,
                      int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const float* gate = x + row * 2 * inter;
    const float* up = gate + inter;
    float* o = out + row * inter;
    int64_t i = 0;
#ifdef CONVEYOR_EXP8
    for (; i + 8 <= inter; i += 8)
      _mm256_storeu_ps(o + i, act(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
#endif
    for (; i < inter; ++i) o[i] = act(gate[i], up[i]);
  }
}

}  // namespace conveyor
