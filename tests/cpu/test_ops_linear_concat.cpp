// The linear layer over two concatenated inputs (NOTE [Linear over concatenated inputs] in
// ops/linear.h) against what it replaces: the inputs copied into one tensor, linear_forward,
// then linear_backward into one input gradient copied apart and GELU's backward. And the
// column-block GEMMs under it (NOTE [Column blocks] in ops/matmul.h).
#include <gtest/gtest.h>

#include "core/rng.h"
#include "expect_error.h"
#include "ops/fp8_linear.h"
#include "ops/gelu.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::random_tensor;
using testing::relative_error;

std::vector<double> values(const Tensor& t) { return testing::to_double(t); }

struct ConcatCase {
  int64_t rows, in1, in2, out;
  bool bias;
};

// A single block's output projection both ways: x1 the attention output, x2 = gelu(h2).
struct ConcatLayer {
  ConcatCase c;
  Tensor x1, h2, x2, w, b, dy;
  explicit ConcatLayer(const ConcatCase& cc, uint64_t seed) : c(cc) {
    Rng rng(seed);
    x1 = random_tensor({c.rows, c.in1}, rng);
    h2 = random_tensor({c.rows, c.in2}, rng, 2.0);
    x2 = Tensor::empty({c.rows, c.in2});
    gelu_tanh_forward(x2, h2);
    w = random_tensor({c.out, c.in1 + c.in2}, rng);
    b = c.bias ? random_tensor({c.out}, rng) : Tensor();
    dy = random_tensor({c.rows, c.out}, rng);
  }
  LinearWeight weight() const { return LinearWeight{w, nullptr, nullptr, nullptr, nullptr, b}; }
  Tensor cat() const {
    Tensor t = Tensor::empty({c.rows, c.in1 + c.in2});
    copy_columns(t, 0, x1, 0, c.in1);
    copy_columns(t, c.in1, x2, 0, c.in2);
    return t;
  }
};

class OpsLinearConcat : public ::testing::TestWithParam<ConcatCase> {};

TEST_P(OpsLinearConcat, ForwardMatchesTheConcatenation) {
  const ConcatLayer l(GetParam(), 71);
  const ConcatCase& c = l.c;
  Tensor y = Tensor::empty({c.rows, c.out}), want = Tensor::empty({c.rows, c.out});
  testing::fill_nan(y);
  linear_concat_forward(y, l.x1, l.x2, l.weight());
  linear_forward(want, l.cat(), l.weight());
  EXPECT_LT(relative_error(y, values(want)), 1e-6);
}

