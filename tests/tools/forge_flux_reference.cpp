// Test tool: runs forge's CPU FLUX transformer on inputs written by
// tests/python/test_flux_vs_diffusers.py.
//
//   forge_flux_reference specs DIR   reads DIR/config.json, writes DIR/specs.json (parameter
//                                    names, shapes and the diffusers tensors each stacks)
//   forge_flux_reference run DIR     reads DIR/config.json, DIR/weights.bin (fp32, every
//                                    parameter in specs order), DIR/image.bin, text.bin,
//                                    pooled.bin and dout.bin (fp32); writes DIR/out.bin (the
//                                    predicted velocity) and DIR/grads.bin (the gradient of
//                                    sum(out * dout) for every parameter, specs order)
//   forge_flux_reference load DIR PATH       reads the FLUX weights at PATH (a diffusers folder or
//                                            BFL's file) into DIR/loaded.bin (specs order)
//   forge_flux_reference export DIR PATH diffusers|bfl [MAX_SHARD_BYTES]
//                                            writes DIR/weights.bin's parameters to PATH in that
//                                            layout (fp32)
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/flux_weights.h"
#include "model/flux_parameters.h"
#include "model/flux_transformer.h"

using nlohmann::json;
using namespace forge;

namespace {

FluxConfig read_config(const json& j) {
  FluxConfig c;
  c.name = "reference";
  c.in_channels = j.at("in_channels");
  c.out_channels = j.value("out_channels", 0);
  c.num_heads = j.at("num_heads");
  c.head_dim = j.at("head_dim");
  c.num_double_blocks = j.at("num_double_blocks");
  c.num_single_blocks = j.at("num_single_blocks");
  c.context_dim = j.at("context_dim");
  c.pooled_dim = j.at("pooled_dim");
  c.guidance_embeds = j.at("guidance_embeds");
  c.axes_dim = j.at("axes_dim").get<std::vector<int64_t>>();
  c.validate("config.json");
  return c;
}

void read_into(const std::string& path, const Tensor& t) {
  std::ifstream in(path, std::ios::binary);
  FORGE_CHECK(in.good(), "cannot open {}", path);
  in.read(reinterpret_cast<char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(in.gcount() == static_cast<std::streamsize>(t.nbytes()), "{}: expected {} bytes", path, t.nbytes());
}

Tensor read(const std::string& path, Shape shape) {
  Tensor t = Tensor::empty(std::move(shape));
  read_into(path, t);
  return t;
}

void write(const std::string& path, const Tensor& t) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(t.data<float>()),
                                               static_cast<std::streamsize>(t.nbytes()));
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::cerr << "usage: forge_flux_reference specs|run DIR | load DIR PATH | export DIR PATH diffusers|bfl [MAX_SHARD_BYTES]\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const json j = json::parse(std::ifstream(dir + "/config.json"));
  const FluxConfig config = read_config(j);
  if (mode == "specs") {
    json specs = json::array();
    for (const ParamSpec& s : flux_parameter_specs(config)) {
      json hf = json::array();
      for (const HfTensor& t : s.hf_tensors) hf.push_back({t.name, t.rows});
      specs.push_back({{"name", s.name}, {"shape", s.shape}, {"hf", hf}});
    }
    std::ofstream(dir + "/specs.json") << specs.dump(1);
    return 0;
  }
  if (mode == "load" && argc == 4) {
    FluxParameters params(config);
    load_flux_weights(argv[3], params);
    std::ofstream out(dir + "/loaded.bin", std::ios::binary);
    for (const Tensor& t : params.tensors())
      out.write(reinterpret_cast<const char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
    return 0;
  }
  if (mode == "export" && (argc == 5 || argc == 6)) {
    FluxParameters params(config);
    std::ifstream in(dir + "/weights.bin", std::ios::binary);
    for (const Tensor& t : params.tensors())
      in.read(reinterpret_cast<char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
    FORGE_CHECK(in.good(), "{}/weights.bin is shorter than the parameters", dir);
    const std::string layout = argv[4];
    FORGE_CHECK(layout == "diffusers" || layout == "bfl", "layout '{}': expected diffusers or bfl", layout);
    save_flux_weights(argv[3], params, layout == "bfl" ? FluxWeightLayout::Bfl : FluxWeightLayout::Diffusers,
                      SafetensorsDType::F32, argc == 6 ? std::stoull(argv[5]) : kDiffusersMaxShardBytes);
    return 0;
  }
  FORGE_CHECK(mode == "run" && argc == 3, "unknown mode '{}' or wrong argument count", mode);
  FluxShape shape;
  shape.batch = j.at("batch");
  shape.text_tokens = j.at("text_tokens");
  shape.grid_h = j.at("grid_h");
  shape.grid_w = j.at("grid_w");
  const ActivationCheckpoint checkpoint = activation_checkpoint_from_name(j.value("checkpoint", "none"));
  FluxParameters params(config);
  FluxParameters grads(config);
  {  // weights.bin holds the parameters back to back, without the flat buffer's padding.
    std::ifstream in(dir + "/weights.bin", std::ios::binary);
    for (const Tensor& t : params.tensors())
      in.read(reinterpret_cast<char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
    FORGE_CHECK(in.good(), "{}/weights.bin is shorter than the parameters", dir);
  }
  FluxInputs inputs;
  inputs.image = read(dir + "/image.bin", {shape.batch, shape.image_tokens(), config.in_channels});
  inputs.text = read(dir + "/text.bin", {shape.batch, shape.text_tokens, config.context_dim});
  inputs.pooled = read(dir + "/pooled.bin", {shape.batch, config.pooled_dim});
  inputs.timesteps = j.at("timesteps").get<std::vector<float>>();
  if (config.guidance_embeds) inputs.guidance = j.at("guidance").get<std::vector<float>>();
  const Tensor dout = read(dir + "/dout.bin", {shape.batch, shape.image_tokens(), config.resolved_out_channels()});
  Tensor out = Tensor::empty(dout.shape());
  FluxTransformer model(config, shape, Device::CPU, checkpoint);
  model.forward(inputs, params, out);
  grads.zero();
  model.backward(dout, params, grads);
  write(dir + "/out.bin", out);
  std::ofstream g(dir + "/grads.bin", std::ios::binary);
  for (const Tensor& t : grads.tensors())
    g.write(reinterpret_cast<const char*>(t.data<float>()), static_cast<std::streamsize>(t.nbytes()));
  return 0;
} catch (const std::exception& e) {
  std::cerr << "forge_flux_reference: " << e.what() << "\n";
  return 1;
}
