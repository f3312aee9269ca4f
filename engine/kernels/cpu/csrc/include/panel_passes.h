// How the panel products (`panel_linear.cpp`, `int8_panels.cpp`) cut rows of activations: into
// chunks that stay in L2 while each panel of a thread's share passes over them, and within a
// chunk into passes of a few rows that one micro kernel call holds in registers.
#pragma once

#include <algorithm>
#include <cstdint>

// For the micro kernels' helpers, so that their accumulators stay in registers.
#define CONVEYOR_INLINE inline __attribute__((always_inline))

namespace conveyor {

// Output columns per panel.
constexpr int64_t kPanel = 16;

// Rows per chunk: about `chunk_bytes` of rows of `row_bytes` each, a whole number of passes of
// `max_rows` (at least one).
inline int64_t chunk_rows(int64_t row_bytes, int64_t chunk_bytes, int64_t max_rows) {
  return std::max<int64_t>(max_rows, chunk_bytes / row_bytes / max_rows * max_rows);
}

// pass(first row, rows) over [m0, m0 + rows) in passes of at most max_rows, of near-equal size:
// 13 rows at 6 go as 5 + 4 + 4, not 6 + 6 + 1, so that every pass keeps enough multiply-adds in
// flight.
template <typename Pass>
inline void near_equal_passes(int64_t m0, int64_t rows, int64_t max_rows, Pass&& pass) {
  const int64_t passes = (rows + max_rows - 1) / max_rows;
  for (int64_t i = 0, m = m0; i < passes; ++i) {
    const int64_t count = rows / passes + (i < rows % passes ? 1 : 0);
    pass(m, count);
    m += count;
  }
}

}  // namespace conveyor
