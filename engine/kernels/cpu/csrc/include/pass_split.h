// How finely the small passes of a step (RMSNorm, rotary, rounding rows for a product, the gated
// activation) split over threads. In a decode step the other threads have nothing else to do
// while one of these runs, so a pass of a few rows is worth splitting once each thread gets a
// few thousand values: at 16 rows of the default model the rounding, RMSNorm and rotary passes
// each ran on the calling thread alone while the other thread waited; split, the other thread's
// idle share of a decode step fell from 23% to 16%.
#pragma once

#include <algorithm>
#include <cstdint>

namespace conveyor {

// The fewest values a task of such a pass takes.
constexpr int64_t kTaskValues = 4096;

// Rows per task for a pass over rows of `row_values` values each.
inline int64_t rows_per_task(int64_t row_values) {
  return std::max<int64_t>(1, kTaskValues / std::max<int64_t>(row_values, 1));
}

}  // namespace conveyor
