// NOTE [Non-finite steps] (train/nonfinite.h): the scan that names the first non-finite
// tensor, the poisoning the test hook does, and FORGE_TEST_INJECT_NAN's parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "expect_error.h"
#include "train/nonfinite.h"

namespace forge {
namespace {

Tensor filled(Shape shape, float value) {
  Tensor t = Tensor::empty(std::move(shape), DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value;
  return t;
}

TEST(NonFinite, FirstNonFiniteTensorInOrder) {
  std::vector<Tensor> tensors{filled({2, 3}, 1.0f), filled({4}, 2.0f), filled({3, 2}, 3.0f)};
  EXPECT_EQ(first_nonfinite_tensor(tensors), -1);
  tensors[2].data<float>()[5] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_nonfinite_tensor(tensors), 2);
  tensors[1].data<float>()[3] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_nonfinite_tensor(tensors), 1);
}

TEST(NonFinite, PoisonSetsOnlyTheFirstElement) {
  Tensor t = filled({3, 4}, 0.5f);
  poison_first_element(t);
  EXPECT_TRUE(std::isnan(t.data<float>()[0]));
  for (int64_t i = 1; i < t.numel(); ++i) EXPECT_EQ(t.data<float>()[i], 0.5f);
  EXPECT_EQ(first_nonfinite_tensor({filled({2}, 1.0f), t}), 1);
}

class InjectNanVariable : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("FORGE_TEST_INJECT_NAN"); }
  std::optional<NanInjection> parse(const char* value) {
    setenv("FORGE_TEST_INJECT_NAN", value, 1);
    return nan_injection_from_env();
  }
};

TEST_F(InjectNanVariable, UnsetOrEmptyMeansNone) {
  unsetenv("FORGE_TEST_INJECT_NAN");
  EXPECT_FALSE(nan_injection_from_env());
  EXPECT_FALSE(parse(""));
}

TEST_F(InjectNanVariable, StepTensorAndMicroBatch) {
  const auto a = parse("3:layers.0.mlp.down.weight");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->step, 3);
  EXPECT_EQ(a->tensor, "layers.0.mlp.down.weight");
  EXPECT_EQ(a->micro_batch, 0);
  const auto b = parse("12:output.weight:2");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->step, 12);
  EXPECT_EQ(b->tensor, "output.weight");
  EXPECT_EQ(b->micro_batch, 2);
}

TEST_F(InjectNanVariable, MalformedValuesNameTheVariable) {
  expect_error([&] { parse("output.weight"); }, {"FORGE_TEST_INJECT_NAN='output.weight'", "STEP:TENSOR"});
  expect_error([&] { parse("x:output.weight"); }, {"FORGE_TEST_INJECT_NAN", "step 'x'"});
  expect_error([&] { parse("2:output.weight:-1"); }, {"micro-batch '-1'"});
  expect_error([&] { parse("2:"); }, {"tensor name is empty"});
}

}  // namespace
}  // namespace forge
