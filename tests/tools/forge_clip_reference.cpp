// Test tool: runs forge's CLIP tokenizer and CPU text encoder on inputs written by
// tests/python/test_clip_text_vs_transformers.py.
//
//   forge_clip_reference encode MODEL DIR     loads the encoder at MODEL (a text_encoder folder,
//                                             a folder holding one, or a .safetensors file),
//                                             reads DIR/tokens.json ({"batch", "seq", "ids"});
//                                             writes DIR/last_hidden.bin [batch, seq, hidden]
//                                             and DIR/pooled.bin [batch, hidden] (fp32)
//   forge_clip_reference tokenize TOKENIZER DIR LENGTH
//                                             reads DIR/captions.json (a list of strings);
//                                             writes DIR/ids.json: {"encode": ids without
//                                             specials, "padded": LENGTH ids per caption,
//                                             "bos", "eos", "pad"}
// Errors go to stderr with exit status 1.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/clip_text_weights.h"
#include "data/clip_tokenizer.h"
#include "model/clip_text_encoder.h"

using nlohmann::json;
using namespace forge;

namespace {

void write(const std::string& path, const Tensor& t) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(t.data<float>()),
                                               static_cast<std::streamsize>(t.nbytes()));
}

int encode(const std::string& model_path, const std::string& dir) {
  const json j = json::parse(std::ifstream(dir + "/tokens.json"));
  const int64_t batch = j.at("batch"), seq = j.at("seq");
  const std::vector<int32_t> ids = j.at("ids").get<std::vector<int32_t>>();
  const ClipTextConfig config = read_clip_text_encoder_config(model_path);
  ClipTextParameters params(config);
  load_clip_text_weights(model_path, params);
  ClipTextEncoder encoder(config, batch, seq, Device::CPU);
  Tensor last_hidden = Tensor::empty({batch, seq, config.hidden_size});
  Tensor pooled = Tensor::empty({batch, config.hidden_size});
  encoder.forward(ids, params, last_hidden, pooled);
  write(dir + "/last_hidden.bin", last_hidden);
  write(dir + "/pooled.bin", pooled);
  return 0;
}

int tokenize(const std::string& tokenizer_path, const std::string& dir, int64_t length) {
  const std::vector<std::string> captions = json::parse(std::ifstream(dir + "/captions.json"));
  const ClipTokenizer tokenizer(tokenizer_path);
  json encoded = json::array();
  for (const std::string& caption : captions) encoded.push_back(tokenizer.encode(caption));
  const std::vector<int32_t> padded = tokenizer.encode_padded_batch(captions, length);
  json rows = json::array();
  for (size_t i = 0; i < captions.size(); ++i)
    rows.push_back(std::vector<int32_t>(padded.begin() + static_cast<std::ptrdiff_t>(i * length),
                                        padded.begin() + static_cast<std::ptrdiff_t>((i + 1) * length)));
  std::ofstream(dir + "/ids.json") << json{{"encode", encoded},
                                           {"padded", rows},
                                           {"bos", tokenizer.bos_id()},
                                           {"eos", tokenizer.eos_id()},
                                           {"pad", tokenizer.pad_id()}}
                                          .dump();
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "encode" && argc == 4) return encode(argv[2], argv[3]);
  if (mode == "tokenize" && argc == 5) return tokenize(argv[2], argv[3], std::stoll(argv[4]));
  std::cerr << "usage: forge_clip_reference encode MODEL DIR | tokenize TOKENIZER DIR LENGTH\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "forge_clip_reference: " << e.what() << "\n";
  return 1;
}
