#include "ops/nf4.h"

#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/op_profile.h"
#include "kernels/cpu/nf4.h"
#include "ops/embedding.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/nf4.h"
#endif

namespace forge {
namespace {

int64_t blocks_of(int64_t numel) { return (numel + cpu::kNf4BlockSize - 1) / cpu::kNf4BlockSize; }
int64_t groups_of(int64_t blocks) { return (blocks + cpu::kNf4AbsmaxBlockSize - 1) / cpu::kNf4AbsmaxBlockSize; }

void check_layout(const Nf4Tensor& q) {
  const int64_t n = q.numel(), blocks = blocks_of(n);
  FORGE_CHECK(n > 0, "nf4: the weight {} has no elements", shape_str(q.shape));
  check_shape(q.codes, {(n + 1) / 2}, "nf4 codes");
  check_shape(q.absmax_codes, {blocks}, "nf4 absmax_codes");
  check_shape(q.absmax_scales, {groups_of(blocks)}, "nf4 absmax_scales");
  check_dtype(q.codes, DType::U8, "nf4 codes");
  check_dtype(q.absmax_codes, DType::U8, "nf4 absmax_codes");
  check_dtype(q.absmax_scales, DType::F32, "nf4 absmax_scales");
  FORGE_CHECK(q.absmax_codes.device() == q.device() && q.absmax_scales.device() == q.device(),
              "nf4: codes and statistics must be on one device");
}

}  // namespace

Nf4Tensor Nf4Tensor::to(Device device) const {
  return Nf4Tensor{shape, codes.to(device), absmax_codes.to(device), absmax_scales.to(device), absmax_offset};
}

Shape Nf4Weight::shape() const {
  FORGE_CHECK(!parts.empty(), "nf4: a weight without parts");
  Shape shape = parts.front().shape;
  FORGE_CHECK(shape.size() == 2, "nf4: a stacked weight's parts must be matrices, got {}", shape_str(shape));
  for (size_t i = 1; i < parts.size(); ++i) {
    FORGE_CHECK(parts[i].shape.size() == 2 && parts[i].shape[1] == shape[1],
                "nf4: part {} is {}, expected [rows, {}] like part 0", i, shape_str(parts[i].shape), shape[1]);
    shape[0] += parts[i].shape[0];
  }
  return shape;
}

size_t Nf4Weight::nbytes() const {
  size_t total = 0;
  for (const Nf4Tensor& part : parts) total += part.nbytes();
  return total + (row_order.defined() ? row_order.nbytes() : 0);
}

Nf4Weight Nf4Weight::to(Device device) const {
  Nf4Weight moved;
  for (const Nf4Tensor& part : parts) moved.parts.push_back(part.to(device));
  if (row_order.defined()) moved.row_order = row_order.to(device);  // staging: the new owner's to set
  return moved;
}

size_t nf4_bytes(int64_t numel) {
  const int64_t blocks = blocks_of(numel);
  return static_cast<size_t>((numel + 1) / 2 + blocks + 4 * groups_of(blocks) + 4);
}

Nf4Tensor nf4_quantize(const Tensor& weight) {
  FORGE_CHECK(weight.device() == Device::CPU, "nf4_quantize: the weight must be on the CPU (quantization runs at import)");
  FORGE_CHECK(weight.dtype() == DType::F32 || weight.dtype() == DType::BF16,
              "nf4_quantize: the weight is {}, expected f32 or bf16", dtype_name(weight.dtype()));
  const int64_t n = weight.numel();
  FORGE_CHECK(n > 0, "nf4_quantize: the weight {} has no elements", shape_str(weight.shape()));
  std::vector<float> converted;
  const float* w = nullptr;
  if (weight.dtype() == DType::BF16) {
    converted.resize(n);
    const BFloat16* src = weight.data<BFloat16>();
    for (int64_t i = 0; i < n; ++i) converted[i] = to_float(src[i]);
    w = converted.data();
  } else {
    w = weight.data<float>();
  }
  for (int64_t i = 0; i < n; ++i)
    FORGE_CHECK(std::isfinite(w[i]), "nf4_quantize: element {} of the weight {} is {}, expected a finite value", i,
                shape_str(weight.shape()), w[i]);

  const int64_t blocks = blocks_of(n);
  Nf4Tensor q{weight.shape(), Tensor::empty({(n + 1) / 2}, DType::U8), Tensor::empty({blocks}, DType::U8),
              Tensor::empty({groups_of(blocks)}, DType::F32), 0.0f};
  std::vector<float> absmax(blocks);
  cpu::nf4_quantize_blocks(w, n, q.codes.data<uint8_t>(), absmax.data());
  cpu::nf4_compress_absmax(absmax.data(), blocks, q.absmax_codes.data<uint8_t>(),
                           q.absmax_scales.data<float>(), &q.absmax_offset);
  return q;
}

Tensor nf4_absmax(const Nf4Tensor& q) {
  check_layout(q);
  FORGE_CHECK(q.device() == Device::CPU, "nf4_absmax: the statistics must be on the CPU");
  Tensor absmax = Tensor::empty({q.absmax_codes.numel()});
  cpu::nf4_expand_absmax(q.absmax_codes.data<uint8_t>(), q.absmax_scales.data<float>(), q.absmax_offset,
                         q.absmax_codes.numel(), absmax.data<float>());
  return absmax;
}

void nf4_dequantize(const Tensor& out, const Nf4Tensor& q) {
  OpProfileScope profile(OpClass::Elementwise, "nf4_dequantize");
  check_layout(q);
  check_shape(out, q.shape, "nf4_dequantize out");
  const int64_t n = q.numel();
  if (q.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "nf4_dequantize out");
    FORGE_CUDA_CALL("nf4_dequantize",
                    cuda::nf4_dequantize(static_cast<cuda::bf16*>(out.raw()), q.codes.data<uint8_t>(),
                                         q.absmax_codes.data<uint8_t>(), q.absmax_scales.data<float>(),
                                         q.absmax_offset, n));
    return;
  }
  FORGE_CHECK(out.device() == Device::CPU, "nf4_dequantize: out is on {}, the codes on the CPU",
              device_name(out.device()));
  Tensor absmax = nf4_absmax(q);
  if (out.dtype() == DType::BF16) {
    cpu::nf4_dequantize_bf16(q.codes.data<uint8_t>(), absmax.data<float>(), n,
                             reinterpret_cast<uint16_t*>(out.data<BFloat16>()));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "nf4_dequantize out");
  cpu::nf4_dequantize(q.codes.data<uint8_t>(), absmax.data<float>(), n, out.data<float>());
}

void nf4_dequantize(const Tensor& out, const Nf4Weight& w) {
  check_shape(out, w.shape(), "nf4_dequantize out");
  // NOTE [NF4 stored row order]: the stored rows first, then each gathered to its place.
  const Tensor stored = !w.row_order.defined() ? out
                        : w.staging.defined()  ? w.staging
                                               : Tensor::empty(out.shape(), out.dtype(), out.device());
  if (w.row_order.defined()) {
    check_shape(stored, w.shape(), "nf4_dequantize staging");
    FORGE_CHECK(stored.dtype() == out.dtype() && stored.device() == out.device(),
                "nf4_dequantize: the staging buffer must be {} on {} like out", dtype_name(out.dtype()),
                device_name(out.device()));
  }
  int64_t row = 0;
  for (const Nf4Tensor& part : w.parts) {
    const int64_t rows = part.shape[0];
    nf4_dequantize(stored.narrow(row, row + rows), part);
    row += rows;
  }
  if (w.row_order.defined()) embedding_forward(out, w.row_order, stored);
}

}  // namespace forge
