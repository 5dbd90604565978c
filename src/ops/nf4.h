// NF4 storage for frozen base weights (QLoRA): quantize a weight once, at import, and
// dequantize it into a compute-dtype buffer before each GEMM that reads it.
//
// NOTE [NF4 storage]
// An Nf4Tensor holds exactly what bitsandbytes' quantize_4bit(w, quant_type="nf4",
// blocksize=64, compress_statistics=True) stores, bit for bit (its CPU backend, 0.50):
//  - codes: u8 [(numel + 1) / 2], two 4-bit indices into the NF4 table a byte, element 2i
//    in the high nibble, element 2i + 1 in the low one (an odd count pads with the code of
//    0.0); the weight is flattened row-major, so blocks run along the rows and a block may
//    span two rows when in_features is not a multiple of 64;
//  - the absmax of each block of 64 (the last block may be shorter), double-quantized:
//    absmax_offset = their mean (fp32), absmax_codes u8 [ceil(numel / 64)] = (absmax -
//    offset) coded with the signed dynamic 8-bit map in groups of 256, absmax_scales fp32
//    [ceil(blocks / 256)] = each group's own absmax.
// The code tables are constants (kernels/cpu/nf4.h). Dequantized, a weight is
// nf4[code] * (dynamic[absmax_code] * scale + offset), each step an fp32 rounding, then
// rounded to bf16 on the GPU (bitsandbytes' dequantize_4bit to bf16) or kept in fp32 on
// the CPU reference (to fp32). That is 0.5 byte per weight plus 1/64 byte of absmax codes
// and 4/16384 byte of scales: 0.5157 byte per weight in all.
// The offset is the result of a float sum, which forge adds up in the order PyTorch's CPU
// sum uses on one thread. Beyond 32768 blocks (2M weights) a multi-threaded PyTorch splits
// the sum among its threads, which can move the offset by an ulp and with it, rarely, an
// absmax code: bitsandbytes' own result then depends on its thread count.
// Quantization runs on the CPU (at import); dequantization on either device.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace forge {

struct Nf4Tensor {
  Shape shape;           // the weight's shape, as given to nf4_quantize
  Tensor codes;          // u8 [(numel + 1) / 2]
  Tensor absmax_codes;   // u8 [ceil(numel / 64)]
  Tensor absmax_scales;  // f32 [ceil(numel / 64 / 256)]
  float absmax_offset = 0.0f;

  int64_t numel() const { return shape_numel(shape); }
  Device device() const { return codes.device(); }
  size_t nbytes() const { return codes.nbytes() + absmax_codes.nbytes() + absmax_scales.nbytes() + sizeof(float); }
  Nf4Tensor to(Device device) const;
};

// A weight made of tensors stacked along dim 0 (forge's fused qkv and gate_up, NOTE [Fused
// projections] in model/parameters.h), each quantized on its own as bitsandbytes quantizes
// each Hugging Face Linear4bit; a plain projection has one part.
//
// NOTE [NF4 stored row order]
// A weight whose rows forge keeps in another order than the Hugging Face tensor it was
// imported from (DeepSeek's rotary rows, HfRotaryRows in model/parameters.h) is quantized in
// the tensor's order, so that its codes are bitsandbytes' of that tensor (a block of 64 and
// a group of 256 blocks hold the same values): row_order then says, for each of the weight's
// rows, which stored row it is, and dequantization writes the stored rows into `staging`
// and gathers them into place (the embedding's row gather). Without `staging` (a CPU export)
// a buffer is made for the call.
struct Nf4Weight {
  std::vector<Nf4Tensor> parts;  // each [rows_i, in_features]
  Tensor row_order;              // I32 [rows] on the codes' device: the stored row of each row; undefined: the same
  Tensor staging;                // [rows, in_features]: the stored rows dequantized (owned by whoever set it)

  Shape shape() const;  // [sum of rows_i, in_features]
  size_t nbytes() const;
  Nf4Weight to(Device device) const;
};

// The bytes an Nf4Tensor of `numel` weights holds (Nf4Tensor::nbytes without building one).
size_t nf4_bytes(int64_t numel);

// Quantizes a CPU tensor (f32 or bf16, finite, at least one element).
Nf4Tensor nf4_quantize(const Tensor& weight);

// The absmax of every block of 64, from the double-quantized statistics (CPU, f32 [blocks]).
Tensor nf4_absmax(const Nf4Tensor& q);

// Dequantizes into `out` (the weight's shape): on the CPU in f32 or bf16, on CUDA in bf16.
void nf4_dequantize(const Tensor& out, const Nf4Tensor& q);
// Each part into its rows of `out` (through `staging` in row_order's order, when it has one).
void nf4_dequantize(const Tensor& out, const Nf4Weight& w);

}  // namespace forge
