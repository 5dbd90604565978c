// NF4 quantization and dequantization on the CPU: the reference, and the quantizer forge
// runs when it imports Hugging Face weights for QLoRA (NOTE [NF4 storage] in ops/nf4.h).
//
// The goal is bitwise agreement with bitsandbytes' CPU backend (0.50), so every rounding
// step copies what it does:
//  - First level (its Python "default" kernel): absmax = max |w| per block of 64; a full
//    block is scaled by w * (1 / max(absmax, 1e-38)) (a reciprocal, then a product), the
//    last, partial block by w / max(absmax, 1e-38) (a true division, and that clamped value
//    is the absmax it stores); the result is clamped to [-1, 1] and coded as the number of
//    midpoints (c[i] + c[i+1]) / 2 strictly below it (torch.bucketize, right=False: a value
//    on a midpoint takes the lower code). Element 2i goes to the high nibble of byte i; an
//    odd count pads the last low nibble with the code of 0.0 (7).
//  - Second level: offset = mean of the absmax values, summed in PyTorch's CPU cascade
//    order (torch_order_sum below; the mean is that sum divided by the count); then each
//    group of 256 of (absmax - offset) has its own fp32 absmax and is coded by its C kernel
//    (quantize_cpu_impl): x = v * (1 / absmax), looked up in a 65536-point table (see
//    dynamic_lut), so a value near a midpoint can take the farther code, as there; a group
//    whose values are all zero takes code 0.
//  - Dequantization: absmax = c[code] * scale, then + offset (two fp32 roundings, never a
//    fused multiply-add); w = nf4[nibble] * absmax in fp32, rounded to nearest even for
//    bf16.
// Each block is independent, so blocks run in parallel with identical results.
#include "kernels/cpu/nf4.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/parallel.h"

namespace forge::cpu {

const float kNf4Code[16] = {
    -0x1p+0f,        -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f, -0x1.23449ap-2f, -0x1.7a6a7ep-3f,
    -0x1.74f0e2p-4f, 0.0f,            0x1.45f5fep-4f,  0x1.4995c6p-3f, 0x1.f809bap-3f,  0x1.5a0674p-2f,
    0x1.c3497p-2f,   0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f,
};

const float kDynamicCode[256] = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f,
    -0x1.df999ap-1f, -0x1.d86666p-1f, -0x1.d13334p-1f, -0x1.cap-1f,
    -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f,
    -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f,
    -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f, -0x1.73999ap-1f,
    -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f,
    -0x1.4f999ap-1f, -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f,
    -0x1.32ccccp-1f, -0x1.2b999ap-1f, -0x1.246668p-1f, -0x1.1d3334p-1f,
    -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f, -0x1.006666p-1f,
    -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f,
    -0x1.b8ccccp-2f, -0x1.aa6666p-2f, -0x1.9cp-2f, -0x1.8d9998p-2f,
    -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f,
    -0x1.459998p-2f, -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6668p-2f,
    -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f, -0x1.c1999ap-3f,
    -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f,
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f,
    -0x1.93d70ap-4f, -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f,
    -0x1.65c29p-4f, -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f,
    -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f, -0x1.151ebap-4f,
    -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f,
    -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f,
    -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f,
    -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f, -0x1.a147aep-6f, -0x1.733334p-6f,
    -0x1.451ebap-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f, -0x1.75c29p-7f,
    -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f,
    -0x1.56041ap-8f, -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f,
    -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
    -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f, -0x1.3dd982p-11f,
    -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
    -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f,
    0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f,
    0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f,
    0x1.19ce0ap-12f, 0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f,
    0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f,
    0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f,
    0x1.0c49bap-8f, 0x1.3126e8p-8f, 0x1.56041ap-8f, 0x1.7ae148p-8f,
    0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f,
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f,
    0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451ebap-6f, 0x1.733334p-6f,
    0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f,
    0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f, 0x1.71eb86p-5f,
    0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f,
    0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f,
    0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f,
    0x1.4eb854p-4f, 0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f,
    0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f,
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f,
    0x1.6b3334p-3f, 0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f,
    0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f,
    0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f,
    0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f,
    0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f,
    0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f,
    0x1.079998p-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f,
    0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f,
    0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f,
    0x1.5ep-1f, 0x1.653334p-1f, 0x1.6c6668p-1f, 0x1.73999ap-1f,
    0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f,
    0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f,
    0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f,
    0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1p+0f,
};

