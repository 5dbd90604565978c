// Helpers for the GPU tests (ring 2 of ARCHITECTURE.md): every CUDA op is run on fresh
// random inputs and compared with the CPU reference op on the same values. Inputs are
// drawn in fp32 and rounded to bf16 first, so both sides see identical numbers and the
// comparison measures only the GPU op's own rounding. Outputs are poisoned (all bits
// set: NaN in bf16 and fp32) before each run, so an element the kernel never wrote
// shows up as NaN and fails the check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "kernels/cuda/types.h"
#include "model/config.h"
#include "model/parameters.h"
#include "ops/elementwise.h"

namespace forge::gpu_test {

// A file's bytes ("" when it cannot be read).
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Seed from the test's name, so every test draws different data but runs are repeatable.
inline uint64_t seed_for_current_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  uint64_t h = 1469598103934665603ull;
  for (const char* p : {info->test_suite_name(), info->name()})
    for (; *p; ++p) h = (h ^ static_cast<uint8_t>(*p)) * 1099511628211ull;
  return h;
}

// fp32 CPU tensor of normal(0, scale) values that are exactly representable in bf16.
inline Tensor random_bf16_values(const Shape& shape, Rng& rng, double scale = 1.0) {
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = to_float(to_bf16(static_cast<float>(scale * rng.normal())));
  return t;
}

inline Tensor random_f32(const Shape& shape, Rng& rng, double scale = 1.0) {
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(scale * rng.normal());
  return t;
}

inline Tensor random_ids(int64_t n, int64_t vocab, Rng& rng) {
  Tensor t = Tensor::empty({n}, DType::I32);
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
  return t;
}

// NOTE [Routers without near ties]
// A whole model's step routes the same tokens to the same experts on the GPU and on the CPU
// only where no token's k-th and (k+1)-th scores are closer than the bf16 rounding of the
// router's input; with random routers a few % of the tokens are that close (measured on the
// H100: 5 of 256, 10 of 1536, 9 of 2048), and every token that moves changes the loss's
// gradient everywhere upstream, beyond any tolerance that would still catch a bug. A router
// whose rows are multiples c_e u of one unit direction u (plus a little noise) ranks the
// experts by c_e for every token with u.h > 0 and in reverse for u.h < 0, whatever the
// rounding, so only tokens with u.h near zero can move. The multiples are spread evenly over
// [-spread, spread], so half the experts take the tokens (the others none: idle experts stay
// in the test too).
inline void separate_router_choices(FlatParameters& params, Rng& rng, double spread = 3.0) {
  for (size_t i = 0; i < params.specs().size(); ++i) {
    if (!params.specs()[i].name.ends_with("moe.router.weight")) continue;
    const Tensor& w = params.tensors()[i];
    const int64_t experts = w.dim(0), hidden = w.dim(1);
    std::vector<double> u(static_cast<size_t>(hidden));
    double norm = 0.0;
    for (double& x : u) {
      x = rng.normal();
      norm += x * x;
    }
    for (int64_t e = 0; e < experts; ++e) {
      const double c = spread * (2.0 * static_cast<double>(e) / static_cast<double>(experts - 1) - 1.0);
      for (int64_t j = 0; j < hidden; ++j)
        w.data<float>()[e * hidden + j] =
            static_cast<float>(c * u[static_cast<size_t>(j)] / std::sqrt(norm) + 0.002 * rng.normal());
    }
  }
}

// How many expert assignments the GPU routed differently from the CPU, from the two models'
// per-block expert loads (each moved assignment leaves one expert and joins another).
inline int64_t assignments_moved(const std::vector<std::vector<int64_t>>& cpu_load,
                                 const std::vector<std::vector<int64_t>>& gpu_load) {
  EXPECT_EQ(gpu_load.size(), cpu_load.size());
  int64_t moved = 0;
  for (size_t layer = 0; layer < std::min(gpu_load.size(), cpu_load.size()); ++layer)
    for (size_t e = 0; e < gpu_load[layer].size(); ++e) moved += std::abs(gpu_load[layer][e] - cpu_load[layer][e]);
  return moved / 2;
}

