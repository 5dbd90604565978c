// FluxConfig's presets, validation, parameter and FLOP accounting; see flux_config.h.
#include "model/flux_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checked_math.h"
#include "core/error.h"

namespace forge {
namespace {

// Sums and products that stay empty once any term overflows (core/checked_math.h).
std::optional<int64_t> add(std::optional<int64_t> a, std::optional<int64_t> b) { return checked_add(a, b); }
std::optional<int64_t> mul(std::optional<int64_t> a, std::optional<int64_t> b) { return checked_mul(a, b); }
// A linear layer with a bias.
std::optional<int64_t> linear(int64_t in, int64_t out) { return add(mul(in, out), out); }

}  // namespace

void FluxConfig::validate(std::string_view source) const {
  auto positive = [&](int64_t v, const char* key) {
    FORGE_CHECK(v > 0, "{}: model.{} must be positive, got {}", source, key, v);
  };
  positive(in_channels, "in_channels");
  FORGE_CHECK(out_channels >= 0, "{}: model.out_channels must be >= 0 (0: in_channels), got {}", source,
              out_channels);
  positive(num_heads, "num_heads");
  positive(head_dim, "head_dim");
  FORGE_CHECK(head_dim % 2 == 0, "{}: model.head_dim must be even (rotary pairs), got {}", source, head_dim);
  FORGE_CHECK(num_double_blocks >= 0 && num_single_blocks >= 0 && num_double_blocks + num_single_blocks > 0,
              "{}: model.num_double_blocks ({}) and model.num_single_blocks ({}) must be >= 0, and not both 0",
              source, num_double_blocks, num_single_blocks);
  positive(mlp_ratio, "mlp_ratio");
  positive(context_dim, "context_dim");
  positive(pooled_dim, "pooled_dim");
  FORGE_CHECK(timestep_dim > 0 && timestep_dim % 2 == 0, "{}: model.timestep_dim must be positive and even, got {}",
              source, timestep_dim);
  FORGE_CHECK(axes_dim.size() == 3,
              "{}: model.axes_dim must list the rotary dims of the three position axes (text/index, row, column), "
              "got {} entries",
              source, axes_dim.size());
  int64_t sum = 0;
  for (int64_t d : axes_dim) {
    FORGE_CHECK(d > 0 && d % 2 == 0, "{}: model.axes_dim entries must be positive and even, got [{}]", source,
                fmt::join(axes_dim, ", "));
    sum += d;
  }
  FORGE_CHECK(sum == head_dim, "{}: model.axes_dim [{}] must sum to model.head_dim {}", source,
              fmt::join(axes_dim, ", "), head_dim);
  FORGE_CHECK(rope_theta > 0, "{}: model.rope_theta must be positive, got {}", source, rope_theta);
  FORGE_CHECK(norm_eps > 0, "{}: model.norm_eps must be positive, got {}", source, norm_eps);
  FORGE_CHECK(checked_total_params().has_value(), "{}: the parameter count overflows", source);
}

std::optional<int64_t> FluxConfig::checked_double_block_params() const {
  const int64_t d = hidden(), m = mlp_hidden();
  // Per stream: modulation (6 vectors), fused qkv, q/k norms, output, MLP in and out.
  const auto stream = add(add(add(linear(d, 6 * d), linear(d, 3 * d)), add(2 * head_dim, linear(d, d))),
                          add(linear(d, m), linear(m, d)));
  return mul(2, stream);
}

std::optional<int64_t> FluxConfig::checked_single_block_params() const {
  const int64_t d = hidden(), m = mlp_hidden();
  return add(add(add(linear(d, 3 * d), linear(d, 3 * d)), add(2 * head_dim, linear(d, m))), linear(d + m, d));
}

std::optional<int64_t> FluxConfig::checked_total_params() const {
  const int64_t d = hidden();
  auto mlp_embedder = [&](int64_t in) { return add(linear(in, d), linear(d, d)); };
  auto embedders = add(add(linear(in_channels, d), linear(context_dim, d)),
                       add(mlp_embedder(timestep_dim), mlp_embedder(pooled_dim)));
  if (guidance_embeds) embedders = add(embedders, mlp_embedder(timestep_dim));
  const auto head = add(linear(d, 2 * d), linear(d, resolved_out_channels()));
  const auto blocks =
      add(mul(num_double_blocks, checked_double_block_params()), mul(num_single_blocks, checked_single_block_params()));
  return add(add(embedders, head), blocks);
}

int64_t FluxConfig::total_params() const {
  const auto n = checked_total_params();
  FORGE_CHECK(n.has_value(), "flux config {}: the parameter count overflows", name);
  return *n;
}

// NOTE [FLUX FLOPs]
// Model FLOPs of one image, as the LLM count does it (../shared/PERF.md): 2 per
// multiply-add of every matrix product in the forward, times 3 for forward + backward
// (the backward's two GEMMs per projection, attention's backward likewise), recomputation
// not counted. Per token of a stream, a double block's projections hold 4D^2 + 2DM
// weights (qkv 3D^2, output D^2, MLP 2DM) and a single block's the same (qkv 3D^2, MLP
// in DM, output (D + M) D); attention over the T = image + text tokens adds 4 T^2 D per
// block (scores and values, non-causal). Once per image: the embedders (latent tokens and
// text tokens into D, the time, guidance and pooled-text MLPs), every block's modulation
// projection (6D x D per stream of a double block, 3D x D per single block) and the head
// (2D x D modulation, D x out per image token). Biases, norms and activations are not
// counted.
double FluxConfig::training_flops_per_image(int64_t image_tokens, int64_t text_tokens) const {
  const double d = static_cast<double>(hidden()), m = static_cast<double>(mlp_hidden());
  const double s = static_cast<double>(image_tokens), l = static_cast<double>(text_tokens), t = s + l;
  const double per_token_block = 4 * d * d + 2 * d * m;
  const double blocks = static_cast<double>(num_double_blocks + num_single_blocks);
  double macs = blocks * (per_token_block * t + 2 * t * t * d);
  macs += static_cast<double>(num_double_blocks) * 2 * 6 * d * d + static_cast<double>(num_single_blocks) * 3 * d * d;
  macs += s * static_cast<double>(in_channels) * d + l * static_cast<double>(context_dim) * d;
  const double embedders = (guidance_embeds ? 2 : 1) * (static_cast<double>(timestep_dim) * d + d * d) +
                           static_cast<double>(pooled_dim) * d + d * d;
  macs += embedders + 2 * d * d + s * d * static_cast<double>(resolved_out_channels());
  return 3 * 2 * macs;
}

FluxConfig flux_preset(std::string_view name) {
  FluxConfig c;
  c.name = std::string(name);
  if (name == "flux1-dev") return c;
  if (name == "flux1-schnell") {
    c.guidance_embeds = false;
    return c;
  }
  if (name == "flux-debug") {
    // Every kind of piece of the real model, small: 2 heads of 16 (rotary axes 4/6/6),
    // 2 double and 2 single blocks, T5-like features of 32 and a pooled vector of 16.
    c.num_heads = 2;
    c.head_dim = 16;
    c.axes_dim = {4, 6, 6};
    c.num_double_blocks = 2;
    c.num_single_blocks = 2;
    c.context_dim = 32;
    c.pooled_dim = 16;
    return c;
  }
  if (name == "flux-small") {
    // flux-debug's blocks and text sizes with a hidden size of 128 (4 heads of 32, rotary axes
    // 8/12/12), wider than a token's 64 features: big enough to learn small images, as the
    // coloured-shapes demonstration does (scripts/flux_shapes_demo.py), fast on a GPU.
    c.num_heads = 4;
    c.head_dim = 32;
    c.axes_dim = {8, 12, 12};
    c.num_double_blocks = 2;
    c.num_single_blocks = 2;
    c.context_dim = 32;
    c.pooled_dim = 16;
    return c;
  }
  FORGE_CHECK(false, "unknown FLUX model '{}': expected one of {}", name, fmt::join(flux_preset_names(), ", "));
  return c;
}

std::vector<std::string> flux_preset_names() { return {"flux1-dev", "flux1-schnell", "flux-small", "flux-debug"}; }

bool is_flux_preset(std::string_view name) {
  for (const std::string& preset : flux_preset_names())
    if (preset == name) return true;
  return false;
}

}  // namespace forge
