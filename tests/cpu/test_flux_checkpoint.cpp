// FLUX checkpoints (train/flux_checkpoint.h, NOTE [FLUX checkpoints]): the master weights
// and both moments come back bit for bit (padding untouched), the metadata records the FLUX
// config, keep_latest_k prunes, and another preset, another block count, a language model's
// checkpoint, a FLUX checkpoint offered to a language model, a flipped byte and a truncated
// file are errors naming the checkpoint.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_metadata.h"
#include "core/rng.h"
#include "model/flux_parameters.h"
#include "model/parameters.h"
#include "test_data_temp_dir.h"
#include "train/flux_checkpoint.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

FluxConfig debug_with_blocks(int64_t doubles, int64_t singles) {
  FluxConfig c = flux_preset("flux-debug");
  c.num_double_blocks = doubles;
  c.num_single_blocks = singles;
  return c;
}

// A training state of `config` with distinct values in every tensor of master, m and v.
struct FluxState {
  FluxParameters master, m, v;
  explicit FluxState(const FluxConfig& config, uint64_t seed) : master(config), m(config), v(config) {
    master.initialize(seed);
    Rng rng(seed + 1);
    for (FluxParameters* p : {&m, &v})
      for (const Tensor& t : p->tensors())
        for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
  }
};

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.data_position = step;
  s.seed = 42;
  s.lr_schedule_steps = 10;
  s.optimizer_step = step;
  return s;
}

bool same_bits(const FluxParameters& a, const FluxParameters& b) {
  return a.flat().numel() == b.flat().numel() &&
         std::memcmp(a.flat().data<float>(), b.flat().data<float>(), a.flat().nbytes()) == 0;
}

std::string save(const std::string& folder, const FluxState& s, int64_t step, int64_t keep_latest_k = 0) {
  return save_flux_checkpoint(folder, "flux:\n  model: flux-debug\n", state_at(step), s.master, s.m, s.v,
                              keep_latest_k, size_t{1} << 12);
}

TEST(FluxCheckpoint, RoundTripIsBitExact) {
  TempDir tmp;
  const FluxConfig config = flux_preset("flux-debug");
  const FluxState saved(config, 7);
  const std::string dir = save(tmp.file("ckpt"), saved, 3);
  EXPECT_EQ(dir, checkpoint_dir(tmp.file("ckpt"), 3));
  const Checkpoint ck = open_checkpoint(dir);
  ASSERT_TRUE(ck.metadata.flux.has_value());
  EXPECT_EQ(ck.metadata.flux->name, "flux-debug");
  EXPECT_EQ(ck.metadata.flux->axes_dim, config.axes_dim);
  EXPECT_EQ(ck.metadata.training.step, 3);
  EXPECT_EQ(ck.metadata.training.data_position, 3);
  EXPECT_EQ(ck.metadata.files(), 1);
  EXPECT_NO_THROW(check_flux_checkpoint_model(ck, config, /*same_architecture=*/true));
  EXPECT_NO_THROW(verify_checkpoint_pieces(ck, 0, 1));
  // 12 bytes per parameter, without FluxParameters' padding.
  EXPECT_EQ(fs::file_size(dir + "/rank-0.bin"), static_cast<uintmax_t>(12 * config.total_params()));

  FluxState loaded(config, 99);
  read_flux_checkpoint(ck, loaded.master, &loaded.m, &loaded.v, size_t{1} << 12);
  EXPECT_TRUE(same_bits(loaded.master, saved.master));
  EXPECT_TRUE(same_bits(loaded.m, saved.m));
  EXPECT_TRUE(same_bits(loaded.v, saved.v));

  FluxState weights_only(config, 99);
  const FluxState untouched(config, 99);
  read_flux_checkpoint(ck, weights_only.master, nullptr, nullptr, size_t{1} << 20);
  EXPECT_TRUE(same_bits(weights_only.master, saved.master));
  EXPECT_TRUE(same_bits(weights_only.m, untouched.m));
}

TEST(FluxCheckpoint, MetadataRoundTripsTheFluxConfig) {
  CheckpointMetadata md;
  FluxConfig f = flux_preset("flux1-schnell");
  f.num_double_blocks = 2;
  f.rope_theta = 1234.5;
  md.flux = f;
  md.shards = {{0, 0}};
  md.file_numel = {0};
  const std::string text = metadata_to_json(md);
  EXPECT_NE(text.find("\"flux_model\""), std::string::npos);
  EXPECT_EQ(text.find("\"model\""), std::string::npos);
  const CheckpointMetadata back = metadata_from_json(text, "m.json");
  ASSERT_TRUE(back.flux.has_value());
  EXPECT_EQ(back.flux->name, "flux1-schnell");
  EXPECT_EQ(back.flux->num_double_blocks, 2);
  EXPECT_EQ(back.flux->guidance_embeds, false);
  EXPECT_EQ(back.flux->rope_theta, 1234.5);
  EXPECT_EQ(back.flux->context_dim, f.context_dim);
  // A bad FLUX config in the metadata names the file.
  std::string bad = text;
  const size_t at = bad.find("\"num_heads\": ");
  ASSERT_NE(at, std::string::npos);
  bad.replace(at, std::strlen("\"num_heads\": 24"), "\"num_heads\": -3");
  const std::string e = error_of([&] { metadata_from_json(bad, "m.json"); });
  EXPECT_NE(e.find("m.json"), std::string::npos) << e;
  EXPECT_NE(e.find("num_heads"), std::string::npos) << e;
}

