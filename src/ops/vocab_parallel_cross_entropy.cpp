#include "ops/vocab_parallel_cross_entropy.h"

#include "kernels/cpu/vocab_parallel_cross_entropy.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/vocab_parallel_cross_entropy.h"
#endif

namespace forge {
namespace {

// logits [N, Vs] with Vs > 0, on the CPU in fp32 or on the GPU in bf16.
void check_logits(const Tensor& logits, const char* op) {
  FORGE_CHECK(logits.ndim() == 2, "{}: logits {} must be [N, Vs]", op, shape_str(logits.shape()));
  FORGE_CHECK(logits.dim(1) > 0, "{}: logits {} have no classes", op, shape_str(logits.shape()));
  expect_tensor(logits, logits.device(), logits.device() == Device::CUDA ? DType::BF16 : DType::F32,
                "vocab_parallel_cross_entropy logits");
}

// An fp32 statistic of `shape` on the logits' device.
void check_statistic(const Tensor& t, const Shape& shape, const Tensor& logits, const char* what) {
  check_shape(t, shape, what);
  expect_tensor(t, logits.device(), DType::F32, what);
}

// Targets [N] int32 on the logits' device. On the CPU each is ignore_index or >= 0; the
// upper bound is the full vocabulary, which these ops do not know.
void check_targets(const Tensor& targets, const Tensor& logits, int32_t ignore_index, const char* op) {
  check_shape(targets, {logits.dim(0)}, "vocab_parallel_cross_entropy targets");
  expect_tensor(targets, logits.device(), DType::I32, "vocab_parallel_cross_entropy targets");
  if (targets.device() == Device::CUDA) return;  // validated when the batch was made (data layer)
  const int32_t* t = targets.data<int32_t>();
  for (int64_t n = 0; n < targets.numel(); ++n) {
    if (t[n] != ignore_index && t[n] < 0) {
      FORGE_FAIL("{}: target {} in row {} is negative and is not the ignore index {}", op, t[n], n, ignore_index);
    }
  }
}

void check_vocab_begin(int64_t vocab_begin, const char* op) {
  FORGE_CHECK(vocab_begin >= 0, "{}: the shard's first column {} is negative", op, vocab_begin);
}

}  // namespace

void vocab_parallel_cross_entropy_max(const Tensor& row_max, const Tensor& logits) {
  OpProfileScope profile(OpClass::Elementwise, "vocab_parallel_cross_entropy_max");
  check_logits(logits, "vocab_parallel_cross_entropy_max");
  int64_t rows = logits.dim(0), vocab = logits.dim(1);
  check_statistic(row_max, {rows}, logits, "vocab_parallel_cross_entropy row_max");
  if (logits.device() == Device::CUDA) {
    FORGE_CUDA_CALL("vocab_parallel_cross_entropy_max",
                    cuda::vocab_parallel_cross_entropy_max(row_max.data<float>(), bf16_ptr(logits), rows, vocab));
    return;
  }
  cpu::vocab_parallel_cross_entropy_max(row_max.data<float>(), logits.data<float>(), rows, vocab);
}

void vocab_parallel_cross_entropy_sums(const Tensor& sums, const Tensor& logits, const Tensor& row_max,
                                       const Tensor& targets, int64_t vocab_begin, int32_t ignore_index) {
  OpProfileScope profile(OpClass::Elementwise, "vocab_parallel_cross_entropy_sums");
  const char* op = "vocab_parallel_cross_entropy_sums";
  check_logits(logits, op);
  int64_t rows = logits.dim(0), vocab = logits.dim(1);
  check_vocab_begin(vocab_begin, op);
  check_statistic(sums, {2, rows}, logits, "vocab_parallel_cross_entropy sums");
  check_statistic(row_max, {rows}, logits, "vocab_parallel_cross_entropy row_max");
  check_targets(targets, logits, ignore_index, op);
  if (logits.device() == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::vocab_parallel_cross_entropy_sums(sums.data<float>(), bf16_ptr(logits),
                                                                row_max.data<float>(), targets.data<int32_t>(), rows,
                                                                vocab, vocab_begin, ignore_index));
    return;
  }
  cpu::vocab_parallel_cross_entropy_sums(sums.data<float>(), logits.data<float>(), row_max.data<float>(),
                                         targets.data<int32_t>(), rows, vocab, vocab_begin, ignore_index);
}

void vocab_parallel_cross_entropy_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                         const Tensor& row_max, const Tensor& sums, const Tensor& targets,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale) {
  OpProfileScope profile(OpClass::Elementwise, "vocab_parallel_cross_entropy_finish");
  const char* op = "vocab_parallel_cross_entropy_finish";
  check_logits(logits, op);
  int64_t rows = logits.dim(0), vocab = logits.dim(1);
  check_vocab_begin(vocab_begin, op);
  check_statistic(losses, {rows}, logits, "vocab_parallel_cross_entropy losses");
  check_statistic(row_max, {rows}, logits, "vocab_parallel_cross_entropy row_max");
  check_statistic(sums, {2, rows}, logits, "vocab_parallel_cross_entropy sums");
  check_targets(targets, logits, ignore_index, op);
  if (dlogits.defined()) {
    check_shape(dlogits, logits.shape(), "vocab_parallel_cross_entropy dlogits");
    expect_tensor(dlogits, logits.device(), logits.dtype(), "vocab_parallel_cross_entropy dlogits");
  }
  if (logits.device() == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::vocab_parallel_cross_entropy_finish(
                            losses.data<float>(), dlogits.defined() ? bf16_ptr(dlogits) : nullptr, bf16_ptr(logits),
                            row_max.data<float>(), sums.data<float>(), targets.data<int32_t>(), rows, vocab,
                            vocab_begin, ignore_index, grad_scale));
    return;
  }
  cpu::vocab_parallel_cross_entropy_finish(losses.data<float>(), dlogits.defined() ? dlogits.data<float>() : nullptr,
                                           logits.data<float>(), row_max.data<float>(), sums.data<float>(),
                                           targets.data<int32_t>(), rows, vocab, vocab_begin, ignore_index,
                                           grad_scale);
}

}  // namespace forge
