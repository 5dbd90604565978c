// mla_pack_qkv and its backward on CUDA (kernels/cuda/latent_attention.cu) against the CPU
// reference op on fresh random bf16 values with poisoned outputs (gpu_testing.h): the
// DeepSeek-V3 head dims with 16 heads (nope 128, rope 64, v 128, kv_rank 512) at B 2, T 128,
// and small shapes (3 heads; no nope part and no kv_rank), each with and without packed
// positions. The forward's nope and value columns are copies, so equal bit for bit; the rope
// columns, d_q and k_pe's gradient within bf16 rounding, d_kv (a copy) exactly; d_kv_a's
// first kv_rank columns untouched;
// the backward the same bits twice (no atomics); positions 0, 1, ... the default bit for bit;
// dims the vectorized kernels cannot take refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "gpu_testing.h"
#include "ops/latent_attention.h"
#include "ops/rope.h"

namespace forge {
namespace {

using gpu_test::host_values;
using gpu_test::kBf16Tolerance;
using gpu_test::poisoned_gpu;
using gpu_test::random_bf16_values;
using gpu_test::relative_l2;
using gpu_test::seed_for_current_test;
using gpu_test::to_cpu_f32;
using gpu_test::to_gpu;

struct MlaCase {
  int64_t batch, seq;
  MlaDims dims;
};

const MlaCase kCases[] = {
    {2, 128, {.heads = 16, .nope_dim = 128, .rope_dim = 64, .v_dim = 128, .kv_rank = 512}},
    {1, 5, {.heads = 3, .nope_dim = 8, .rope_dim = 16, .v_dim = 8, .kv_rank = 8}},
    {3, 7, {.heads = 2, .nope_dim = 0, .rope_dim = 32, .v_dim = 24, .kv_rank = 0}},
};

std::string case_name(const MlaCase& c, bool with_positions) {
  const MlaDims& d = c.dims;
  return fmt::format("B {} T {} heads {} nope {} rope {} v {} kv_rank {}{}", c.batch, c.seq, d.heads, d.nope_dim,
                     d.rope_dim, d.v_dim, d.kv_rank, with_positions ? " with positions" : "");
}

// Positions of packed examples: each row cut into examples at random, each restarting at 0.
Tensor packed_positions(int64_t batch, int64_t seq, Rng& rng) {
  Tensor positions = Tensor::empty({batch, seq}, DType::I32);
  int32_t* p = positions.data<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    int32_t next = 0;
    for (int64_t t = 0; t < seq; ++t) {
      if (t > 0 && rng.below(16) == 0) next = 0;
      p[b * seq + t] = next++;
    }
  }
  return positions;
}

// The packed columns of a row that the forward copies (everything but the rope parts).
bool is_copied_column(const MlaDims& d, int64_t column) {
  const int64_t qk = d.qk_dim();
  if (column >= 2 * d.heads * qk) return true;  // values
  return column % qk < d.nope_dim;
}

// One case's rope tables and packed positions, on the CPU and on the GPU.
struct Sides {
  Tensor cos, sin, cos_gpu, sin_gpu;
  Tensor positions, positions_gpu;
};

Sides tables_for(const MlaCase& c, Rng& rng) {
  Sides s;
  rope_tables(s.cos, s.sin, rope_inv_freq(c.dims.rope_dim, 10000.0, RopeScaling{}), c.seq);
  s.cos_gpu = s.cos.to(Device::CUDA);
  s.sin_gpu = s.sin.to(Device::CUDA);
  s.positions = packed_positions(c.batch, c.seq, rng);
  s.positions_gpu = s.positions.to(Device::CUDA);
  return s;
}

TEST(GpuLatentAttention, ForwardMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const MlaCase& c : kCases) {
    const MlaDims& d = c.dims;
    const int64_t tokens = c.batch * c.seq, width = d.packed_width();
    Sides s = tables_for(c, rng);
    Tensor q = random_bf16_values({tokens, d.heads * d.qk_dim()}, rng);
    Tensor kv_a = random_bf16_values({tokens, d.kv_rank + d.rope_dim}, rng);
    Tensor kv = random_bf16_values({tokens, d.heads * (d.nope_dim + d.v_dim)}, rng);
    Tensor q_gpu = to_gpu(q, DType::BF16), kv_a_gpu = to_gpu(kv_a, DType::BF16), kv_gpu = to_gpu(kv, DType::BF16);
    for (bool with_positions : {false, true}) {
      const std::string what = case_name(c, with_positions);
      Tensor want = Tensor::empty({c.batch, c.seq, width});
      mla_pack_qkv(want, q, kv_a, kv, d, s.cos, s.sin, with_positions ? &s.positions : nullptr);
      Tensor got_gpu = poisoned_gpu({c.batch, c.seq, width}, DType::BF16);
      mla_pack_qkv(got_gpu, q_gpu, kv_a_gpu, kv_gpu, d, s.cos_gpu, s.sin_gpu,
                   with_positions ? &s.positions_gpu : nullptr);
      Tensor got = to_cpu_f32(got_gpu);
      EXPECT_LT(relative_l2(got, want), kBf16Tolerance) << what;
      int64_t copies_differing = 0;
      for (int64_t i = 0; i < got.numel(); ++i)
        if (is_copied_column(d, i % width) && got.data<float>()[i] != want.data<float>()[i]) ++copies_differing;
      EXPECT_EQ(copies_differing, 0) << what << ": nope and value columns are copies";
    }
  }
}

