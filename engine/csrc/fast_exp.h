// exp(x) in plain arithmetic, so that loops calling it vectorize (a call to the C library's exp
// would not). Range reduction to 2^n * exp(r), |r| <= ln2/2, then a degree-6 polynomial:
// relative error below 2e-7. Inputs are clamped to where fp32 neither overflows nor goes
// subnormal; shared by the attention softmax and the gated activation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace conveyor {

inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace conveyor
