// Test tool: forge's T5 encoder (CPU reference) and T5 prompt tokenizer, driven
// by tests/python/test_t5_encoder_vs_transformers.py and
// test_t5_tokenizer_vs_transformers.py.
//
//   forge_t5_reference encode MODEL DIR     loads the T5 encoder folder MODEL
//   (config.json and
//                                           safetensors), reads DIR/tokens.json
//                                           ({"batch", "length", "ids": [B x L
//                                           ints]}) and writes the encoder's
//                                           output [B, L, d_model] to
//                                           DIR/out.bin (fp32)
//   forge_t5_reference buckets NUM MAX N    prints the buckets of relative
//   positions -N..N
//                                           as a JSON list
//   forge_t5_reference tokenize TOKENIZER IN OUT MAX_LENGTH
//                                           reads a JSON list of captions from
//                                           IN and writes
//                                           [{"ids": encode(c), "prompt":
//                                           prompt_ids(c)}, ...] to OUT
// Errors (a refused config, weight file or tokenizer) go to stderr with exit
// status 1.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/t5_weights.h"
#include "core/json_input.h"
#include "data/t5_prompt_tokenizer.h"
#include "model/t5_encoder.h"

using nlohmann::json;
using namespace forge;

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "encode" && argc == 4) {
    const T5Weights weights = load_t5_encoder(argv[2]);
    const std::string dir = argv[3];
    const json j = read_json_file(dir + "/tokens.json", "tokens");
    const int64_t batch = j.at("batch"), length = j.at("length");
    const std::vector<int32_t> ids = j.at("ids").get<std::vector<int32_t>>();
    FORGE_CHECK(static_cast<int64_t>(ids.size()) == batch * length, "tokens.json: {} ids for {} x {}", ids.size(),
                batch, length);
    Tensor tokens = Tensor::empty({batch, length}, DType::I32);
    std::copy(ids.begin(), ids.end(), tokens.data<int32_t>());
    Tensor out = Tensor::empty({batch, length, weights.config().d_model});
    T5Encoder encoder(weights);
    encoder.forward(tokens, out);
    std::ofstream(dir + "/out.bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(out.data<float>()), static_cast<std::streamsize>(out.nbytes()));
    return 0;
  }
  if (mode == "buckets" && argc == 5) {
    const int64_t buckets = std::stoll(argv[2]), max_distance = std::stoll(argv[3]), n = std::stoll(argv[4]);
    json out = json::array();
    for (int64_t r = -n; r <= n; ++r) out.push_back(t5_relative_position_bucket(r, buckets, max_distance));
    std::cout << out.dump() << "\n";
    return 0;
  }
  if (mode == "tokenize" && argc == 6) {
    const T5PromptTokenizer tokenizer(argv[2]);
    const json captions = read_json_file(argv[3], "captions");
    const int64_t max_length = std::stoll(argv[5]);
    json out = json::array();
    for (const json& c : captions) {
      const std::string text = c.get<std::string>();
      out.push_back({{"ids", tokenizer.encode(text)}, {"prompt", tokenizer.prompt_ids(text, max_length)}});
    }
    std::ofstream(argv[4]) << out.dump();
    return 0;
  }
  std::cerr << "usage: forge_t5_reference encode MODEL DIR | buckets NUM MAX N "
               "| tokenize TOKENIZER IN OUT "
               "MAX_LENGTH\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "forge_t5_reference: " << e.what() << "\n";
  return 1;
}