namespace {

constexpr float kMinAbsmax = 1e-38f;  // bitsandbytes clamps the divisor to this

uint8_t nf4_code(float scaled) {
  static const std::array<float, 15> midpoints = [] {
    std::array<float, 15> m{};
    for (int i = 0; i < 15; ++i) m[i] = (kNf4Code[i] + kNf4Code[i + 1]) / 2.0f;
    return m;
  }();
  uint8_t code = 0;
  while (code < 15 && midpoints[code] < scaled) ++code;
  return code;
}

// bitsandbytes' 8-bit coder looks codes up in a table of 65536 evenly spaced points of
// [-1, 1], each holding the code of the nearest dynamic-map value (the number of
// midpoints strictly below the point), instead of searching the map itself.
constexpr int kLutSize = 65536;

const std::vector<uint8_t>& dynamic_lut() {
  static const std::vector<uint8_t> lut = [] {
    float midpoints[255];
    for (int k = 0; k < 255; ++k) midpoints[k] = 0.5f * (kDynamicCode[k] + kDynamicCode[k + 1]);
    std::vector<uint8_t> table(kLutSize);
    int code = 0;
    for (int i = 0; i < kLutSize; ++i) {
      const float point = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
      while (code < 255 && midpoints[code] < point) ++code;
      table[i] = static_cast<uint8_t>(code);
    }
    return table;
  }();
  return lut;
}

// The table index of x (already divided by its group's absmax): clamp to [-1, 1], then
// (x + 1) / 2 * 65535 + 0.5 truncated, with the last multiply-add fused, as the compiled
// library computes it.
uint8_t dynamic_code(const std::vector<uint8_t>& lut, float x) {
  const float half = (std::clamp(x, -1.0f, 1.0f) + 1.0f) * 0.5f;
  const auto index = static_cast<uint16_t>(static_cast<int32_t>(std::fmaf(half, 65535.0f, 0.5f)));
  return lut[index];
}

// at::native::multi_row_sum: `size` rows of 4 elements (each element a vector of `lanes`
// floats, laid out contiguously), summed in a 4-level cascade whose level width is
// 2^max(4, ceil(log2 size) / 4).
using Lanes = std::vector<float>;

void add_into(Lanes& acc, const float* x) {
  for (size_t k = 0; k < acc.size(); ++k) acc[k] += x[k];
}
void add_into(Lanes& acc, const Lanes& x) { add_into(acc, x.data()); }

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - std::countl_zero(static_cast<uint64_t>(x - 1)); }

std::array<Lanes, 4> multi_row_sum(const float* x, int lanes, int64_t size) {
  constexpr int levels = 4, rows = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  std::vector<std::array<Lanes, rows>> acc(levels);
  for (auto& level : acc)
    for (auto& lane : level) lane.assign(lanes, 0.0f);
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < rows; ++k) add_into(acc[0][k], x + (i * rows + k) * lanes);
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < rows; ++k) {
        add_into(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k].assign(lanes, 0.0f);
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < rows; ++k) add_into(acc[0][k], acc[j][k]);
  return acc[0];
}

// at::native::row_sum with ilp_factor 4 over `size` elements of `lanes` floats.
Lanes row_sum(const float* x, int lanes, int64_t size) {
  const int64_t size_ilp = size / 4;
  auto partial = multi_row_sum(x, lanes, size_ilp);
  for (int64_t i = size_ilp * 4; i < size; ++i) add_into(partial[0], x + i * lanes);
  for (int k = 1; k < 4; ++k) add_into(partial[0], partial[k]);
  return partial[0];
}

}  // namespace