// Written over NaN buffers (fresh gradients), then added to them (a second micro-batch):
// every gradient matches the concatenation's, the GELU's backward included.
TEST_P(OpsLinearConcat, BackwardMatchesTheConcatenationFreshAndAccumulated) {
  const ConcatLayer l(GetParam(), 72);
  const ConcatCase& c = l.c;
  const int64_t in = c.in1 + c.in2;
  Tensor dx1 = Tensor::empty({c.rows, c.in1}), dh2 = Tensor::empty({c.rows, c.in2});
  Tensor da2 = Tensor::empty({c.rows, c.in2});
  Tensor dw = Tensor::empty({c.out, in}), db = c.bias ? Tensor::empty({c.out}) : Tensor();
  Tensor want_dcat = Tensor::empty({c.rows, in}), want_da2 = Tensor::empty({c.rows, c.in2});
  Tensor want_dx1 = Tensor::empty({c.rows, c.in1}), want_dh2 = Tensor::empty({c.rows, c.in2});
  Tensor want_dw = Tensor::empty({c.out, in}), want_db = c.bias ? Tensor::empty({c.out}) : Tensor();
  for (Tensor* t : {&dx1, &dh2, &da2, &dw, &want_dw}) testing::fill_nan(*t);
  if (c.bias) testing::fill_nan(db), testing::fill_nan(want_db);
  const Tensor cat = l.cat();
  for (bool overwrite : {true, false}) {
    const LinearWeight grad{dw, nullptr, nullptr, nullptr, nullptr, db};
    const LinearWeight want_grad{want_dw, nullptr, nullptr, nullptr, nullptr, want_db};
    linear_concat_gelu_backward(dx1, dh2, da2, grad, l.dy, l.x1, l.x2, l.weight(), l.h2, overwrite);
    linear_backward(want_dcat, want_grad, l.dy, cat, l.weight(), overwrite);
    copy_columns(want_dx1, 0, want_dcat, 0, c.in1);
    copy_columns(want_da2, 0, want_dcat, c.in1, c.in2);
    gelu_tanh_backward(want_dh2, want_da2, l.h2);
    const char* what = overwrite ? "written over" : "added to";
    EXPECT_LT(relative_error(dx1, values(want_dx1)), 1e-6) << what;
    EXPECT_LT(relative_error(dh2, values(want_dh2)), 1e-6) << what;
    EXPECT_LT(relative_error(dw, values(want_dw)), 1e-6) << what;
    if (c.bias) EXPECT_LT(relative_error(db, values(want_db)), 1e-6) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(OpsLinearConcat, OpsLinearConcat,
                         ::testing::Values(ConcatCase{1, 8, 8, 8, true}, ConcatCase{7, 9, 5, 6, true},
                                           ConcatCase{33, 24, 40, 16, false}, ConcatCase{64, 32, 96, 48, true}));

// A frozen weight (no weight gradient) still gets its input gradients and its bias's.
TEST(OpsLinearConcat, FrozenWeightGivesInputAndBiasGradients) {
  const ConcatLayer l({9, 8, 16, 12, true}, 73);
  Tensor dx1 = Tensor::empty({9, 8}), dh2 = Tensor::empty({9, 16}), da2 = Tensor::empty({9, 16});
  Tensor db = Tensor::empty({12}), want_dcat = Tensor::empty({9, 24}), want_db = Tensor::empty({12});
  linear_concat_gelu_backward(dx1, dh2, da2, LinearWeight{Tensor(), nullptr, nullptr, nullptr, nullptr, db}, l.dy,
                              l.x1, l.x2, l.weight(), l.h2, true);
  linear_backward(want_dcat, LinearWeight{Tensor(), nullptr, nullptr, nullptr, nullptr, want_db}, l.dy, l.cat(),
                  l.weight(), true);
  Tensor want_dx1 = Tensor::empty({9, 8});
  copy_columns(want_dx1, 0, want_dcat, 0, 8);
  EXPECT_LT(relative_error(dx1, values(want_dx1)), 1e-6);
  EXPECT_LT(relative_error(db, values(want_db)), 1e-6);
}

TEST(OpsLinearConcat, RefusesOtherDescriptorsAndShapes) {
  const ConcatLayer l({4, 8, 8, 8, true}, 74);
  Tensor y = Tensor::empty({4, 8});
  Fp8Linear fp8;
  LinearWeight fp8_weight = l.weight();
  fp8_weight.fp8 = &fp8;
  expect_error([&] { linear_concat_forward(y, l.x1, l.x2, fp8_weight); },
               {"linear_concat_forward", "plain weight", "FP8"});
  Tensor d1 = Tensor::empty({4, 8}), d2 = Tensor::empty({4, 8}), d3 = Tensor::empty({4, 8});
  expect_error([&] { linear_concat_gelu_backward(d1, d2, d3, fp8_weight, l.dy, l.x1, l.x2, l.weight(), l.h2, true); },
               {"linear_concat_gelu_backward", "plain weight"});
  expect_error([&] { linear_concat_forward(y, l.x1, Tensor::zeros({4, 9}), l.weight()); },
               {"linear_concat_forward", "weight [8, 16]", "8 + 9"});
  expect_error([&] { linear_concat_forward(y, l.x1, Tensor::zeros({5, 8}), l.weight()); },
               {"linear_concat_forward", "same rows"});
}

// A column block written with beta 0 and 1 leaves the matrix's other columns as they were;
// a block read as b gives what its dense copy gives.
TEST(OpsColumnBlocks, GemmsReadAndWriteOnlyTheirBlock) {
  Rng rng(75);
  const Tensor a = random_tensor({6, 5}, rng), wide = random_tensor({7, 12}, rng);
  Tensor out = random_tensor({6, 12}, rng);
  const Tensor before = out.clone();
  Tensor b_dense = Tensor::empty({7, 5});
  copy_columns(b_dense, 0, wide, 3, 5);
  // out[:, 4:11] = a b^T, b = wide[:, 3:8] ([n 7, k 5] with transpose_b)
  matmul_blocks(column_block(out, 4, 7), a, false, column_block(wide, 3, 5), true, 0.0f);
  Tensor want = Tensor::empty({6, 7});
  matmul(want, a, false, b_dense, true);
  Tensor got = Tensor::empty({6, 7});
  copy_columns(got, 0, out, 4, 7);
  EXPECT_TRUE(bitwise_equal(got, want));
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t col : {0, 1, 2, 3, 11})
      EXPECT_EQ(out.data<float>()[r * 12 + col], before.data<float>()[r * 12 + col]) << r << "," << col;
  matmul_blocks(column_block(out, 4, 7), a, false, column_block(wide, 3, 5), true, 1.0f);
  copy_columns(got, 0, out, 4, 7);
  matmul(want, a, false, b_dense, true, 1.0f, 1.0f);  // the block held a b^T before: now twice that
  EXPECT_LT(relative_error(got, values(want)), 1e-6);
  expect_error([&] { column_block(out, 8, 5); }, {"column_block", "columns [8, 13)", "[6, 12]"});
  expect_error([&] { matmul_blocks(column_block(out, 0, 6), a, false, column_block(wide, 3, 5), true, 0.0f); },
               {"matmul_blocks", "b's block [7, 5]"});
  EXPECT_FALSE(matmul_blocks_epilogue(MatmulEpilogue::Bias, all_columns(got), a, false, column_block(wide, 3, 5),
                                      true, 0.0f, nullptr, Tensor::zeros({7})))
      << "the CPU fuses nothing";
}

}  // namespace
}  // namespace forge