// A CPU fp32 tensor's values on the GPU in `dtype` (bf16 or fp32).
// A bf16 device tensor's data for a CUDA kernel's pointer arguments.
inline const cuda::bf16* bf16_in(const Tensor& t) { return static_cast<const cuda::bf16*>(t.raw()); }
inline cuda::bf16* bf16_out(const Tensor& t) { return static_cast<cuda::bf16*>(t.raw()); }

inline Tensor to_gpu(const Tensor& cpu, DType dtype) {
  if (dtype == cpu.dtype()) return cpu.to(Device::CUDA);
  Tensor converted = Tensor::empty(cpu.shape(), dtype);
  cast(converted, cpu);
  return converted.to(Device::CUDA);
}

inline Tensor poisoned_gpu(const Shape& shape, DType dtype) {
  Tensor host = Tensor::empty(shape, dtype);
  std::memset(host.raw(), 0xff, host.nbytes());
  return host.to(Device::CUDA);
}

// A GPU tensor back on the CPU as fp32.
inline Tensor to_cpu_f32(const Tensor& gpu) {
  Tensor host = gpu.to(Device::CPU);
  if (host.dtype() == DType::F32) return host;
  Tensor f = Tensor::empty(host.shape());
  cast(f, host);
  return f;
}

// ||a - b|| / ||b||, with any non-finite value in a reported as infinity.
// A GPU tensor's bytes as host values of T (bitwise comparisons: uint16_t for bf16).
template <typename T>
std::vector<T> host_values(const Tensor& gpu) {
  const Tensor host = gpu.to(Device::CPU);
  std::vector<T> v(host.nbytes() / sizeof(T));
  std::memcpy(v.data(), host.raw(), host.nbytes());
  return v;
}

