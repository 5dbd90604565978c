// Helpers shared by the op tests (test_ops_*.cpp): random inputs, comparisons with
// max-abs normalization, and central finite differences of a scalar loss.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace forge::testing {

inline Tensor random_tensor(const Shape& shape, Rng& rng, double scale = 1.0) {
  Tensor t = Tensor::empty(shape);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(scale * rng.normal());
  return t;
}

inline std::vector<double> to_double(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<double>(p, p + t.numel());
}

// max |got - want| / max |want|: an error relative to the scale of the whole result, so
// elements near zero do not dominate.
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

inline double relative_error(const Tensor& got, const std::vector<double>& want) {
  return relative_error(to_double(got), want);
}

// sqrt(sum (got - want)^2 / sum want^2) over fp32 CPU tensors.
inline double relative_l2(const Tensor& got, const Tensor& want) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double w = want.data<float>()[i], e = got.data<float>()[i] - w;
    diff += e * e;
    norm += w * w;
  }
  return std::sqrt(diff / norm);
}

// sum(out * weights) in double: the scalar loss whose gradient with respect to out is weights.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  const float* o = out.data<float>();
  const float* w = weights.data<float>();
  double s = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i) s += static_cast<double>(o[i]) * w[i];
  return s;
}

// Central differences of loss() with respect to every element of input (perturbed in place
// and restored). The step actually taken in fp32 is used as the denominator.
inline std::vector<double> finite_difference(const Tensor& input, const std::function<double()>& loss,
                                             float eps = 1e-2f) {
  float* p = input.data<float>();
  std::vector<double> grad(input.numel());
  for (int64_t i = 0; i < input.numel(); ++i) {
    float saved = p[i];
    float plus = saved + eps, minus = saved - eps;
    p[i] = plus;
    double loss_plus = loss();
    p[i] = minus;
    double loss_minus = loss();
    p[i] = saved;
    grad[i] = (loss_plus - loss_minus) / (static_cast<double>(plus) - static_cast<double>(minus));
  }
  return grad;
}

// Fills an fp32 CPU tensor with NaN, so a value an op was meant to write but did not shows.
inline void fill_nan(const Tensor& t) {
  std::fill_n(t.data<float>(), t.numel(), std::numeric_limits<float>::quiet_NaN());
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace forge::testing
