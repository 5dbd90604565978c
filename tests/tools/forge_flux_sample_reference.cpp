// Test tool: forge's FLUX sampling pieces on inputs written by
// tests/python/test_flux_sample_vs_diffusers.py.
//
//   forge_flux_sample_reference sigmas SCHEDULER STEPS TOKENS OUT.json
//       flux_sampling_sigmas of the schedule at SCHEDULER (a pipeline folder, a scheduler
//       folder or its scheduler_config.json; "-" for the defaults) and the model times
//   forge_flux_sample_reference sample DIR
//       reads DIR/request.json {"pipeline", "prompts", "height", "width", "steps", "guidance",
//       "text_tokens", "batch_size"} and DIR/noise.bin (fp32 [N, C, h, w], N = the prompts),
//       samples on the CPU as forge sample does, and writes DIR/image.bin (fp32 [N, 3, H, W],
//       the decoded image in [-1, 1]) and DIR/text.bin, DIR/pooled.bin (the prompt encodings)
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/flux_transformer_config.h"
#include "ckpt/flux_weights.h"
#include "ops/patchify.h"
#include "train/flux_latent_decoder.h"
#include "train/flux_prompt_encoder.h"
#include "train/flux_sampler.h"

using nlohmann::json;
using namespace forge;

namespace {

void write(const std::string& path, const Tensor& t) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
}

int sigmas(const std::string& scheduler, int64_t steps, int64_t tokens, const std::string& out) {
  const FluxSamplingSchedule s = scheduler == "-" ? FluxSamplingSchedule{} : read_flux_sampling_schedule(scheduler);
  const std::vector<float> sigmas = flux_sampling_sigmas(s, steps, tokens);
  std::vector<float> times;
  for (const float sigma : sigmas) times.push_back(flux_model_time(sigma));
  std::ofstream(out) << json{{"sigmas", sigmas}, {"times", times}}.dump();
  return 0;
}

int sample(const std::string& dir) {
  const json r = json::parse(std::ifstream(dir + "/request.json"));
  const std::string pipeline = r.at("pipeline");
  const std::vector<std::string> prompts = r.at("prompts");
  const int64_t n = static_cast<int64_t>(prompts.size()), height = r.at("height"), width = r.at("width"),
                text_tokens = r.at("text_tokens"), batch_size = r.value("batch_size", n);
  const FluxConfig config = read_flux_transformer_config(pipeline);
  FluxPromptEncoder encoder({pipeline, pipeline, pipeline, pipeline}, Device::CPU, text_tokens);
  const Tensor text = Tensor::empty({n, text_tokens, config.context_dim});
  const Tensor pooled = Tensor::empty({n, config.pooled_dim});
  encoder.encode(prompts, text, pooled);
  write(dir + "/text.bin", text);
  write(dir + "/pooled.bin", pooled);
  FluxParameters params(config);
  load_flux_weights(pipeline, params);
  FluxLatentDecoder decoder(r.value("vae", pipeline), Device::CPU);
  const int64_t f = decoder.factor(), c = decoder.latent_channels(), h = height / f, w = width / f;
  const Tensor noise = Tensor::empty({n, c, h, w});
  {
    std::ifstream in(dir + "/noise.bin", std::ios::binary);
    in.read(reinterpret_cast<char*>(noise.data<float>()), static_cast<std::streamsize>(noise.nbytes()));
    FORGE_CHECK(in.gcount() == static_cast<std::streamsize>(noise.nbytes()), "{}/noise.bin: expected {} bytes", dir,
                noise.nbytes());
  }
  const Tensor image = Tensor::empty({n, 3, height, width});
  const std::vector<float> sigmas =
      flux_sampling_sigmas(read_flux_sampling_schedule(pipeline), r.at("steps"), (h / 2) * (w / 2));
  for (int64_t first = 0; first < n; first += batch_size) {
    const int64_t b = std::min(batch_size, n - first);
    FluxDenoiser denoiser(config, {b, text_tokens, h / 2, w / 2}, Device::CPU, params);
    const Tensor tokens = Tensor::empty({b, (h / 2) * (w / 2), config.in_channels});
    const Tensor latents = Tensor::empty({b, c, h, w});
    patchify(tokens, noise.narrow(first, first + b), 2);
    denoiser.denoise(tokens, text.narrow(first, first + b), pooled.narrow(first, first + b), sigmas,
                     r.at("guidance").get<float>());
    unpatchify(latents, tokens, 2);
    decoder.decode(image.narrow(first, first + b), latents);
  }
  write(dir + "/image.bin", image);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "sigmas" && argc == 6) return sigmas(argv[2], std::stoll(argv[3]), std::stoll(argv[4]), argv[5]);
  if (mode == "sample" && argc == 3) return sample(argv[2]);
  std::cerr << "usage: forge_flux_sample_reference sigmas SCHEDULER STEPS TOKENS OUT.json | sample DIR\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
