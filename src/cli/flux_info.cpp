// forge info for FLUX models; see flux_info.h.
#include "cli/flux_info.h"

#include <charconv>

#include <fmt/format.h>

#include "core/error.h"
#include "model/activations.h"
#include "model/flux_config.h"
#include "model/flux_transformer.h"

namespace forge {
namespace {

int64_t positive_integer(const std::string& key, const std::string& value) {
  int64_t v = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  FORGE_CHECK(error == std::errc() && end == value.data() + value.size() && v > 0,
              "forge info: --{} expects a positive integer, got '{}'", key, value);
  return v;
}

}  // namespace

int run_flux_info(const std::string& name, const std::vector<std::pair<std::string, std::string>>& overrides) {
  const FluxConfig c = flux_preset(name);
  int64_t batch = 1, resolution = 1024, text_tokens = 512;
  ActivationCheckpoint checkpoint = ActivationCheckpoint::Full;
  for (const auto& [key, value] : overrides) {
    if (key == "training.local_batch_size")
      batch = positive_integer(key, value);
    else if (key == "flux.resolution")
      resolution = positive_integer(key, value);
    else if (key == "flux.text_tokens")
      text_tokens = positive_integer(key, value);
    else if (key == "activation_checkpoint.mode")
      checkpoint = activation_checkpoint_from_name(value);
    else
      FORGE_FAIL("forge info {}: unknown key --{}; a FLUX model takes --training.local_batch_size, "
                 "--flux.resolution, --flux.text_tokens and --activation_checkpoint.mode",
                 name, key);
  }
  // The VAE halves the image three times (8x) and the patchify twice more (2x2 patches).
  FORGE_CHECK(resolution % 16 == 0, "forge info {}: --flux.resolution {} must be a multiple of 16 (the VAE's 8x "
              "and the 2x2 patches)", name, resolution);
  FluxShape shape;
  shape.batch = batch;
  shape.text_tokens = text_tokens;
  shape.grid_h = shape.grid_w = resolution / 16;
  const int64_t params = c.total_params();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  fmt::print("model            {}\n", c.name);
  fmt::print("architecture     {} double-stream + {} single-stream blocks, hidden {} ({} heads of {}, rotary axes "
             "{}/{}/{}), MLP {} (GELU tanh), text features {}, pooled text {}, {}\n",
             c.num_double_blocks, c.num_single_blocks, c.hidden(), c.num_heads, c.head_dim, c.axes_dim[0],
             c.axes_dim[1], c.axes_dim[2], c.mlp_hidden(), c.context_dim, c.pooled_dim,
             c.guidance_embeds ? "guidance embedded (distilled)" : "no guidance embedding");
  fmt::print("parameters       {:.2f} B ({})\n", static_cast<double>(params) / 1e9, params);
  fmt::print("tokens           {}x{} images: {} image tokens (a {}x{} latent of {} channels in 2x2 patches of {} "
             "features) + {} text tokens\n",
             resolution, resolution, shape.image_tokens(), resolution / 8, resolution / 8, c.in_channels / 4,
             c.in_channels, text_tokens);
  fmt::print("FLOPs per image  {:.3e} (forward + backward; NOTE [FLUX FLOPs])\n",
             c.training_flops_per_image(shape.image_tokens(), text_tokens));
  const double weights = 2.0 * static_cast<double>(params), master = 4.0 * static_cast<double>(params);
  const double grads = 4.0 * static_cast<double>(params), moments = 8.0 * static_cast<double>(params);
  const double activations =
      static_cast<double>(FluxTransformer::activation_bytes(c, shape, DType::BF16, checkpoint));
  fmt::print("memory           micro-batch {}, activation_checkpoint.mode {}, on one device:\n", batch,
             activation_checkpoint_name(checkpoint));
  fmt::print("  weights        {:8.2f} GiB  bf16 compute copy\n", weights / gib);
  fmt::print("  master         {:8.2f} GiB  fp32\n", master / gib);
  fmt::print("  gradients      {:8.2f} GiB  fp32\n", grads / gib);
  fmt::print("  AdamW moments  {:8.2f} GiB  fp32 x 2\n", moments / gib);
  fmt::print("  activations    {:8.2f} GiB  bf16, the arena of one micro-batch\n", activations / gib);
  fmt::print("  total          {:8.2f} GiB\n", (weights + master + grads + moments + activations) / gib);
  return 0;
}

}  // namespace forge
