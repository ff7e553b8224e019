// AMX's tiles as both attention kernels use them (cpu_ops.cpp: decodes; cpu_prefill_attention.cpp:
// long prefill chunks): built where the compiler targets AMX-BF16 (Sapphire Rapids on), used where the
// OS lends the tiles. Each kernel keeps its own switch (tests compare it on and off).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TRITONLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(TRITONLLM_AMX)
// Linux hands out AMX's 8 KiB of tile state only to a process that asks for it (once, for all its threads).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t columns_bytes[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.columns_bytes[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}
#endif

// A kernel's switch: whether it runs on tiles (built for them, switched on, the OS lending them).
class AmxSwitch {
 public:
  bool on() const {
#if defined(TRITONLLM_AMX)
    return enabled_ && amx_permitted();
#else
    return false;
#endif
  }
  // `enable`: 1 on, 0 off, -1 as it is; returns on().
  int64_t set(int64_t enable) {
    if (enable >= 0) enabled_ = enable != 0;
    return on();
  }

 private:
  std::atomic<bool> enabled_{true};
};

}  // namespace
