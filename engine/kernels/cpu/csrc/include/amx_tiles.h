// AMX tiles for the bf16 panel products (`bf16_panels.cpp`): whether this process may use them,
// and the one tile layout the products load.
//
// Linux hands a process the tile registers' state only once it asks (arch_prctl with
// ARCH_REQ_XCOMP_PERM); before that, the first tile instruction faults. The ask is made once
// per process. The layout is a thread's own state, and other code on the same thread (oneDNN's
// products) loads layouts of its own, so a product loads its layout each time a thread starts
// its part and releases the tiles when the part is done.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define CONVEYOR_AMX_TILES 1

namespace conveyor {

// Rows (of sums and of x) a tile holds, and bf16 values of a row of x one tile step covers.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileDepth = 32;

// True once the kernel has granted this process the tile state (asked for on the first call).
inline bool tiles_granted() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// Eight tiles of 16 rows by 64 bytes: tiles 0-3 hold 16 x 16 fp32 sums, 4-5 16 rows of 32 bf16
// inputs, 6-7 16 pairs of input features of a panel's 16 columns.
inline void load_tile_layout() {
  struct alignas(64) Layout {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } layout{};
  layout.palette = 1;
  for (int t = 0; t < 8; ++t) {
    layout.bytes_per_row[t] = 64;
    layout.rows[t] = kTileRows;
  }
  _tile_loadconfig(&layout);
}

}  // namespace conveyor
#endif