float torch_order_sum(const float* x, int64_t n) {
  // Vectorized<float> holds 8 floats in every build PyTorch's sum kernel runs as (its
  // AVX2 and default kernels on x86, NEON on ARM).
  constexpr int lanes = 8;
  if (n < lanes) return row_sum(x, 1, n)[0];
  // vectorized_inner_sum: whole vectors first, then the scalar tail, then the lanes.
  const int64_t vectors = n / lanes;
  Lanes acc = row_sum(x, lanes, vectors);
  float total = 0.0f;
  for (int64_t k = vectors * lanes; k < n; ++k) total += x[k];
  for (float lane : acc) total += lane;
  return total;
}

void nf4_quantize_blocks(const float* w, int64_t n, uint8_t* packed, float* absmax) {
  const int64_t blocks = (n + kNf4BlockSize - 1) / kNf4BlockSize;
  // Blocks of 64 start on a byte, so each task writes whole bytes of its own.
  parallel_for(blocks, 256, [&](int64_t first, int64_t last) {
    uint8_t scaled_codes[kNf4BlockSize];
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kNf4BlockSize, count = std::min(kNf4BlockSize, n - begin);
      float block_max = 0.0f;
      for (int64_t i = 0; i < count; ++i) block_max = std::max(block_max, std::fabs(w[begin + i]));
      const bool full = count == kNf4BlockSize;
      const float divisor = std::max(block_max, kMinAbsmax);
      absmax[b] = full ? block_max : divisor;
      const float reciprocal = 1.0f / divisor;
      for (int64_t i = 0; i < count; ++i) {
        float scaled = full ? w[begin + i] * reciprocal : w[begin + i] / divisor;
        scaled_codes[i] = nf4_code(std::clamp(scaled, -1.0f, 1.0f));
      }
      if (count % 2) scaled_codes[count] = nf4_code(0.0f);
      for (int64_t i = 0; i < (count + 1) / 2; ++i)
        packed[begin / 2 + i] = static_cast<uint8_t>(scaled_codes[2 * i] << 4 | scaled_codes[2 * i + 1]);
    }
  });
}

void nf4_compress_absmax(const float* absmax, int64_t blocks, uint8_t* codes, float* scales, float* offset) {
  const float mean = torch_order_sum(absmax, blocks) / static_cast<float>(blocks);
  const std::vector<uint8_t>& lut = dynamic_lut();
  *offset = mean;
  const int64_t groups = (blocks + kNf4AbsmaxBlockSize - 1) / kNf4AbsmaxBlockSize;
  parallel_for(groups, 64, [&](int64_t first, int64_t last) {
    float centered[kNf4AbsmaxBlockSize];
    for (int64_t g = first; g < last; ++g) {
      const int64_t begin = g * kNf4AbsmaxBlockSize, count = std::min(kNf4AbsmaxBlockSize, blocks - begin);
      float group_max = 0.0f;
      for (int64_t i = 0; i < count; ++i) {
        centered[i] = absmax[begin + i] - mean;
        group_max = std::max(group_max, std::fabs(centered[i]));
      }
      scales[g] = group_max;
      const float reciprocal = 1.0f / group_max;
      for (int64_t i = 0; i < count; ++i) codes[begin + i] = group_max == 0.0f ? 0 : dynamic_code(lut, centered[i] * reciprocal);
    }
  });
}

void nf4_expand_absmax(const uint8_t* codes, const float* scales, float offset, int64_t blocks, float* absmax) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float scaled = kDynamicCode[codes[b]] * scales[b / kNf4AbsmaxBlockSize];
    absmax[b] = scaled + offset;
  }
}

namespace {

template <typename Store>
void dequantize_each(const uint8_t* packed, const float* absmax, int64_t n, Store store) {
  parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t byte = packed[i / 2];
      const int nibble = i % 2 ? byte & 0x0f : byte >> 4;
      store(i, kNf4Code[nibble] * absmax[i / kNf4BlockSize]);
    }
  });
}

}  // namespace

void nf4_dequantize(const uint8_t* packed, const float* absmax, int64_t n, float* out) {
  dequantize_each(packed, absmax, n, [out](int64_t i, float v) { out[i] = v; });
}

void nf4_dequantize_bf16(const uint8_t* packed, const float* absmax, int64_t n, uint16_t* out) {
  dequantize_each(packed, absmax, n, [out](int64_t i, float v) { out[i] = to_bf16(v).bits; });
}

}  // namespace forge::cpu