// The last rope_dim columns of every row of an fp32 [rows, width] tensor, [rows, rope_dim].
Tensor rope_columns(const Tensor& t, int64_t rope_dim) {
  const int64_t rows = t.dim(0), width = t.dim(1);
  Tensor out = Tensor::empty({rows, rope_dim});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < rope_dim; ++i)
      out.data<float>()[r * rope_dim + i] = t.data<float>()[r * width + width - rope_dim + i];
  return out;
}

TEST(GpuLatentAttention, BackwardMatchesCpu) {
  Rng rng(seed_for_current_test());
  for (const MlaCase& c : kCases) {
    const MlaDims& d = c.dims;
    const int64_t tokens = c.batch * c.seq, kv_a_width = d.kv_rank + d.rope_dim;
    Sides s = tables_for(c, rng);
    Tensor d_qkv = random_bf16_values({c.batch, c.seq, d.packed_width()}, rng);
    Tensor d_qkv_gpu = to_gpu(d_qkv, DType::BF16);
    for (bool with_positions : {false, true}) {
      const std::string what = case_name(c, with_positions);
      const Tensor* p = with_positions ? &s.positions : nullptr;
      const Tensor* p_gpu = with_positions ? &s.positions_gpu : nullptr;
      Tensor d_q = Tensor::empty({tokens, d.heads * d.qk_dim()});
      Tensor d_kv = Tensor::empty({tokens, d.heads * (d.nope_dim + d.v_dim)});
      Tensor d_kv_a = random_bf16_values({tokens, kv_a_width}, rng);
      const Tensor d_kv_a_start = to_gpu(d_kv_a, DType::BF16);
      const std::vector<uint16_t> before = host_values<uint16_t>(d_kv_a_start);
      Tensor d_kv_a_gpu = d_kv_a_start.clone();
      mla_pack_qkv_backward(d_q, d_kv_a, d_kv, d_qkv, d, s.cos, s.sin, p);
      Tensor d_q_gpu = poisoned_gpu(d_q.shape(), DType::BF16), d_kv_gpu = poisoned_gpu(d_kv.shape(), DType::BF16);
      mla_pack_qkv_backward(d_q_gpu, d_kv_a_gpu, d_kv_gpu, d_qkv_gpu, d, s.cos_gpu, s.sin_gpu, p_gpu);
      EXPECT_LT(relative_l2(to_cpu_f32(d_q_gpu), d_q), kBf16Tolerance) << what;
      EXPECT_EQ(relative_l2(to_cpu_f32(d_kv_gpu), d_kv), 0.0) << what << ": d_kv is a copy";
      EXPECT_LT(relative_l2(rope_columns(to_cpu_f32(d_kv_a_gpu), d.rope_dim), rope_columns(d_kv_a, d.rope_dim)),
                kBf16Tolerance)
          << what;
      // d_kv_a's first kv_rank columns keep their bits.
      const std::vector<uint16_t> after = host_values<uint16_t>(d_kv_a_gpu);
      int64_t latent_changed = 0;
      for (int64_t i = 0; i < tokens * kv_a_width; ++i)
        if (i % kv_a_width < d.kv_rank) latent_changed += after[i] != before[i];
      EXPECT_EQ(latent_changed, 0) << what;

      // The same bits again: the heads' sum has a fixed order.
      Tensor d_kv_a_again = d_kv_a_start.clone(), d_q_again = poisoned_gpu(d_q.shape(), DType::BF16),
             d_kv_again = poisoned_gpu(d_kv.shape(), DType::BF16);
      mla_pack_qkv_backward(d_q_again, d_kv_a_again, d_kv_again, d_qkv_gpu, d, s.cos_gpu, s.sin_gpu, p_gpu);
      EXPECT_EQ(host_values<uint16_t>(d_kv_a_again), after) << what;
      EXPECT_EQ(host_values<uint16_t>(d_q_again), host_values<uint16_t>(d_q_gpu)) << what;
    }
  }
}

