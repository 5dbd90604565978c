// Test tool: runs forge's CPU model on inputs written by tests/python/test_model_vs_torch.py.
//
//   forge_model_reference specs DIR     reads DIR/config.json, writes DIR/specs.json
//                                       (parameter names, shapes, Hugging Face names, their
//                                       rows and rotary rows: HfTensor in model/parameters.h)
//   forge_model_reference run DIR       reads DIR/config.json, DIR/weights.bin (fp32, all
//                                       parameters in specs order), DIR/tokens.bin and
//                                       DIR/targets.bin (int32 [batch, seq]); writes
//                                       DIR/logits.bin, DIR/grads.bin, DIR/loss.json; with
//                                       DIR/segments.bin (int32 [batch, seq]) the rows are
//                                       packed examples (NOTE [Packed examples]), positions
//                                       restarting with each run of equal ids
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/parameters.h"
#include "model/decoder_lm.h"

using nlohmann::json;
using namespace forge;

namespace {

ModelConfig read_config(const std::string& dir, int64_t* batch, int64_t* seq) {
  std::ifstream in(dir + "/config.json");
  json j = json::parse(in);
  ModelConfig c;
  c.name = "reference";
  c.vocab_size = j.at("vocab_size");
  c.hidden_size = j.at("hidden_size");
  c.num_layers = j.at("num_layers");
  c.num_heads = j.at("num_heads");
  c.num_kv_heads = j.at("num_kv_heads");
  c.head_dim = j.value("head_dim", 0);
  c.ffn_hidden_size = j.at("ffn_hidden_size");
  c.norm_eps = j.at("norm_eps");
  c.rope_theta = j.at("rope_theta");
  c.max_seq_len = j.at("max_seq_len");
  c.sliding_window = j.value("sliding_window", 0);
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.num_experts = j.value("num_experts", 0);
  c.num_experts_per_tok = j.value("num_experts_per_tok", 0);
  c.router_aux_loss_coef = j.value("router_aux_loss_coef", 0.0);
  // DeepSeek's experts, routing and Multi-head Latent Attention.
  c.moe_ffn_hidden_size = j.value("moe_ffn_hidden_size", 0);
  c.num_shared_experts = j.value("num_shared_experts", 0);
  c.first_dense_layers = j.value("first_dense_layers", 0);
  c.router_score_function = j.value("router_score_function", std::string("softmax"));
  c.router_normalize_topk = j.value("router_normalize_topk", true);
  c.router_scaling_factor = j.value("router_scaling_factor", 1.0);
  c.router_num_groups = j.value("router_num_groups", 1);
  c.router_topk_groups = j.value("router_topk_groups", 1);
  c.q_lora_rank = j.value("q_lora_rank", 0);
  c.kv_lora_rank = j.value("kv_lora_rank", 0);
  c.qk_nope_head_dim = j.value("qk_nope_head_dim", 0);
  c.qk_rope_head_dim = j.value("qk_rope_head_dim", 0);
  c.v_head_dim = j.value("v_head_dim", 0);
  if (j.contains("rope_scaling")) {
    const json& r = j["rope_scaling"];
    c.rope_scaling.enabled = true;
    c.rope_scaling.type = r.value("type", std::string("llama3"));
    c.rope_scaling.factor = r.at("factor");
    c.rope_scaling.original_max_position = r.at("original_max_position");
    if (c.rope_scaling.yarn()) {
      c.rope_scaling.beta_fast = r.value("beta_fast", 32.0);
      c.rope_scaling.beta_slow = r.value("beta_slow", 1.0);
      c.rope_scaling.mscale = r.value("mscale", 0.0);
      c.rope_scaling.mscale_all_dim = r.value("mscale_all_dim", 0.0);
    } else {
      c.rope_scaling.low_freq_factor = r.at("low_freq_factor");
      c.rope_scaling.high_freq_factor = r.at("high_freq_factor");
    }
  }
  c.validate();
  *batch = j.value("batch", 1);
  *seq = j.value("seq_len", 1);
  return c;
}

void read_into(const std::string& path, void* data, size_t bytes) {
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(data), static_cast<std::streamsize>(bytes));
  FORGE_CHECK(in && in.gcount() == static_cast<std::streamsize>(bytes), "short read of {}", path);
}

void write_from(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  FORGE_CHECK(static_cast<bool>(out), "short write of {}", path);
}

std::vector<std::string> hf_names(const ParamSpec& spec) {
  std::vector<std::string> names;
  for (const HfTensor& t : spec.hf_tensors) names.push_back(t.name);
  return names;
}

std::vector<int64_t> hf_rows(const ParamSpec& spec) {
  std::vector<int64_t> rows;
  for (const HfTensor& t : spec.hf_tensors) rows.push_back(t.rows);
  return rows;
}

// Each tensor's HfRotaryRows as [period, first, count] ([0, 0, 0]: none).
json hf_rotary_rows(const ParamSpec& spec) {
  json rows = json::array();
  for (const HfTensor& t : spec.hf_tensors)
    rows.push_back({t.rotary_rows.period, t.rotary_rows.first, t.rotary_rows.count});
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: forge_model_reference specs|run DIR\n";
    return 2;
  }
  std::string mode = argv[1], dir = argv[2];
  int64_t batch = 0, seq = 0;
  ModelConfig config = read_config(dir, &batch, &seq);
  if (mode == "specs") {
    json specs = json::array();
    for (const ParamSpec& s : parameter_specs(config))
      specs.push_back({{"name", s.name},
                       {"shape", s.shape},
                       {"hf_names", hf_names(s)},
                       {"hf_rows", hf_rows(s)},
                       {"hf_rotary_rows", hf_rotary_rows(s)}});
    std::ofstream(dir + "/specs.json") << specs.dump(1);
    return 0;
  }
  FlatParameters params(config), grads(config);
  read_into(dir + "/weights.bin", params.flat().raw(), params.flat().nbytes());
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
  read_into(dir + "/tokens.bin", tokens.raw(), tokens.nbytes());
  read_into(dir + "/targets.bin", targets.raw(), targets.nbytes());

  SequenceLayout layout{Tensor::empty({batch, seq}, DType::I32), Tensor::empty({batch, seq}, DType::I32)};
  const bool packed = std::filesystem::exists(dir + "/segments.bin");
  if (packed) {
    read_into(dir + "/segments.bin", layout.segments.raw(), layout.segments.nbytes());
    const int32_t* id = layout.segments.data<int32_t>();
    int32_t* position = layout.positions.data<int32_t>();
    for (int64_t i = 0; i < batch * seq; ++i) position[i] = i % seq == 0 || id[i] != id[i - 1] ? 0 : position[i - 1] + 1;
  }
  const SequenceLayout* rows = packed ? &layout : nullptr;

  DecoderLM model(config, batch, seq);
  Tensor logits = Tensor::empty({batch * seq, config.vocab_size});
  model.forward_logits(tokens, params, logits, rows);
  write_from(dir + "/logits.bin", logits.raw(), logits.nbytes());

  LossSum probe = model.forward_loss(tokens, targets, params, rows);
  grads.zero();
  LossSum loss =
      model.forward_backward(tokens, targets, params, grads, 1.0f / static_cast<float>(probe.tokens), rows);
  write_from(dir + "/grads.bin", grads.flat().raw(), grads.flat().nbytes());
  std::ofstream(dir + "/loss.json") << json{{"loss", loss.mean()}, {"tokens", loss.tokens}}.dump();
  return 0;
}
