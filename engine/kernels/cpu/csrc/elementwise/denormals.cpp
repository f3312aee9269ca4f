// Subnormal floats flushed to zero (FTZ) and read as zero (DAZ) on the calling thread and on
// every thread of its team for torch's parallel ops.
//
// x86 cores take a slow path, about a hundred cycles, for each arithmetic op that reads or
// produces a subnormal float. A model's arithmetic makes them where factors decay: a linear
// attention's decays over a chunk of tokens (exp of sums of negative gates) reach below fp32's
// smallest normal number, 1.2e-38, and every product over them then runs several times slower.
// The mode is a bit of each thread's MXCSR register, so it is set on each thread that computes;
// threads started later copy their starter's.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace {

#if defined(__SSE2__)
constexpr unsigned kFlushToZero = 0x8000;       // MXCSR.FTZ
constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR.DAZ

void set_mode(bool on) {
  const unsigned bits = kFlushToZero | kDenormalsAreZero;
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | bits) : (csr & ~bits));
}
#else
void set_mode(bool) {}
#endif

}  // namespace

namespace conveyor {

// The number of threads the mode was set on (0 where the CPU has no such mode).
int64_t flush_denormals(bool on) {
#if defined(__SSE2__)
  set_mode(on);
  std::atomic<int64_t> threads{0};
  const int64_t team = at::get_num_threads();
  at::parallel_for(0, team, 1, [&](int64_t begin, int64_t end) {
    set_mode(on);
    threads += end - begin;
  });
  return std::max<int64_t>(threads.load(), 1);
#else
  (void)on;
  return 0;
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("flush_denormals(bool on) -> int", &conveyor::flush_denormals);
}