TEST(GpuLatentAttention, PositionsFromZeroAreTheDefaultBitForBit) {
  Rng rng(seed_for_current_test());
  const MlaCase& c = kCases[0];
  const MlaDims& d = c.dims;
  const int64_t tokens = c.batch * c.seq;
  Sides s = tables_for(c, rng);
  Tensor positions = Tensor::empty({c.batch, c.seq}, DType::I32);
  for (int64_t i = 0; i < tokens; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(i % c.seq);
  Tensor positions_gpu = positions.to(Device::CUDA);
  Tensor q = to_gpu(random_bf16_values({tokens, d.heads * d.qk_dim()}, rng), DType::BF16);
  Tensor kv_a = to_gpu(random_bf16_values({tokens, d.kv_rank + d.rope_dim}, rng), DType::BF16);
  Tensor kv = to_gpu(random_bf16_values({tokens, d.heads * (d.nope_dim + d.v_dim)}, rng), DType::BF16);
  Tensor a = poisoned_gpu({c.batch, c.seq, d.packed_width()}, DType::BF16);
  Tensor b = poisoned_gpu(a.shape(), DType::BF16);
  mla_pack_qkv(a, q, kv_a, kv, d, s.cos_gpu, s.sin_gpu);
  mla_pack_qkv(b, q, kv_a, kv, d, s.cos_gpu, s.sin_gpu, &positions_gpu);
  EXPECT_EQ(host_values<uint16_t>(a), host_values<uint16_t>(b));
  Tensor dq_a = poisoned_gpu(q.shape(), DType::BF16), dq_b = poisoned_gpu(q.shape(), DType::BF16);
  Tensor dkv_a = poisoned_gpu(kv.shape(), DType::BF16), dkv_b = poisoned_gpu(kv.shape(), DType::BF16);
  Tensor dkva_a = poisoned_gpu(kv_a.shape(), DType::BF16), dkva_b = poisoned_gpu(kv_a.shape(), DType::BF16);
  mla_pack_qkv_backward(dq_a, dkva_a, dkv_a, a, d, s.cos_gpu, s.sin_gpu);
  mla_pack_qkv_backward(dq_b, dkva_b, dkv_b, a, d, s.cos_gpu, s.sin_gpu, &positions_gpu);
  EXPECT_EQ(host_values<uint16_t>(dq_a), host_values<uint16_t>(dq_b));
  EXPECT_EQ(host_values<uint16_t>(dkva_a), host_values<uint16_t>(dkva_b));
  EXPECT_EQ(host_values<uint16_t>(dkv_a), host_values<uint16_t>(dkv_b));
}

// The vectorized kernels take 16-byte vectors: a rope part that does not split into two
// halves of whole vectors, or nope, value or kv_rank widths off a multiple of 8, are refused.
TEST(GpuLatentAttention, RefusesDimsOffTheVectorWidth) {
  const MlaDims good{.heads = 2, .nope_dim = 8, .rope_dim = 16, .v_dim = 8, .kv_rank = 8};
  auto refused = [](const MlaDims& d) {
    Tensor cos, sin;
    rope_tables(cos, sin, rope_inv_freq(d.rope_dim, 10000.0, RopeScaling{}), 4);
    Tensor qkv = Tensor::zeros({1, 4, d.packed_width()}, DType::BF16, Device::CUDA);
    Tensor q = Tensor::zeros({4, d.heads * d.qk_dim()}, DType::BF16, Device::CUDA);
    Tensor kv_a = Tensor::zeros({4, d.kv_rank + d.rope_dim}, DType::BF16, Device::CUDA);
    Tensor kv = Tensor::zeros({4, d.heads * (d.nope_dim + d.v_dim)}, DType::BF16, Device::CUDA);
    try {
      mla_pack_qkv(qkv, q, kv_a, kv, d, cos.to(Device::CUDA), sin.to(Device::CUDA));
    } catch (const Error& e) {
      return std::string(e.what()).find("multiple") != std::string::npos;
    }
    return false;
  };
  EXPECT_FALSE(refused(good));
  for (auto [field, value] : {std::pair<int64_t MlaDims::*, int64_t>{&MlaDims::rope_dim, 8},
                              {&MlaDims::nope_dim, 4},
                              {&MlaDims::v_dim, 12},
                              {&MlaDims::kv_rank, 3}}) {
    MlaDims d = good;
    d.*field = value;
    EXPECT_TRUE(refused(d)) << "rope " << d.rope_dim << " nope " << d.nope_dim << " v " << d.v_dim << " kv_rank "
                            << d.kv_rank;
  }
}

}  // namespace
}  // namespace forge
