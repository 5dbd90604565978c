#pragma once

#include <cstdint>

namespace forge::cpu {

// NF4 storage as bitsandbytes' quantize_4bit(quant_type="nf4", blocksize=64,
// compress_statistics=True) writes it (NOTE [NF4 storage] in ops/nf4.h).
inline constexpr int64_t kNf4BlockSize = 64;         // weights per absmax
inline constexpr int64_t kNf4AbsmaxBlockSize = 256;  // absmax values per second-level scale

// The 16 NF4 levels (bitsandbytes' get_4bit_type("nf4")) and the signed dynamic 8-bit map
// the absmax values are coded with (bitsandbytes' create_dynamic_map()), as fp32.
extern const float kNf4Code[16];
extern const float kDynamicCode[256];

// First level: w[n] into packed codes [(n + 1) / 2] (element 2i in the high nibble of
// byte i) and absmax [ceil(n / 64)].
void nf4_quantize_blocks(const float* w, int64_t n, uint8_t* packed, float* absmax);

// Second level: absmax[blocks] into offset (their mean, summed in PyTorch's CPU order),
// codes [blocks] and scales [ceil(blocks / 256)].
void nf4_compress_absmax(const float* absmax, int64_t blocks, uint8_t* codes, float* scales, float* offset);

// The absmax values back from the second level: kDynamicCode[code] * scale + offset.
void nf4_expand_absmax(const uint8_t* codes, const float* scales, float offset, int64_t blocks, float* absmax);

// w[n] = kNf4Code[nibble] * absmax[block], in fp32 or rounded to bf16 (its bits).
void nf4_dequantize(const uint8_t* packed, const float* absmax, int64_t n, float* out);
void nf4_dequantize_bf16(const uint8_t* packed, const float* absmax, int64_t n, uint16_t* out);

// PyTorch's CPU float sum of x[n] (at::native cascade_sum as one thread runs it).
float torch_order_sum(const float* x, int64_t n);

}  // namespace forge::cpu
