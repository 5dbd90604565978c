// mla_pack_qkv and its backward (ops/latent_attention.h, NOTE [MLA packed QKV]) on the CPU:
//  - the forward against the packed rows composed from the pieces, q_pe and k_pe rotated
//    by rope_forward, with and without positions (packed examples restart them);
//  - the backward against a direct double-precision reference, and as the forward's
//    adjoint (the op is linear: <pack(q, kv_a, kv), G> = <q, d_q> + <kv_a, d_kv_a> +
//    <kv, d_kv>), leaving d_kv_a's first kv_rank columns untouched;
//  - positions 0, 1, ... are the default, bit for bit;
//  - bad arguments refused, naming what is wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "expect_error.h"
#include "ops/latent_attention.h"
#include "ops/rope.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::fill_nan;
using testing::random_tensor;
using testing::relative_error;

struct MlaCase {
  int64_t batch, seq;
  MlaDims dims;
};

// Every dim from 1 up (nope_dim and kv_rank 0 too), heads 1 to 16.
const MlaCase kCases[] = {
    {1, 1, {.heads = 1, .nope_dim = 2, .rope_dim = 2, .v_dim = 1, .kv_rank = 0}},
    {2, 7, {.heads = 3, .nope_dim = 8, .rope_dim = 4, .v_dim = 6, .kv_rank = 5}},
    {1, 13, {.heads = 4, .nope_dim = 0, .rope_dim = 8, .v_dim = 8, .kv_rank = 16}},
    {2, 5, {.heads = 16, .nope_dim = 16, .rope_dim = 8, .v_dim = 16, .kv_rank = 32}},
};

std::string case_name(const MlaCase& c) {
  const MlaDims& d = c.dims;
  return fmt::format("B {} T {} heads {} nope {} rope {} v {} kv_rank {}", c.batch, c.seq, d.heads, d.nope_dim,
                     d.rope_dim, d.v_dim, d.kv_rank);
}

struct MlaInputs {
  Tensor q, kv_a, kv;
  Tensor cos, sin;
  std::vector<double> inv_freq;
};

MlaInputs random_inputs(const MlaCase& c, Rng& rng) {
  const MlaDims& d = c.dims;
  const int64_t tokens = c.batch * c.seq;
  MlaInputs in;
  in.q = random_tensor({tokens, d.heads * d.qk_dim()}, rng);
  in.kv_a = random_tensor({tokens, d.kv_rank + d.rope_dim}, rng);
  in.kv = random_tensor({tokens, d.heads * (d.nope_dim + d.v_dim)}, rng);
  in.inv_freq = rope_inv_freq(d.rope_dim, 100.0, RopeScaling{});
  rope_tables(in.cos, in.sin, in.inv_freq, c.seq + 3);
  return in;
}

// Positions of packed examples: each row cut into examples at random, each restarting at 0.
Tensor packed_positions(int64_t batch, int64_t seq, Rng& rng) {
  Tensor positions = Tensor::empty({batch, seq}, DType::I32);
  int32_t* p = positions.data<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    int32_t next = 0;
    for (int64_t t = 0; t < seq; ++t) {
      if (t > 0 && rng.below(3) == 0) next = 0;
      p[b * seq + t] = next++;
    }
  }
  return positions;
}

int64_t position_of(const Tensor* positions, int64_t token, int64_t seq) {
  return positions ? positions->data<int32_t>()[token] : token % seq;
}

