// The pixel autoencoder's fold and unfold; see pixel_latents.h.
#include "model/pixel_latents.h"

#include "core/error.h"

namespace forge {
namespace {

// {B, H, W} of an image and its latents, after checking both against NOTE [Pixel latents].
Shape check_pair(const Tensor& image, const Tensor& latents, const char* what) {
  FORGE_CHECK(image.device() == Device::CPU && latents.device() == Device::CPU && image.dtype() == DType::F32 &&
                  latents.dtype() == DType::F32,
              "{}: pixel latents are fp32 host tensors", what);
  FORGE_CHECK(image.ndim() == 4 && image.dim(1) == 3 && image.dim(2) % 2 == 0 && image.dim(3) % 2 == 0,
              "{}: an image [B, 3, H, W] with even H and W, got {}", what, shape_str(image.shape()));
  const Shape expected{image.dim(0), kPixelLatentChannels, image.dim(2) / 2, image.dim(3) / 2};
  FORGE_CHECK(latents.shape() == expected, "{}: latents {} for an image {}, expected {}", what,
              shape_str(latents.shape()), shape_str(image.shape()), shape_str(expected));
  return {image.dim(0), image.dim(2), image.dim(3)};
}

}  // namespace

void pixel_latents_encode(const Tensor& latents, const Tensor& image) {
  const Shape s = check_pair(image, latents, "pixel_latents_encode");
  const int64_t batch = s[0], height = s[1], width = s[2], h = height / 2, w = width / 2;
  const float* in = image.data<float>();
  float* out = latents.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t sub = 0; sub < 4; ++sub)
      for (int64_t c = 0; c < 4; ++c) {
        float* plane = out + ((b * kPixelLatentChannels) + sub * 4 + c) * h * w;
        for (int64_t y = 0; y < h; ++y)
          for (int64_t x = 0; x < w; ++x)
            plane[y * w + x] =
                c < 3 ? in[((b * 3 + c) * height + 2 * y + sub / 2) * width + 2 * x + sub % 2] : 0.0f;
      }
}

void pixel_latents_decode(const Tensor& image, const Tensor& latents) {
  const Shape s = check_pair(image, latents, "pixel_latents_decode");
  const int64_t batch = s[0], height = s[1], width = s[2], h = height / 2, w = width / 2;
  const float* in = latents.data<float>();
  float* out = image.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t yy = 0; yy < height; ++yy)
        for (int64_t xx = 0; xx < width; ++xx) {
          const int64_t sub = (yy % 2) * 2 + xx % 2;
          out[((b * 3 + c) * height + yy) * width + xx] =
              in[((b * kPixelLatentChannels + sub * 4 + c) * h + yy / 2) * w + xx / 2];
        }
}

}  // namespace forge
