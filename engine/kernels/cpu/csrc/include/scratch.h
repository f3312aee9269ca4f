// Scratch buffers a kernel fills before it reads them, allocated without the zeroing pass a
// std::vector would make first (on the calling thread alone, before the threads that fill it
// start: 64 rows of a decode step paid that pass serially before every product), and aligned to
// a cache line: an AMX tile load of rows that straddle lines took about six times as long.
#pragma once

#include <cstdint>
#include <memory>
#include <new>

namespace conveyor {

constexpr std::align_val_t kLineAlign{64};

struct AlignedDelete {
  template <typename T>
  void operator()(T* p) const {
    ::operator delete[](p, kLineAlign);
  }
};

// Values of a plain type (integers, floats), left unset.
template <typename T>
using Scratch = std::unique_ptr<T[], AlignedDelete>;

template <typename T>
Scratch<T> scratch(int64_t count) {
  return Scratch<T>(static_cast<T*>(::operator new[](count * sizeof(T), kLineAlign)));
}

}  // namespace conveyor