// The packed rows composed from the pieces: q_pe and k_pe copied out into [B, T, heads, dr]
// tensors and rotated by rope_forward, then everything laid out by plain loops.
Tensor composed_pack(const MlaCase& c, const MlaInputs& in, const Tensor* positions) {
  const MlaDims& d = c.dims;
  const int64_t tokens = c.batch * c.seq, qk = d.qk_dim(), kv_width = d.nope_dim + d.v_dim;
  const float* q = in.q.data<float>();
  const float* kv_a = in.kv_a.data<float>();
  const float* kv = in.kv.data<float>();
  Tensor q_pe = Tensor::empty({c.batch, c.seq, d.heads, d.rope_dim});
  Tensor k_pe = Tensor::empty({c.batch, c.seq, 1, d.rope_dim});
  for (int64_t n = 0; n < tokens; ++n) {
    for (int64_t h = 0; h < d.heads; ++h)
      for (int64_t i = 0; i < d.rope_dim; ++i)
        q_pe.data<float>()[(n * d.heads + h) * d.rope_dim + i] = q[n * d.heads * qk + h * qk + d.nope_dim + i];
    for (int64_t i = 0; i < d.rope_dim; ++i)
      k_pe.data<float>()[n * d.rope_dim + i] = kv_a[n * (d.kv_rank + d.rope_dim) + d.kv_rank + i];
  }
  rope_forward(q_pe, d.heads, in.cos, in.sin, positions);
  rope_forward(k_pe, 1, in.cos, in.sin, positions);
  Tensor out = Tensor::empty({c.batch, c.seq, d.packed_width()});
  for (int64_t n = 0; n < tokens; ++n) {
    float* row = out.data<float>() + n * d.packed_width();
    for (int64_t h = 0; h < d.heads; ++h) {
      float* query = row + h * qk;
      float* key = row + (d.heads + h) * qk;
      float* value = row + 2 * d.heads * qk + h * d.v_dim;
      const float* kvh = kv + (n * d.heads + h) * kv_width;
      for (int64_t i = 0; i < d.nope_dim; ++i) {
        query[i] = q[n * d.heads * qk + h * qk + i];
        key[i] = kvh[i];
      }
      for (int64_t i = 0; i < d.rope_dim; ++i) {
        query[d.nope_dim + i] = q_pe.data<float>()[(n * d.heads + h) * d.rope_dim + i];
        key[d.nope_dim + i] = k_pe.data<float>()[n * d.rope_dim + i];
      }
      for (int64_t i = 0; i < d.v_dim; ++i) value[i] = kvh[d.nope_dim + i];
    }
  }
  return out;
}

// The backward written out directly, in double, with the angles position * inv_freq[i]:
// d_q, d_kv, and k_pe's gradient [tokens, dr] (d_kv_a's last dr columns).
struct ReferenceGrads {
  std::vector<double> d_q, d_kv, d_k_pe;
};

ReferenceGrads reference_backward(const MlaCase& c, const Tensor& d_qkv, const std::vector<double>& inv_freq,
                                  const Tensor* positions) {
  const MlaDims& d = c.dims;
  const int64_t tokens = c.batch * c.seq, qk = d.qk_dim(), kv_width = d.nope_dim + d.v_dim, half = d.rope_dim / 2;
  ReferenceGrads r;
  r.d_q.assign(tokens * d.heads * qk, 0.0);
  r.d_kv.assign(tokens * d.heads * kv_width, 0.0);
  r.d_k_pe.assign(tokens * d.rope_dim, 0.0);
  for (int64_t n = 0; n < tokens; ++n) {
    const double p = static_cast<double>(position_of(positions, n, c.seq));
    const float* g = d_qkv.data<float>() + n * d.packed_width();
    // The transpose of x -> (x_lo c - x_hi s, x_hi c + x_lo s), added into out.
    auto rotate_back_into = [&](double* out, const float* grad) {
      for (int64_t i = 0; i < half; ++i) {
        const double cs = std::cos(p * inv_freq[i]), sn = std::sin(p * inv_freq[i]);
        out[i] += grad[i] * cs + grad[i + half] * sn;
        out[i + half] += grad[i + half] * cs - grad[i] * sn;
      }
    };
    for (int64_t h = 0; h < d.heads; ++h) {
      const float* gq = g + h * qk;
      const float* gk = g + (d.heads + h) * qk;
      const float* gv = g + 2 * d.heads * qk + h * d.v_dim;
      double* dq = r.d_q.data() + (n * d.heads + h) * qk;
      double* dkv = r.d_kv.data() + (n * d.heads + h) * kv_width;
      for (int64_t i = 0; i < d.nope_dim; ++i) {
        dq[i] = gq[i];
        dkv[i] = gk[i];
      }
      rotate_back_into(dq + d.nope_dim, gq + d.nope_dim);
      rotate_back_into(r.d_k_pe.data() + n * d.rope_dim, gk + d.nope_dim);
      for (int64_t i = 0; i < d.v_dim; ++i) dkv[d.nope_dim + i] = gv[i];
    }
  }
  return r;
}

// d_kv_a's last dr columns of every row, as doubles.
std::vector<double> rope_columns(const Tensor& kv_a, int64_t rope_dim) {
  std::vector<double> out;
  const int64_t width = kv_a.dim(1);
  for (int64_t n = 0; n < kv_a.dim(0); ++n)
    for (int64_t i = width - rope_dim; i < width; ++i) out.push_back(kv_a.data<float>()[n * width + i]);
  return out;
}

