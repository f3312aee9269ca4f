// Scratch buffers a kernel fills before it reads them, allocated without the zeroing pass a
// std::vector would make first (on the calling thread alone, before the threads that fill it
// start: 64 rows of a decode step paid that pass serially before every product).
#pragma once

#include <cstdint>
#include <memory>

namespace conveyor {

template <typename T>
std::unique_ptr<T[]> scratch(int64_t count) {
  return std::unique_ptr<T[]>(new T[count]);
}

}  // namespace conveyor
