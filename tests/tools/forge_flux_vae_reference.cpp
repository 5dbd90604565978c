// Test tool: runs forge's CPU FLUX VAE on inputs written by
// tests/python/test_flux_vae_vs_diffusers.py.
//
//   forge_flux_vae_reference files CONFIG OUT
//     reads the diffusers config.json CONFIG and writes OUT: {"diffusers": [[name, shape], ...],
//     "bfl": [...]}, every tensor of a weight file in each layout, in parameter order
//   forge_flux_vae_reference run WEIGHTS DIR [CONFIG]
//     loads the VAE at WEIGHTS (a diffusers folder or BFL's single file, whose architecture
//     is CONFIG's when given instead of FLUX's), reads DIR/run.json
//     ({"batch", "height", "width"}), DIR/image.bin [B, in, H, W], DIR/noise.bin and
//     DIR/latents_in.bin [B, L, H/f, W/f] (fp32), and writes (fp32) DIR/moments.bin (the
//     encoder's mean and log-variance, [B, 2L, H/f, W/f]), DIR/latents.bin (the scaled mode),
//     DIR/sampled.bin (the scaled sample with noise.bin) and DIR/decoded.bin (the decoder's
//     image of latents_in.bin, [B, out, H, W]).
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/flux_vae_weights.h"
#include "model/flux_vae.h"

using namespace forge;

namespace {

Tensor read(const std::string& path, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape));
  std::ifstream in(path, std::ios::binary);
  FORGE_CHECK(in.good(), "cannot open {}", path);
  in.read(reinterpret_cast<char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(in.gcount() == static_cast<std::streamsize>(t.nbytes()), "{}: expected {} bytes", path, t.nbytes());
  return t;
}

void write(const std::string& path, const Tensor& t) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(t.data<float>()),
                                               static_cast<std::streamsize>(t.nbytes()));
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "files" && argc == 4) {
    const FluxVaeConfig config = read_flux_vae_config(argv[2]);
    nlohmann::json out;
    for (const auto& [name, layout] : {std::pair{"diffusers", FluxVaeWeightLayout::Diffusers},
                                       std::pair{"bfl", FluxVaeWeightLayout::Bfl}})
      for (const auto& [tensor, shape] : flux_vae_file_tensors(config, layout)) out[name].push_back({tensor, shape});
    std::ofstream(argv[3]) << out.dump(1);
    return 0;
  }
  if (mode != "run" || (argc != 4 && argc != 5)) {
    std::cerr << "usage: forge_flux_vae_reference files CONFIG OUT | run WEIGHTS DIR [CONFIG]\n";
    return 2;
  }
  const std::string weights = argv[2], dir = argv[3];
  const nlohmann::json run = nlohmann::json::parse(std::ifstream(dir + "/run.json"));
  const int64_t batch = run.at("batch"), height = run.at("height"), width = run.at("width");
  FluxVaeParameters params(argc == 5 ? read_flux_vae_config(argv[4]) : flux_vae_config_at(weights));
  load_flux_vae_weights(weights, params);
  const FluxVaeConfig& c = params.config();
  const int64_t f = c.downsample_factor(), latent = c.latent_channels;
  const Shape latent_shape{batch, latent, height / f, width / f};
  FluxVae vae(params);
  const Tensor image = read(dir + "/image.bin", {batch, c.in_channels, height, width});
  const Tensor noise = read(dir + "/noise.bin", latent_shape);
  const Tensor latents_in = read(dir + "/latents_in.bin", latent_shape);
  Tensor moments = Tensor::empty({batch, 2 * latent, height / f, width / f});
  Tensor latents = Tensor::empty(latent_shape), sampled = Tensor::empty(latent_shape);
  Tensor decoded = Tensor::empty({batch, c.out_channels, height, width});
  vae.encode_moments(moments, image);
  vae.encode(latents, image);
  vae.encode(sampled, image, &noise);
  vae.decode(decoded, latents_in);
  write(dir + "/moments.bin", moments);
  write(dir + "/latents.bin", latents);
  write(dir + "/sampled.bin", sampled);
  write(dir + "/decoded.bin", decoded);
  return 0;
} catch (const std::exception& e) {
  std::cerr << "forge_flux_vae_reference: " << e.what() << "\n";
  return 1;
}