// Whether the first `columns` columns of every row of a and b hold the same bits.
bool leading_columns_equal(const Tensor& a, const Tensor& b, int64_t columns) {
  for (int64_t n = 0; n < a.dim(0); ++n)
    for (int64_t i = 0; i < columns; ++i)
      if (std::memcmp(a.data<float>() + n * a.dim(1) + i, b.data<float>() + n * b.dim(1) + i, sizeof(float)) != 0)
        return false;
  return true;
}

// The backward's outputs on poisoned tensors: d_q and d_kv NaN (written over), d_kv_a
// random (only its last dr columns written).
struct Grads {
  Tensor d_q, d_kv_a, d_kv;
};

Grads poisoned_grads(const MlaCase& c, Rng& rng) {
  const MlaDims& d = c.dims;
  const int64_t tokens = c.batch * c.seq;
  Grads g{Tensor::empty({tokens, d.heads * d.qk_dim()}), random_tensor({tokens, d.kv_rank + d.rope_dim}, rng),
          Tensor::empty({tokens, d.heads * (d.nope_dim + d.v_dim)})};
  fill_nan(g.d_q);
  fill_nan(g.d_kv);
  return g;
}

void expect_forward_matches_composition(bool with_positions, uint64_t seed) {
  Rng rng(seed);
  for (const MlaCase& c : kCases) {
    MlaInputs in = random_inputs(c, rng);
    Tensor positions = packed_positions(c.batch, c.seq, rng);
    const Tensor* p = with_positions ? &positions : nullptr;
    Tensor qkv = Tensor::empty({c.batch, c.seq, c.dims.packed_width()});
    fill_nan(qkv);
    mla_pack_qkv(qkv, in.q, in.kv_a, in.kv, c.dims, in.cos, in.sin, p);
    // The same fp32 rotation as rope_forward's: equal up to the compiler's fp32 contractions.
    EXPECT_LT(relative_error(qkv, testing::to_double(composed_pack(c, in, p))), 1e-6) << case_name(c);
  }
}

TEST(OpsLatentAttention, ForwardMatchesRopeOnThePieces) { expect_forward_matches_composition(false, 71); }

TEST(OpsLatentAttention, ForwardWithPackedPositionsMatchesRopeOnThePieces) {
  expect_forward_matches_composition(true, 72);
}

void expect_backward_matches_reference(bool with_positions, uint64_t seed) {
  Rng rng(seed);
  for (const MlaCase& c : kCases) {
    MlaInputs in = random_inputs(c, rng);
    Tensor positions = packed_positions(c.batch, c.seq, rng);
    const Tensor* p = with_positions ? &positions : nullptr;
    Tensor d_qkv = random_tensor({c.batch, c.seq, c.dims.packed_width()}, rng);
    Grads g = poisoned_grads(c, rng);
    Tensor d_kv_a_before = g.d_kv_a.clone();
    mla_pack_qkv_backward(g.d_q, g.d_kv_a, g.d_kv, d_qkv, c.dims, in.cos, in.sin, p);
    ReferenceGrads want = reference_backward(c, d_qkv, in.inv_freq, p);
    EXPECT_LT(relative_error(g.d_q, want.d_q), 1e-5) << case_name(c);
    EXPECT_LT(relative_error(g.d_kv, want.d_kv), 1e-6) << case_name(c);
    EXPECT_LT(relative_error(rope_columns(g.d_kv_a, c.dims.rope_dim), want.d_k_pe), 1e-5) << case_name(c);
    EXPECT_TRUE(leading_columns_equal(g.d_kv_a, d_kv_a_before, c.dims.kv_rank)) << case_name(c);
  }
}

TEST(OpsLatentAttention, BackwardMatchesDirectReference) { expect_backward_matches_reference(false, 73); }

TEST(OpsLatentAttention, BackwardWithPackedPositionsMatchesDirectReference) {
  expect_backward_matches_reference(true, 74);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

double abs_dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += std::abs(a[i] * b[i]);
  return s;
}

