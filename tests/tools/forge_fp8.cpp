// Runs forge's FP8 CPU reference for tests/python/test_fp8_vs_torch.py:
//   forge_fp8 cast VALUES.f32 OUT_DIR
//     OUT_DIR receives e4m3, e4m3_saturated, e5m2, e5m2_saturated (u8, one code per value)
//     and decoded_e4m3, decoded_e5m2 (f32: the 256 codes of each format decoded).
//   forge_fp8 quantize VALUES.f32 ROWS COLS BLOCK_ROWS BLOCK_COLS e4m3|e5m2 RULE OUT_DIR
//     RULE: torchao (amax_to_scale), torchao_pow2 (round_scales_to_power_of_2) or te_pow2
//     (Transformer Engine's block scaling: epsilon 0, power of 2, fp32 input).
//     OUT_DIR receives amax and scales (f32, one per block) and codes (u8 [ROWS, COLS]).
// Values are raw little-endian fp32. Exits 1 with the error on stderr, 2 on bad usage.
#include <cfloat>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"

namespace {

using forge::cpu::Fp8Format;

std::vector<float> read_values(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cannot open " + path);
  const auto bytes = static_cast<size_t>(in.tellg());
  if (bytes % 4) throw std::runtime_error(path + ": " + std::to_string(bytes) + " bytes is not a whole number of f32");
  std::vector<float> values(bytes / 4);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(bytes));
  if (!in) throw std::runtime_error("cannot read " + path);
  return values;
}

void write(const std::string& path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) throw std::runtime_error("cannot write " + path);
}

Fp8Format parse_format(const std::string& name) {
  if (name == "e4m3") return Fp8Format::E4M3;
  if (name == "e5m2") return Fp8Format::E5M2;
  throw std::runtime_error("format '" + name + "': expected e4m3 or e5m2");
}

void cast(const std::string& input, const std::string& dir) {
  const std::vector<float> x = read_values(input);
  std::vector<uint8_t> codes(x.size());
  for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const std::string name = forge::cpu::fp8_format_name(format);
    for (bool saturate : {false, true}) {
      forge::cpu::fp8_from_float(x.data(), static_cast<int64_t>(x.size()), format, saturate, codes.data());
      write(dir + "/" + name + (saturate ? "_saturated" : ""), codes.data(), codes.size());
    }
    std::vector<uint8_t> all(256);
    for (int i = 0; i < 256; ++i) all[i] = static_cast<uint8_t>(i);
    std::vector<float> decoded(256);
    forge::cpu::fp8_to_float(all.data(), 256, format, decoded.data());
    write(dir + "/decoded_" + name, decoded.data(), decoded.size() * 4);
  }
}

void quantize(char** argv, const std::string& dir) {
  const std::vector<float> x = read_values(argv[2]);
  const int64_t rows = std::stoll(argv[3]), cols = std::stoll(argv[4]);
  const forge::cpu::Fp8Blocks blocks{std::stoll(argv[5]), std::stoll(argv[6])};
  const Fp8Format format = parse_format(argv[7]);
  const std::string rule = argv[8];
  if (rows < 1 || cols < 1 || blocks.rows < 1 || blocks.cols < 1)
    throw std::runtime_error("ROWS, COLS, BLOCK_ROWS and BLOCK_COLS must be positive");
  if (rows * cols != static_cast<int64_t>(x.size()))
    throw std::runtime_error(std::string(argv[2]) + " holds " + std::to_string(x.size()) + " values, not " +
                             std::to_string(rows) + " x " + std::to_string(cols));
  std::vector<float> amax(static_cast<size_t>(forge::cpu::fp8_scale_count(rows, cols, blocks)));
  forge::cpu::fp8_block_amax(x.data(), rows, cols, blocks, amax.data());
  std::vector<float> scales(amax.size());
  for (size_t i = 0; i < amax.size(); ++i) {
    if (rule == "torchao" || rule == "torchao_pow2")
      scales[i] = forge::cpu::fp8_scale_torchao(amax[i], format, rule == "torchao_pow2");
    else if (rule == "te_pow2")
      scales[i] = forge::cpu::fp8_scale_transformer_engine(amax[i], format, true, 0.0f, FLT_MAX);
    else
      throw std::runtime_error("rule '" + rule + "': expected torchao, torchao_pow2 or te_pow2");
  }
  std::vector<uint8_t> codes(x.size());
  forge::cpu::fp8_quantize(x.data(), rows, cols, blocks, scales.data(), format, codes.data());
  write(dir + "/amax", amax.data(), amax.size() * 4);
  write(dir + "/scales", scales.data(), scales.size() * 4);
  write(dir + "/codes", codes.data(), codes.size());
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "cast" && argc == 4) || (mode == "quantize" && argc == 10))) {
    std::fprintf(stderr,
                 "usage: forge_fp8 cast VALUES.f32 OUT_DIR | "
                 "forge_fp8 quantize VALUES.f32 ROWS COLS BLOCK_ROWS BLOCK_COLS e4m3|e5m2 RULE OUT_DIR\n");
    return 2;
  }
  try {
    if (mode == "cast")
      cast(argv[2], argv[3]);
    else
      quantize(argv, argv[9]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
