// Test tool for tests/python/test_hf_import_export.py: imports a Hugging Face model
// directory with forge's importer, and either runs it or exports it again.
//
//   forge_hf_logits logits HF_DIR TOKENS BATCH SEQ OUT
//       TOKENS: int32 [BATCH, SEQ]; writes forge's fp32 logits [BATCH * SEQ, vocab] to OUT
//   forge_hf_logits export HF_DIR OUT_DIR f32|bf16|f16 [MAX_SHARD_BYTES]
//       writes the imported model back as a Hugging Face directory (with HF_DIR's
//       tokenizer files and special token ids)
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "core/error.h"
#include "model/decoder_lm.h"

using namespace forge;

namespace {

int usage() {
  std::cerr << "usage: forge_hf_logits logits HF_DIR TOKENS BATCH SEQ OUT\n"
               "       forge_hf_logits export HF_DIR OUT_DIR f32|bf16|f16 [MAX_SHARD_BYTES]\n";
  return 2;
}

int logits(const std::string& dir, const std::string& tokens_path, int64_t batch, int64_t seq, const std::string& out) {
  HfModel model = load_hf_model(dir);
  Tensor tokens = Tensor::empty({batch, seq}, DType::I32);
  std::ifstream in(tokens_path, std::ios::binary);
  in.read(static_cast<char*>(tokens.raw()), static_cast<std::streamsize>(tokens.nbytes()));
  FORGE_CHECK(in.gcount() == static_cast<std::streamsize>(tokens.nbytes()), "short read of {}", tokens_path);
  DecoderLM transformer(model.config, batch, seq);
  Tensor result = Tensor::empty({batch * seq, model.config.vocab_size});
  transformer.forward_logits(tokens, *model.params, result);
  std::ofstream(out, std::ios::binary).write(static_cast<const char*>(result.raw()),
                                             static_cast<std::streamsize>(result.nbytes()));
  return 0;
}

int export_model(const std::string& dir, const std::string& out, const std::string& dtype, uint64_t max_shard_bytes) {
  HfModel model = load_hf_model(dir);
  HfExportOptions options;
  FORGE_CHECK(dtype == "f32" || dtype == "bf16" || dtype == "f16", "dtype must be f32, bf16 or f16, got {}", dtype);
  options.dtype = dtype == "bf16" ? SafetensorsDType::BF16 : dtype == "f16" ? SafetensorsDType::F16 : SafetensorsDType::F32;
  options.source_dir = dir;
  if (max_shard_bytes > 0) options.max_shard_bytes = max_shard_bytes;
  save_hf_model(out, *model.params, options);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "logits" && argc == 7) return logits(argv[2], argv[3], std::stoll(argv[4]), std::stoll(argv[5]), argv[6]);
    if (mode == "export" && (argc == 5 || argc == 6))
      return export_model(argv[2], argv[3], argv[4], argc == 6 ? std::stoull(argv[5]) : 0);
    return usage();
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
