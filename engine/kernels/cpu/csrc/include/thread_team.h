// The threads of one parallel region that runs many kernels in turn (a decode step's whole layer
// stack, `decode_stack.cpp`): each kernel takes a `Team` and does this thread's part, and the
// region's barriers stand between kernels, in place of a fork and a join around each.
#pragma once

#include <algorithm>
#include <cstdint>

namespace conveyor {

struct Team {
  int id;    // this thread, in [0, size)
  int size;  // threads in the region
};

// This thread's rows [begin, end) of a pass over `n` rows, shared as `at::parallel_for(0, n,
// grain, ...)` shares them: all of them on the first thread when they are no more than `grain`,
// else contiguous runs of ceil(n / threads) to as many threads as have at least a grain each.
struct Share {
  int64_t begin, end;
};

// The region's barrier between one kernel's parts and the next's.
inline void barrier() {
#pragma omp barrier
}

inline Share share(const Team& team, int64_t n, int64_t grain) {
  if (n <= grain || team.size == 1) return team.id == 0 ? Share{0, n} : Share{0, 0};
  const int64_t grains = (n + grain - 1) / std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(team.size, grains);
  const int64_t chunk = (n + threads - 1) / threads;
  const int64_t begin = std::min(n, team.id * chunk);
  return Share{begin, std::min(n, begin + chunk)};
}

}  // namespace conveyor
