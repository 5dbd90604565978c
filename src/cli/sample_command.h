// forge sample: images from a FLUX transformer (NOTE [FLUX sampling] in
// train/flux_sampler.h), written as PNG files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace forge {

struct SampleOptions {
  std::string transformer, model, pipeline, vae, t5, clip, t5_tokenizer, clip_tokenizer, scheduler;
  int64_t double_blocks = -1, single_blocks = -1;
  std::vector<std::string> prompts;
  std::string prompts_file;
  int64_t width = 0, height = 0;  // when not given: 128 latent positions a side (FluxPipeline's default)
  bool width_given = false, height_given = false;
  int64_t steps = 28;
  double guidance = 3.5;
  uint64_t seed = 0;
  int64_t images_per_prompt = 1, batch_size = 1, text_tokens = 512;
  std::string device = "cpu", output, initial_noise;
  bool overwrite = false;
};

// Adds the `sample` subcommand with its flags to `app`, filling `options`.
CLI::App* add_sample_command(CLI::App& app, SampleOptions& options);
int run_sample(const SampleOptions& options);

}  // namespace forge
