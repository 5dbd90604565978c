// forge info for FLUX models; see flux_info.h.
#include "cli/flux_info.h"

#include <charconv>

#include <fmt/format.h>

#include "core/error.h"
#include "distributed/flux_fsdp.h"
#include "model/activations.h"
#include "model/flux_config.h"
#include "model/flux_transformer.h"

namespace forge {
namespace {

// An integer of at least `least` (`expected` says what, for the error).
int64_t integer_at_least(const std::string& key, const std::string& value, int64_t least, const char* expected) {
  int64_t v = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), v);
  FORGE_CHECK(error == std::errc() && end == value.data() + value.size() && v >= least,
              "forge info: --{} expects {}, got '{}'", key, expected, value);
  return v;
}

int64_t positive_integer(const std::string& key, const std::string& value) {
  return integer_at_least(key, value, 1, "a positive integer");
}

}  // namespace

int run_flux_info(const std::string& name, const std::vector<std::pair<std::string, std::string>>& overrides) {
  const FluxConfig c = flux_preset(name);
  int64_t batch = 1, resolution = 1024, text_tokens = 512, shard_ranks = 1, zero_stage = 3;
  ActivationCheckpoint checkpoint = ActivationCheckpoint::Full;
  std::string master_dtype = "fp32", state_dtype = "fp32";  // NOTE [bf16 master weights]
  int64_t recompute_blocks = -1;  // NOTE [Recomputing some FLUX blocks]
  auto dtype_choice = [&](const std::string& key, const std::string& value) {
    FORGE_CHECK(value == "fp32" || value == "bf16", "forge info {}: --{} expects fp32 or bf16, got '{}'", name, key,
                value);
    return value;
  };
  for (const auto& [key, value] : overrides) {
    if (key == "training.local_batch_size")
      batch = positive_integer(key, value);
    else if (key == "flux.resolution")
      resolution = positive_integer(key, value);
    else if (key == "flux.text_tokens")
      text_tokens = positive_integer(key, value);
    else if (key == "activation_checkpoint.mode")
      checkpoint = activation_checkpoint_from_name(value);
    else if (key == "parallelism.data_parallel_shard_degree")
      shard_ranks = positive_integer(key, value);
    else if (key == "parallelism.zero_stage")
      zero_stage = positive_integer(key, value);
    else if (key == "activation_checkpoint.recompute_blocks")
      recompute_blocks = integer_at_least(key, value, -1, "-1 (every block) or a count of blocks");
    else if (key == "optimizer.master_dtype")
      master_dtype = dtype_choice(key, value);
    else if (key == "optimizer.state_dtype")
      state_dtype = dtype_choice(key, value);
    else
      FORGE_FAIL("forge info {}: unknown key --{}; a FLUX model takes --training.local_batch_size, "
                 "--flux.resolution, --flux.text_tokens, --activation_checkpoint.mode, "
                 "--activation_checkpoint.recompute_blocks, --parallelism.data_parallel_shard_degree, "
                 "--parallelism.zero_stage, --optimizer.master_dtype and --optimizer.state_dtype",
                 name, key);
  }
  FORGE_CHECK(shard_ranks == 1 || (master_dtype == "fp32" && state_dtype == "fp32"),
              "forge info {}: FSDP's chunks keep fp32 master weights and moments; --optimizer.master_dtype and "
              "--optimizer.state_dtype bf16 are for one device",
              name);
  // The VAE halves the image three times (8x) and the patchify twice more (2x2 patches).
  FORGE_CHECK(zero_stage <= 3, "forge info {}: --parallelism.zero_stage {}: 1, 2 or 3", name, zero_stage);
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
  // NOTE [bf16 master weights]: bf16 masters are the compute weights (no copy).
  const bool bf16_master = master_dtype == "bf16";
  const double n = static_cast<double>(params);
  const double weights = bf16_master ? 0.0 : 2.0 * n, master = (bf16_master ? 2.0 : 4.0) * n;
  const double grads = 4.0 * n, moments = (state_dtype == "bf16" ? 4.0 : 8.0) * n;
  const double activations = static_cast<double>(
      FluxTransformer::activation_bytes(c, shape, DType::BF16, checkpoint, recompute_blocks));
  const std::string recomputed =
      checkpoint != ActivationCheckpoint::Full || recompute_blocks == -1
          ? std::string()
          : fmt::format(" (recomputing {} of {} blocks)", recompute_blocks, c.num_double_blocks + c.num_single_blocks);
  fmt::print("memory           micro-batch {}, activation_checkpoint.mode {}{}, optimizer.master_dtype {}, "
             "optimizer.state_dtype {}, on one device:\n",
             batch, activation_checkpoint_name(checkpoint), recomputed, master_dtype, state_dtype);
  if (bf16_master) {
    fmt::print("  weights        {:8.2f} GiB  bf16, the only copy (stochastic rounding)\n", master / gib);
  } else {
    fmt::print("  weights        {:8.2f} GiB  bf16 compute copy\n", weights / gib);
    fmt::print("  master         {:8.2f} GiB  fp32\n", master / gib);
  }
  fmt::print("  gradients      {:8.2f} GiB  fp32\n", grads / gib);
  fmt::print("  AdamW moments  {:8.2f} GiB  {} x 2\n", moments / gib, state_dtype);
  fmt::print("  activations    {:8.2f} GiB  bf16, the arena of one micro-batch\n", activations / gib);
  fmt::print("  total          {:8.2f} GiB\n", (weights + master + grads + moments + activations) / gib);
  if (shard_ranks == 1) return 0;
  // NOTE [FLUX FSDP]: what each rank of the shard group holds, from FSDP's layout of the
  // units (the largest rank's chunk; fp32 reduction, whose reduced-chunk buffers are counted
  // as if the step accumulates).
  const FsdpLayout layout = flux_fsdp_layout(c, static_cast<int>(shard_ranks), 0);
  const double chunk = static_cast<double>(layout.shard_numel());
  const double ends = static_cast<double>(layout.units().front().numel + layout.units().back().numel);
  const double full = static_cast<double>(layout.full_numel());
  const double block = static_cast<double>(layout.max_block_numel()), unit = static_cast<double>(layout.max_unit_numel());
  const double fsdp_weights = zero_stage == 3 ? 2.0 * (ends + 3.0 * block) : 2.0 * full;
  const double full_grads = zero_stage == 1 ? 4.0 * full : 2.0 * 4.0 * unit;
  const double reduced = 2.0 * 4.0 * static_cast<double>(layout.max_shard_numel());
  fmt::print("per rank         FSDP ZeRO-{} over {} shard ranks (NOTE [FLUX FSDP]):\n", zero_stage, shard_ranks);
  fmt::print("  weights        {:8.2f} GiB  bf16: {}\n", fsdp_weights / gib,
             zero_stage == 3 ? "the embedders and head, three gathered blocks" : "every unit");
  fmt::print("  master         {:8.2f} GiB  fp32 chunk\n", 4.0 * chunk / gib);
  fmt::print("  gradients      {:8.2f} GiB  fp32 chunk, + {:.2f} GiB {}\n", 4.0 * chunk / gib, full_grads / gib,
             zero_stage == 1 ? "full-size fp32" : "in two rotating unit buffers");
  fmt::print("  AdamW moments  {:8.2f} GiB  fp32 x 2, the chunk's\n", 8.0 * chunk / gib);
  fmt::print("  reductions     {:8.2f} GiB  reduced chunks\n", reduced / gib);
  fmt::print("  activations    {:8.2f} GiB\n", activations / gib);
  fmt::print("  total          {:8.2f} GiB\n",
             (fsdp_weights + 16.0 * chunk + full_grads + reduced + activations) / gib);
  return 0;
}

}  // namespace forge