TEST(FluxCheckpoint, KeepLatestK) {
  TempDir tmp;
  const FluxState s(flux_preset("flux-debug"), 1);
  for (int64_t step = 2; step <= 8; step += 2) save(tmp.file("ckpt"), s, step, 2);
  EXPECT_EQ(checkpoint_steps(tmp.file("ckpt")), (std::vector<int64_t>{6, 8}));
}

TEST(FluxCheckpoint, AnotherFluxModelIsRefused) {
  TempDir tmp;
  const std::string dir = save(tmp.file("ckpt"), FluxState(flux_preset("flux-debug"), 2), 1);
  const Checkpoint ck = open_checkpoint(dir);
  // Another block count: a tensor the checkpoint lacks.
  std::string e = error_of([&] { check_flux_checkpoint_model(ck, debug_with_blocks(3, 2), false); });
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  EXPECT_NE(e.find("transformer_blocks.2."), std::string::npos) << e;
  EXPECT_NE(e.find("2 double + 2 single blocks"), std::string::npos) << e;
  EXPECT_NE(e.find("3 double + 2 single blocks"), std::string::npos) << e;
  // Fewer blocks: tensors the configured model does not have.
  e = error_of([&] { check_flux_checkpoint_model(ck, debug_with_blocks(2, 1), false); });
  EXPECT_NE(e.find("single_transformer_blocks.1."), std::string::npos) << e;
  EXPECT_NE(e.find("does not have"), std::string::npos) << e;
  // Another preset: other shapes.
  FluxConfig schnell = flux_preset("flux1-schnell");
  schnell.num_double_blocks = 2;
  schnell.num_single_blocks = 2;
  e = error_of([&] { check_flux_checkpoint_model(ck, schnell, false); });
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  EXPECT_NE(e.find("flux1-schnell"), std::string::npos) << e;
  // The same tensors under another architecture field: refused on resume only.
  FluxConfig other_theta = flux_preset("flux-debug");
  other_theta.rope_theta = 500.0;
  EXPECT_NO_THROW(check_flux_checkpoint_model(ck, other_theta, false));
  e = error_of([&] { check_flux_checkpoint_model(ck, other_theta, true); });
  EXPECT_NE(e.find("flux_model.rope_theta"), std::string::npos) << e;
}

TEST(FluxCheckpoint, LanguageModelCheckpointsAndFluxCheckpointsRefuseEachOther) {
  TempDir tmp;
  ModelConfig lm;
  lm.name = "lm-test";
  lm.vocab_size = 16;
  lm.hidden_size = 8;
  lm.num_layers = 1;
  lm.num_heads = 2;
  lm.num_kv_heads = 1;
  lm.ffn_hidden_size = 16;
  int64_t numel = 0;
  for (const ParamSpec& s : parameter_specs(lm)) numel += shape_numel(s.shape);
  const std::vector<float> zeros(static_cast<size_t>(numel), 0.0f);
  const std::string lm_dir =
      save_checkpoint(tmp.file("lm"), lm, "", state_at(1), {{{0, numel}, zeros.data(), zeros.data(), zeros.data()}}, 0);
  std::string e = error_of([&] { check_flux_checkpoint_model(open_checkpoint(lm_dir), flux_preset("flux-debug"), true); });
  EXPECT_NE(e.find(lm_dir), std::string::npos) << e;
  EXPECT_NE(e.find("holds a language model ('lm-test'"), std::string::npos) << e;

  const std::string flux_dir = save(tmp.file("flux"), FluxState(flux_preset("flux-debug"), 3), 1);
  e = error_of([&] { check_checkpoint_model(open_checkpoint(flux_dir), lm, true); });
  EXPECT_NE(e.find(flux_dir), std::string::npos) << e;
  EXPECT_NE(e.find("holds a FLUX transformer ('flux-debug'"), std::string::npos) << e;
}

TEST(FluxCheckpoint, DamageIsRefusedNamingTheFileAndTensor) {
  TempDir tmp;
  const FluxConfig config = flux_preset("flux-debug");
  const std::string dir = save(tmp.file("ckpt"), FluxState(config, 4), 2);
  const std::string shard = dir + "/rank-0.bin";
  // A flipped byte in the first tensor's exp_avg (the file holds param, exp_avg, exp_avg_sq).
  const int64_t at = 4 * config.total_params();
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    char byte = 0;
    f.seekg(at);
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(at);
    f.write(&byte, 1);
  }
  std::string e = error_of([&] { verify_checkpoint_pieces(open_checkpoint(dir), 0, 1); });
  EXPECT_NE(e.find(shard), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'x_embedder.weight' (exp_avg)"), std::string::npos) << e;
  FluxState loaded(config, 5);
  e = error_of([&] { read_flux_checkpoint(open_checkpoint(dir), loaded.master, &loaded.m, &loaded.v, 1 << 16); });
  EXPECT_NE(e.find("x_embedder.weight"), std::string::npos) << e;
  // Truncated.
  fs::resize_file(shard, fs::file_size(shard) - 8);
  e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find(shard), std::string::npos) << e;
  EXPECT_NE(e.find("shorter than"), std::string::npos) << e;
}

}  // namespace
}  // namespace forge