inline double relative_l2(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (!std::isfinite(pa[i])) return INFINITY;
    diff += (double(pa[i]) - pb[i]) * (double(pa[i]) - pb[i]);
    ref += double(pb[i]) * pb[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// Rounds fp32 host values in place to the nearest bf16 (round to nearest even), so the CPU
// reference computes with exactly the weights the GPU holds in bf16.
inline void round_to_bf16(const Tensor& values) {
  Tensor rounded = Tensor::empty(values.shape(), DType::BF16);
  cast(rounded, values);
  cast(values, rounded);
}

// The small decoder the training-step tests run on both sides: 2 layers, hidden 128, GQA
// (4 heads, 2 KV heads), vocabulary 256, sequences up to 64 (every FP8 dimension a multiple
// of 16).
inline ModelConfig small_model(const std::string& name) {
  ModelConfig config;
  config.name = name;
  config.vocab_size = 256;
  config.hidden_size = 128;
  config.num_layers = 2;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.ffn_hidden_size = 256;
  config.max_seq_len = 64;
  return config;
}

// Tolerances of ‖gpu − cpu‖/‖cpu‖ (METHOD.md): bf16 outputs land between 1e-3 and 1e-2.
constexpr double kBf16Tolerance = 1e-2;
constexpr double kF32Tolerance = 1e-3;

// NOTE [Rank threads that fail]
// A rank thread of run_rank_threads that fails (throws, or returns early from an ASSERT)
// would leave its peers waiting at their next collective's barrier forever, and the test
// run would hang instead of reporting. So the harnesses' collectives wait at a RankBarrier:
// run_rank_threads marks the run failed when a rank ends with an error or a fatal gtest
// failure, and every wait then throws (one already waiting notices within 50 ms), so the
// peers end too, each with "a peer rank thread failed", and the first rank's error is the
// one to read.
inline std::atomic<bool>& rank_threads_failed() {
  static std::atomic<bool> failed{false};
  return failed;
}

class RankBarrier {
 public:
  explicit RankBarrier(int size) : size_(size) {}

  // Every rank thread gets here before any goes on, with the GPU's `turn` released
  // meanwhile; holds `turn` again when it returns or throws.
  void pass(std::mutex& turn) {
    turn.unlock();
    bool failed = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      const uint64_t phase = phase_;
      if (++arrived_ == size_) {
        arrived_ = 0;
        ++phase_;
        arrived_all_.notify_all();
      } else {
        while (phase_ == phase && !(failed = rank_threads_failed().load()))
          arrived_all_.wait_for(lock, std::chrono::milliseconds(50));
      }
    }
    turn.lock();
    FORGE_CHECK(!failed, "a peer rank thread failed (NOTE [Rank threads that fail])");
  }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable arrived_all_;
  int arrived_ = 0;
  uint64_t phase_ = 0;
};

// `ranks` ranks as threads of this process taking turns on the GPU (the parallel-layout
// tests): each runs body(rank) holding `turn`, which the ranks' collectives release while
// they wait for each other (RankBarrier::pass), and synchronizes the GPU before passing the
// turn on. Returns each rank's error ("" for none), in rank order.
inline std::vector<std::string> run_rank_threads(int ranks, std::mutex& turn, const std::function<void(int)>& body) {
  rank_threads_failed() = false;
  std::vector<std::future<std::string>> threads;
  for (int r = 0; r < ranks; ++r)
    threads.push_back(std::async(std::launch::async, [&turn, &body, r]() -> std::string {
      std::string error;
      turn.lock();
      try {
        body(r);
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (!error.empty() || ::testing::Test::HasFatalFailure()) rank_threads_failed() = true;
      device_synchronize();
      turn.unlock();
      return error;
    }));
  std::vector<std::string> errors;
  for (auto& thread : threads) errors.push_back(thread.get());
  return errors;
}

// A small Mixtral-shaped model for the GPU tests: 8 experts of which 2 per token, the
// pooled balancing loss; each test names it and adds its own settings.
inline ModelConfig small_moe() {
  ModelConfig c;
  c.name = "gpu-test-moe";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_hidden_size = 128;
  c.max_seq_len = 256;
  c.rope_theta = 500000;
  c.init_std = 0.05;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.router_aux_loss_coef = 0.02;
  return c;
}

// A small DeepSeek-shaped model for the GPU tests: Multi-head Latent Attention with YaRN, a
// dense first block, 16 experts of which 3 (V2: softmax, unnormalized, with a balancing
// loss) or 4 (V3: sigmoid, group-limited, renormalized, scaled) plus 2 shared ones; V3 adds
// a compressed query. Dims are the multiples CUDA's MLA wants.
inline ModelConfig small_deepseek(bool v3) {
  ModelConfig c;
  c.name = v3 ? "gpu-test-deepseek-v3" : "gpu-test-deepseek-v2";
  c.vocab_size = 1000;
  c.hidden_size = 256;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.ffn_hidden_size = 384;
  c.max_seq_len = 4096;
  c.rope_theta = 10000;
  c.rope_scaling.enabled = true;
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 40;
  c.rope_scaling.original_max_position = 64;
  c.rope_scaling.mscale = c.rope_scaling.mscale_all_dim = 0.707;
  c.init_std = 0.05;
  c.num_experts = 16;
  c.num_experts_per_tok = v3 ? 4 : 3;
  c.moe_ffn_hidden_size = 64;
  c.num_shared_experts = 2;
  c.first_dense_layers = 1;
  c.kv_lora_rank = 128;
  c.q_lora_rank = v3 ? 96 : 0;
  c.qk_nope_head_dim = 64;
  c.qk_rope_head_dim = 32;
  c.v_head_dim = 64;
  if (v3) {
    c.router_score_function = "sigmoid";
    c.router_normalize_topk = true;
    c.router_scaling_factor = 2.5;
    c.router_num_groups = 4;
    c.router_topk_groups = 2;
  } else {
    c.router_normalize_topk = false;
    c.router_aux_loss_coef = 0.01;
  }
  return c;
}

}  // namespace forge::gpu_test
