// NF4 on the GPU (ops/nf4.h): the CUDA dequantization against the CPU reference on fresh
// random weights, bit for bit (both round the same fp32 products to bf16), over shapes
// that exercise the vector path, partial blocks of 64 and 256, odd counts and a buffer
// offset that forces the scalar path; and the linear op on a stacked NF4 descriptor
// against the same GEMMs on the dequantized weight.
#include <cstring>

#include "gpu_testing.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/nf4.h"

namespace forge {
namespace {

using gpu_test::poisoned_gpu;
using gpu_test::random_bf16_values;
using gpu_test::seed_for_current_test;
using gpu_test::to_gpu;

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

TEST(GpuNf4, DequantizeMatchesCpuBitwise) {
  Rng rng(seed_for_current_test());
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {7, 9}, {5, 13}, {3, 100}, {64, 64}, {333, 777},
                                               {1024, 4096}, {4096, 1000}}) {
    const Nf4Tensor q = nf4_quantize(random_bf16_values(shape, rng, 0.02));
    Tensor expected = Tensor::empty(shape, DType::BF16);
    nf4_dequantize(expected, q);
    const Nf4Tensor on_gpu = q.to(Device::CUDA);
    Tensor out = poisoned_gpu(shape, DType::BF16);
    nf4_dequantize(out, on_gpu);
    EXPECT_TRUE(same_bits(out, expected)) << "weight " << shape_str(shape);

    // An output that starts 2 bytes into its buffer takes the scalar path.
    Tensor padded = poisoned_gpu({shape_numel(shape) + 1}, DType::BF16);
    Tensor shifted = padded.narrow(1, shape_numel(shape) + 1).view(shape);
    nf4_dequantize(shifted, on_gpu);
    EXPECT_TRUE(same_bits(shifted, expected)) << "unaligned output, weight " << shape_str(shape);
  }
}

TEST(GpuNf4, LinearOnAnNf4WeightEqualsLinearOnItsDequantizedWeight) {
  Rng rng(seed_for_current_test());
  for (const auto& [tokens, in, out] : std::vector<std::array<int64_t, 3>>{{33, 64, 16}, {1000, 200, 72},
                                                                          {2048, 1024, 768}}) {
    Nf4Weight stacked;  // as forge's fused gate_up: two Hugging Face tensors
    stacked.parts.push_back(nf4_quantize(random_bf16_values({out / 2, in}, rng, 0.02)));
    stacked.parts.push_back(nf4_quantize(random_bf16_values({out - out / 2, in}, rng, 0.02)));
    const Nf4Weight q = stacked.to(Device::CUDA);
    const Tensor x = to_gpu(random_bf16_values({tokens, in}, rng), DType::BF16);
    const Tensor dy = to_gpu(random_bf16_values({tokens, out}, rng), DType::BF16);
    Tensor plain = poisoned_gpu({out, in}, DType::BF16);
    nf4_dequantize(plain, q);
    const LinearWeight nf4_weight{.weight = poisoned_gpu({out, in}, DType::BF16), .nf4 = &q}, plain_weight{plain};
    Tensor y = poisoned_gpu({tokens, out}, DType::BF16), y_plain = poisoned_gpu({tokens, out}, DType::BF16);
    linear_forward(y, x, nf4_weight);
    linear_forward(y_plain, x, plain_weight);
    EXPECT_TRUE(same_bits(y, y_plain)) << "forward " << tokens << "x" << out << "x" << in;
    Tensor dx = poisoned_gpu({tokens, in}, DType::BF16), dx_plain = poisoned_gpu({tokens, in}, DType::BF16);
    linear_backward_input(dx, dy, nf4_weight);
    linear_backward_input(dx_plain, dy, plain_weight);
    EXPECT_TRUE(same_bits(dx, dx_plain)) << "input gradient";
  }
}

}  // namespace
}  // namespace forge
