// FLUX's time features and rotary tables; see flux_embeddings.h.
#include "model/flux_embeddings.h"

#include <cmath>

namespace forge {

Tensor timestep_features(const std::vector<float>& values, int64_t dim) {
  FORGE_CHECK(dim > 0 && dim % 2 == 0, "timestep_features: dim {} must be positive and even", dim);
  const int64_t half = dim / 2;
  Tensor out = Tensor::empty({static_cast<int64_t>(values.size()), dim});
  float* p = out.data<float>();
  for (size_t b = 0; b < values.size(); ++b)
    for (int64_t k = 0; k < half; ++k) {
      // diffusers computes the frequencies and their product with the time in fp32.
      const float freq = std::exp(-std::log(10000.0f) * static_cast<float>(k) / static_cast<float>(half));
      const float angle = values[b] * freq;
      p[static_cast<int64_t>(b) * dim + k] = std::cos(angle);
      p[static_cast<int64_t>(b) * dim + half + k] = std::sin(angle);
    }
  return out;
}

void flux_rope_tables(Tensor& cos, Tensor& sin, const FluxConfig& config, int64_t text_tokens, int64_t grid_h,
                      int64_t grid_w) {
  FORGE_CHECK(text_tokens >= 0 && grid_h > 0 && grid_w > 0, "flux_rope_tables: {} text tokens, a {}x{} grid",
              text_tokens, grid_h, grid_w);
  const int64_t tokens = text_tokens + grid_h * grid_w, pairs = config.head_dim / 2;
  cos = Tensor::empty({tokens, pairs});
  sin = Tensor::empty({tokens, pairs});
  float* c = cos.data<float>();
  float* s = sin.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t image = t - text_tokens;
    const double position[3] = {0.0, image < 0 ? 0.0 : static_cast<double>(image / grid_w),
                                image < 0 ? 0.0 : static_cast<double>(image % grid_w)};
    int64_t pair = 0;
    for (size_t axis = 0; axis < config.axes_dim.size(); ++axis) {
      const int64_t d = config.axes_dim[axis];
      const double pos = axis < 3 ? position[axis] : 0.0;
      for (int64_t k = 0; k < d / 2; ++k, ++pair) {
        const double angle = pos * std::pow(config.rope_theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
        c[t * pairs + pair] = static_cast<float>(std::cos(angle));
        s[t * pairs + pair] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

}  // namespace forge