// The op is linear in (q, kv_a, kv), so its backward is its adjoint: for random G,
// <pack(q, kv_a, kv), G> = <q, d_q> + <kv_a, d_kv_a> + <kv, d_kv>, where d_kv_a's first
// kv_rank columns, never read by the forward, count as zero.
TEST(OpsLatentAttention, BackwardIsTheForwardsAdjoint) {
  Rng rng(75);
  for (bool with_positions : {false, true}) {
    for (const MlaCase& c : kCases) {
      MlaInputs in = random_inputs(c, rng);
      Tensor positions = packed_positions(c.batch, c.seq, rng);
      const Tensor* p = with_positions ? &positions : nullptr;
      Tensor qkv = Tensor::empty({c.batch, c.seq, c.dims.packed_width()});
      mla_pack_qkv(qkv, in.q, in.kv_a, in.kv, c.dims, in.cos, in.sin, p);
      Tensor weights = random_tensor(qkv.shape(), rng);
      Grads g = poisoned_grads(c, rng);
      mla_pack_qkv_backward(g.d_q, g.d_kv_a, g.d_kv, weights, c.dims, in.cos, in.sin, p);
      using testing::to_double;
      const double forward = dot(to_double(qkv), to_double(weights));
      const std::vector<double> k_pe = rope_columns(in.kv_a, c.dims.rope_dim);
      const std::vector<double> d_k_pe = rope_columns(g.d_kv_a, c.dims.rope_dim);
      const double adjoint = dot(to_double(in.q), to_double(g.d_q)) + dot(k_pe, d_k_pe) +
                             dot(to_double(in.kv), to_double(g.d_kv));
      const double scale = abs_dot(to_double(qkv), to_double(weights));
      EXPECT_NEAR(forward, adjoint, 1e-5 * scale) << case_name(c) << (with_positions ? " with positions" : "");
    }
  }
}

