// Counter-based random numbers (SplitMix64 stream), identical on every platform, so
// seeds give the same weights, data order and mock tokens everywhere. std:: distributions
// are avoided on purpose: their output differs between standard libraries.
#pragma once

#include <cmath>
#include <cstdint>

namespace forge {

class Rng {
 public:
  // Every next_u64() advances the state by this much.
  static constexpr uint64_t kIncrement = 0x9E3779B97F4A7C15ull;

  explicit Rng(uint64_t seed = 0) : state_(seed) {}

  uint64_t next_u64() {
    uint64_t z = (state_ += kIncrement);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n) { return n ? next_u64() % n : 0; }
  // Standard normal by Box-Muller.
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; }

 private:
  uint64_t state_;
};

// Derives an independent seed for a named purpose (weights, data order, dropout...).
inline uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  Rng r(seed ^ (stream * 0xD1B54A32D192ED03ull));
  return r.next_u64();
}

}  // namespace forge
