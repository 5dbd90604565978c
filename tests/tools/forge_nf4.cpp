// Runs forge's NF4 quantizer and writes what it stores, for
// tests/python/test_nf4_vs_bitsandbytes.py to compare with bitsandbytes' quantize_4bit:
//   forge_nf4 WEIGHTS.raw f32|bf16 ROWS COLS OUT_DIR    raw little-endian weights
//   forge_nf4 --hf MODEL_DIR OUT_DIR                     a Hugging Face model's base (QLoRA)
// For raw weights OUT_DIR receives codes, absmax_codes (u8), absmax_scales, offset, absmax
// (the double-quantized absmax expanded), dequant_f32 (f32) and dequant_bf16 (bf16 bits),
// and the code tables nf4_code and dynamic_code (f32); for a model, the codes,
// absmax_codes, absmax_scales and offset of each quantized Hugging Face tensor, as
// OUT_DIR/<hf name>.<field>, and OUT_DIR/quantized listing those names. Exits 1 with the
// error on stderr.
#include <cstdio>
#include <fstream>
#include <string>

#include "core/bf16.h"
#include "core/tensor.h"
#include "kernels/cpu/nf4.h"
#include "ckpt/hf_import.h"
#include "model/nf4_base.h"
#include "ops/nf4.h"

namespace {

void write(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void write(const std::string& path, const forge::Tensor& t) { write(path, t.raw(), t.nbytes()); }

}  // namespace

void write_model_base(const std::string& model_dir, const std::string& dir) {
  const forge::HfModel model = forge::load_hf_model(model_dir);
  const forge::Nf4Base base = forge::quantize_base_nf4(*model.params);
  std::ofstream names(dir + "/quantized");
  for (size_t k = 0; k < model.params->specs().size(); ++k) {
    if (!base.quantized(k)) continue;
    const auto& hf_tensors = model.params->specs()[k].hf_tensors;
    for (size_t p = 0; p < hf_tensors.size(); ++p) {
      const forge::Nf4Tensor& q = base.weights[k].parts[p];
      const std::string prefix = dir + "/" + hf_tensors[p].name;
      write(prefix + ".codes", q.codes);
      write(prefix + ".absmax_codes", q.absmax_codes);
      write(prefix + ".absmax_scales", q.absmax_scales);
      write(prefix + ".offset", &q.absmax_offset, sizeof(float));
      names << hf_tensors[p].name << "\n";
    }
  }
}

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--hf") {
    try {
      write_model_base(argv[2], argv[3]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    return 0;
  }
  if (argc != 6) {
    std::fprintf(stderr, "usage: forge_nf4 WEIGHTS.raw f32|bf16 ROWS COLS OUT_DIR | --hf MODEL_DIR OUT_DIR\n");
    return 2;
  }
  try {
    const std::string dtype_arg = argv[2], dir = argv[5];
    const forge::DType dtype = dtype_arg == "bf16" ? forge::DType::BF16 : forge::DType::F32;
    const forge::Tensor weight = forge::Tensor::empty({std::stoll(argv[3]), std::stoll(argv[4])}, dtype);
    std::ifstream in(argv[1], std::ios::binary);
    in.read(static_cast<char*>(weight.raw()), static_cast<std::streamsize>(weight.nbytes()));
    if (!in) throw std::runtime_error(std::string("cannot read ") + std::to_string(weight.nbytes()) + " bytes from " + argv[1]);

    const forge::Nf4Tensor q = forge::nf4_quantize(weight);
    write(dir + "/codes", q.codes);
    write(dir + "/absmax_codes", q.absmax_codes);
    write(dir + "/absmax_scales", q.absmax_scales);
    write(dir + "/offset", &q.absmax_offset, sizeof(float));
    write(dir + "/absmax", forge::nf4_absmax(q));
    const forge::Tensor f32 = forge::Tensor::empty(weight.shape(), forge::DType::F32);
    const forge::Tensor bf16 = forge::Tensor::empty(weight.shape(), forge::DType::BF16);
    forge::nf4_dequantize(f32, q);
    forge::nf4_dequantize(bf16, q);
    write(dir + "/dequant_f32", f32);
    write(dir + "/dequant_bf16", bf16);
    write(dir + "/nf4_code", forge::cpu::kNf4Code, sizeof(forge::cpu::kNf4Code));
    write(dir + "/dynamic_code", forge::cpu::kDynamicCode, sizeof(forge::cpu::kDynamicCode));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
