// Test tool for tests/python/test_lora_vs_peft.py: runs forge's CPU model with LoRA
// adapters on a Hugging Face base model and a PEFT adapter, both written by the test.
//
//   forge_lora_reference DIR
//     reads  DIR/lora.json (rank, alpha, target_modules, batch, seq_len), DIR/base (a
//            Hugging Face model directory), DIR/peft_adapter (saved by PEFT),
//            DIR/tokens.bin and DIR/targets.bin (int32 [batch, seq_len])
//     writes DIR/logits.bin (fp32 [batch * seq_len, vocab]), DIR/loss.json,
//            DIR/forge_grads (the adapters' gradients of the mean token loss, as a PEFT
//            adapter), DIR/forge_adapter (the adapters as forge saves them) and
//            DIR/merged (the base with the adapters merged, as a Hugging Face model)
//     With "quantize_base": "nf4" in lora.json (tests/python/test_qlora_vs_peft.py) the base
//     is QLoRA's (NOTE [QLoRA base]): its projections quantized to NF4 as the trainer does
//     at import, and the merged model starts from their dequantized values.
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "ckpt/hf_layout.h"
#include "ckpt/peft_adapter.h"
#include "core/error.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/nf4_base.h"

using nlohmann::json;
using namespace forge;

namespace {

void read_into(const std::string& path, const Tensor& t) {
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(t.nbytes()));
  FORGE_CHECK(in && in.gcount() == static_cast<std::streamsize>(t.nbytes()), "short read of {}", path);
}

int run(const std::string& dir) {
  const json j = json::parse(std::ifstream(dir + "/lora.json"));
  LoraConfig lora;
  lora.rank = j.at("rank");
  lora.alpha = j.at("alpha");
  lora.target_modules = j.at("target_modules");
  const int64_t batch = j.at("batch"), seq = j.at("seq_len");
  HfModel base = load_hf_model(dir + "/base");
  const ModelConfig& config = base.config;

  std::unique_ptr<Nf4FrozenBase> nf4;
  if (j.value("quantize_base", "none") == "nf4") {
    // NOTE [NF4 stored row order]: DeepSeek's rotary rows quantized in the published order.
    const bool interleaved = read_weight_layout(dir + "/base").interleaved_rotary;
    nf4 = std::make_unique<Nf4FrozenBase>(*base.params, Device::CPU, DType::F32, [&](size_t spec) {
      return hf_stored_rows(base.params->specs()[spec], interleaved);
    });
  }
  LoraAdapters adapters(config, lora, Device::CPU, batch * seq);
  adapters.set_interleaved_rotary(read_weight_layout(dir + "/base").interleaved_rotary);  // DeepSeek's rotary rows
  if (nf4) adapters.set_base(*nf4);
  else adapters.set_base(*base.params);
  load_peft_adapter(dir + "/peft_adapter", adapters);

  Tensor tokens = Tensor::empty({batch, seq}, DType::I32), targets = Tensor::empty({batch, seq}, DType::I32);
  read_into(dir + "/tokens.bin", tokens);
  read_into(dir + "/targets.bin", targets);
  DecoderLM model(config, batch, seq);
  Tensor logits = Tensor::empty({batch * seq, config.vocab_size});
  model.forward_logits(tokens, adapters, logits);
  std::ofstream(dir + "/logits.bin", std::ios::binary)
      .write(static_cast<const char*>(logits.raw()), static_cast<std::streamsize>(logits.nbytes()));

  const LossSum probe = model.forward_loss(tokens, targets, adapters);
  adapters.discard();
  const LossSum loss =
      model.forward_backward(tokens, targets, adapters, adapters, 1.0f / static_cast<float>(probe.tokens));
  std::ofstream(dir + "/loss.json") << json{{"loss", loss.mean()}, {"tokens", loss.tokens}}.dump();

  LoraAdapters grads(config, lora, Device::CPU, 1);
  grads.master_flat().copy_from(adapters.gradient_flat());
  save_peft_adapter(dir + "/forge_grads", grads, "");
  save_peft_adapter(dir + "/forge_adapter", adapters, dir + "/base");

  if (nf4) nf4->dequantize_into(*base.params);
  adapters.merge_into(*base.params);
  HfExportOptions options;
  options.source_dir = dir + "/base";
  save_hf_model(dir + "/merged", *base.params, options);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: forge_lora_reference DIR\n";
    return 2;
  }
  try {
    return run(argv[1]);
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
