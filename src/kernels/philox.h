// NOTE [Counter-based normals]
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011;
// the generator of Random123 and cuRAND) maps a 128-bit counter and a 64-bit key to 128
// random bits with no state, so any element of a stream is computed on its own, by any
// thread, on any device. A round multiplies counter words 0 and 2 by 0xD2511F53 and
// 0xCD9E8D57, swaps the halves and folds in the key,
//   (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)),
// and the key is bumped by the Weyl constants (0x9E3779B9, 0xBB67AE85) between rounds: ten
// rounds, nine bumps (Random123's kat_vectors check it, tests/cpu/test_ops_random_normal.cpp).
//
// Normal number k of the stream `seed` (ops/random_normal.h) is defined exactly as:
//   b = k / 4 (the block), key = (seed mod 2^32, seed / 2^32),
//   (x0, x1, x2, x3) = Philox4x32-10(counter (b mod 2^32, b / 2^32, 0, 0), key),
//   numbers 4b, 4b+1 = box_muller(x0, x1), numbers 4b+2, 4b+3 = box_muller(x2, x3), where
//   box_muller(a, c) = (r cos theta, r sin theta), r = sqrt(-2 ln u), theta = 2 pi v,
//   u = (floor(a / 2^8) + 1) 2^-24 in (0, 1], v = floor(c / 2^8) 2^-24 in [0, 1),
// all in fp32. u, v and theta are exact or rounded once the same way everywhere, so the CPU
// and CUDA differ only in the last bits of their logf/sqrtf/sinf/cosf. The 24-bit u caps
// |z| at sqrt(48 ln 2) = 5.77, a tail of probability 8e-9.
//
// The header is plain C++ for the host and __host__ __device__ under nvcc, so the CPU
// reference and the CUDA kernel run this very code.
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define FORGE_PHILOX_FN __host__ __device__ __forceinline__
#else
#define FORGE_PHILOX_FN inline
#endif

namespace forge::philox {

constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;
constexpr float kTwoPi = 6.28318530717958647692f;

struct Words {
  uint32_t w[4];
};

// Philox4x32-10 of `counter` under the key (key0, key1).
FORGE_PHILOX_FN Words philox4x32_10(Words counter, uint32_t key0, uint32_t key1) {
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      key0 += kWeyl0;
      key1 += kWeyl1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kMultiplier0) * counter.w[0];
    const uint64_t p1 = static_cast<uint64_t>(kMultiplier1) * counter.w[2];
    counter = Words{{static_cast<uint32_t>(p1 >> 32) ^ counter.w[1] ^ key0, static_cast<uint32_t>(p1),
                     static_cast<uint32_t>(p0 >> 32) ^ counter.w[3] ^ key1, static_cast<uint32_t>(p0)}};
  }
  return counter;
}

// The top 24 bits of x as (k + 1) 2^-24: in (0, 1], exact in fp32 (never 0: log is finite).
FORGE_PHILOX_FN float uniform_positive(uint32_t x) { return static_cast<float>((x >> 8) + 1u) * 0x1p-24f; }

// The top 24 bits of x as k 2^-24: in [0, 1), exact in fp32.
FORGE_PHILOX_FN float uniform_below_one(uint32_t x) { return static_cast<float>(x >> 8) * 0x1p-24f; }

// Two standard normals from two random words (NOTE [Counter-based normals]).
FORGE_PHILOX_FN void box_muller(uint32_t a, uint32_t c, float& z0, float& z1) {
  const float r = sqrtf(-2.0f * logf(uniform_positive(a)));
  const float theta = kTwoPi * uniform_below_one(c);
  z0 = r * cosf(theta);
  z1 = r * sinf(theta);
}

// Normal numbers 4 block .. 4 block + 3 of the stream `seed` into z.
FORGE_PHILOX_FN void normal4(uint64_t seed, uint64_t block, float (&z)[4]) {
  const Words x = philox4x32_10(Words{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0u, 0u}},
                                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  box_muller(x.w[0], x.w[1], z[0], z[1]);
  box_muller(x.w[2], x.w[3], z[2], z[3]);
}

}  // namespace forge::philox

#undef FORGE_PHILOX_FN