// Positions 0, 1, ... in every row rotate exactly as no positions do, forward and backward.
TEST(OpsLatentAttention, PositionsFromZeroAreTheDefaultBitForBit) {
  Rng rng(76);
  const MlaCase& c = kCases[3];
  MlaInputs in = random_inputs(c, rng);
  Tensor positions = Tensor::empty({c.batch, c.seq}, DType::I32);
  for (int64_t i = 0; i < positions.numel(); ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(i % c.seq);
  Tensor a = Tensor::empty({c.batch, c.seq, c.dims.packed_width()}), b = Tensor::empty(a.shape());
  mla_pack_qkv(a, in.q, in.kv_a, in.kv, c.dims, in.cos, in.sin);
  mla_pack_qkv(b, in.q, in.kv_a, in.kv, c.dims, in.cos, in.sin, &positions);
  EXPECT_TRUE(bitwise_equal(a, b));
  Grads ga = poisoned_grads(c, rng);
  Grads gb{ga.d_q.clone(), ga.d_kv_a.clone(), ga.d_kv.clone()};
  mla_pack_qkv_backward(ga.d_q, ga.d_kv_a, ga.d_kv, a, c.dims, in.cos, in.sin);
  mla_pack_qkv_backward(gb.d_q, gb.d_kv_a, gb.d_kv, a, c.dims, in.cos, in.sin, &positions);
  EXPECT_TRUE(bitwise_equal(ga.d_q, gb.d_q));
  EXPECT_TRUE(bitwise_equal(ga.d_kv_a, gb.d_kv_a));
  EXPECT_TRUE(bitwise_equal(ga.d_kv, gb.d_kv));
}

TEST(OpsLatentAttention, RejectsBadArguments) {
  Rng rng(77);
  const MlaCase c{2, 3, {.heads = 2, .nope_dim = 4, .rope_dim = 4, .v_dim = 2, .kv_rank = 6}};
  const MlaDims& d = c.dims;
  MlaInputs in = random_inputs(c, rng);  // tables of seq + 3 = 6 rows
  Tensor qkv = Tensor::empty({2, 3, d.packed_width()});
  // The call as an action for expect_error (tensors are handles: the copies share the data).
  auto pack = [](Tensor out, Tensor q, Tensor kv_a, Tensor kv, MlaDims dims, Tensor cos, Tensor sin,
                 const Tensor* positions = nullptr) {
    return [=] { mla_pack_qkv(out, q, kv_a, kv, dims, cos, sin, positions); };
  };
  mla_pack_qkv(qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin);  // the unmodified call is fine

  MlaDims odd_rope = d;
  odd_rope.rope_dim = 3;
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, odd_rope, in.cos, in.sin), {"mla_pack_qkv", "rope_dim 3"});
  MlaDims no_heads = d;
  no_heads.heads = 0;
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, no_heads, in.cos, in.sin), {"mla_pack_qkv", "heads 0"});

  Tensor narrow_qkv = Tensor::empty({2, 3, d.packed_width() - 1});
  expect_error(pack(narrow_qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin), {"qkv", "[2, 3, 35]", "[B, T, 36]"});
  Tensor flat_qkv = Tensor::empty({6, d.packed_width()});
  expect_error(pack(flat_qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin), {"qkv", "[6, 36]", "[B, T, 36]"});
  Tensor bad_q = Tensor::empty({6, d.heads * d.qk_dim() + 1});
  expect_error(pack(qkv, bad_q, in.kv_a, in.kv, d, in.cos, in.sin), {"mla_pack_qkv q", "[6, 17]", "[6, 16]"});
  Tensor bad_kv_a = Tensor::empty({6, d.rope_dim});
  expect_error(pack(qkv, in.q, bad_kv_a, in.kv, d, in.cos, in.sin), {"mla_pack_qkv kv_a", "[6, 4]", "[6, 10]"});
  Tensor bad_kv = Tensor::empty({5, d.heads * (d.nope_dim + d.v_dim)});
  expect_error(pack(qkv, in.q, in.kv_a, bad_kv, d, in.cos, in.sin), {"mla_pack_qkv kv", "[5, 12]", "[6, 12]"});
  Tensor bf16_q = Tensor::empty(in.q.shape(), DType::BF16);
  expect_error(pack(qkv, bf16_q, in.kv_a, in.kv, d, in.cos, in.sin), {"mla_pack_qkv q", "bf16"});

  Tensor wide_cos, wide_sin;
  rope_tables(wide_cos, wide_sin, rope_inv_freq(8, 100.0, RopeScaling{}), 6);
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, wide_cos, in.sin), {"cos table", "[6, 4]", "rope_dim / 2 = 2"});
  Tensor short_cos, short_sin;
  rope_tables(short_cos, short_sin, in.inv_freq, 2);
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, short_cos, short_sin), {"cos table", "[2, 2]", "3 positions"});
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, short_sin), {"sin table", "[2, 2]", "[6, 2]"});
  Tensor bf16_sin = Tensor::empty(in.sin.shape(), DType::BF16);
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, bf16_sin), {"sin table", "bf16"});

  // With positions the tables need only hold the positions given, not the sequence length.
  Tensor positions = Tensor::empty({2, 3}, DType::I32);
  for (int64_t i = 0; i < 6; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(i % 2);
  mla_pack_qkv(qkv, in.q, in.kv_a, in.kv, d, short_cos, short_sin, &positions);
  Tensor far = positions.clone();
  far.data<int32_t>()[4] = 6;
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin, &far), {"position 6 of token 4", "6 rows"});
  far.data<int32_t>()[4] = -1;
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin, &far), {"position -1 of token 4"});
  Tensor flat_positions = Tensor::zeros({6}, DType::I32);
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin, &flat_positions), {"positions", "[6]", "[2, 3]"});
  Tensor float_positions = Tensor::zeros({2, 3});
  expect_error(pack(qkv, in.q, in.kv_a, in.kv, d, in.cos, in.sin, &float_positions), {"positions", "f32", "i32"});

  // The backward names its own arguments.
  Grads g = poisoned_grads(c, rng);
  mla_pack_qkv_backward(g.d_q, g.d_kv_a, g.d_kv, qkv, d, in.cos, in.sin);
  expect_error([&] { mla_pack_qkv_backward(g.d_q, bad_kv_a, g.d_kv, qkv, d, in.cos, in.sin); },
               {"mla_pack_qkv_backward d_kv_a", "[6, 4]"});
  expect_error([&] { mla_pack_qkv_backward(g.d_q, g.d_kv_a, g.d_kv, narrow_qkv, d, in.cos, in.sin); },
               {"mla_pack_qkv_backward", "d_qkv"});
  expect_error([&] { mla_pack_qkv_backward(g.d_kv, g.d_kv_a, g.d_q, qkv, d, in.cos, in.sin); },
               {"mla_pack_qkv_backward d_q", "[6, 12]", "[6, 16]"});
}

}  // namespace
}  // namespace forge
