#include "ops/embedding.h"

#include <string>

#include "kernels/cpu/embedding.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/embedding.h"
#endif

namespace forge {
namespace {

void check_token_ids(const Tensor& tokens, int64_t vocab, const char* op) {
  const int32_t* ids = tokens.data<int32_t>();
  for (int64_t n = 0; n < tokens.numel(); ++n) {
    if (ids[n] < 0 || ids[n] >= vocab) {
      FORGE_FAIL("{}: token id {} at position {} is outside the vocabulary [0, {})", op, ids[n], n, vocab);
    }
  }
}

// A table of `rows` rows starting at vocab_begin must lie inside the vocabulary.
void check_shard(int64_t vocab_begin, int64_t rows, int64_t vocab_size, const char* op) {
  FORGE_CHECK(vocab_begin >= 0 && vocab_begin <= vocab_size - rows,
              "{}: the table's rows [{}, {}) are not inside the vocabulary [0, {})", op, vocab_begin,
              vocab_begin + rows, vocab_size);
}

// The lookup in a table of the rows [vocab_begin, vocab_begin + Vs) (NOTE [Vocabulary-parallel embedding]).
void shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                   int64_t vocab_size, const char* op) {
  const std::string name = op;
  FORGE_CHECK(table.ndim() == 2, "{}: table {} must be [V, H]", op, shape_str(table.shape()));
  FORGE_CHECK(tokens.ndim() == 1, "{}: tokens {} must be [N]", op, shape_str(tokens.shape()));
  int64_t count = tokens.dim(0), rows = table.dim(0), hidden = table.dim(1);
  check_shape(out, {count, hidden}, (name + " out").c_str());
  check_shard(vocab_begin, rows, vocab_size, op);
  if (table.device() == Device::CUDA) {
    // Token ids on the GPU were validated when the batch was made (data layer).
    expect_tensor(out, Device::CUDA, DType::BF16, (name + " out").c_str());
    expect_tensor(tokens, Device::CUDA, DType::I32, (name + " tokens").c_str());
    expect_tensor(table, Device::CUDA, DType::BF16, (name + " table").c_str());
    FORGE_CUDA_CALL(op, cuda::embedding_forward(static_cast<cuda::bf16*>(out.raw()), tokens.data<int32_t>(),
                                                static_cast<const cuda::bf16*>(table.raw()), count, vocab_begin,
                                                rows, hidden));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, (name + " out").c_str());
  expect_tensor(tokens, Device::CPU, DType::I32, (name + " tokens").c_str());
  expect_tensor(table, Device::CPU, DType::F32, (name + " table").c_str());
  check_token_ids(tokens, vocab_size, op);
  cpu::embedding_forward(out.data<float>(), tokens.data<int32_t>(), table.data<float>(), count, vocab_begin, rows,
                         hidden);
}

void shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_begin,
                    int64_t vocab_size, const char* op) {
  const std::string name = op;
  FORGE_CHECK(dtable.ndim() == 2, "{}: dtable {} must be [V, H]", op, shape_str(dtable.shape()));
  FORGE_CHECK(tokens.ndim() == 1, "{}: tokens {} must be [N]", op, shape_str(tokens.shape()));
  int64_t count = tokens.dim(0), rows = dtable.dim(0), hidden = dtable.dim(1);
  check_shape(dout, {count, hidden}, (name + " dout").c_str());
  check_shard(vocab_begin, rows, vocab_size, op);
  if (dtable.device() == Device::CUDA) {
    expect_tensor(dtable, Device::CUDA, DType::F32, (name + " dtable").c_str());
    expect_tensor(dout, Device::CUDA, DType::BF16, (name + " dout").c_str());
    expect_tensor(tokens, Device::CUDA, DType::I32, (name + " tokens").c_str());
    FORGE_CUDA_CALL(op, cuda::embedding_backward(dtable.data<float>(), static_cast<const cuda::bf16*>(dout.raw()),
                                                 tokens.data<int32_t>(), count, vocab_begin, rows, hidden));
    return;
  }
  expect_tensor(dtable, Device::CPU, DType::F32, (name + " dtable").c_str());
  expect_tensor(dout, Device::CPU, DType::F32, (name + " dout").c_str());
  expect_tensor(tokens, Device::CPU, DType::I32, (name + " tokens").c_str());
  check_token_ids(tokens, vocab_size, op);
  cpu::embedding_backward(dtable.data<float>(), dout.data<float>(), tokens.data<int32_t>(), count, vocab_begin, rows,
                          hidden);
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_forward");
  FORGE_CHECK(table.ndim() == 2, "embedding_forward: table {} must be [V, H]", shape_str(table.shape()));
  shard_forward(out, tokens, table, 0, table.dim(0), "embedding_forward");
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_backward");
  FORGE_CHECK(dtable.ndim() == 2, "embedding_backward: dtable {} must be [V, H]", shape_str(dtable.shape()));
  shard_backward(dtable, dout, tokens, 0, dtable.dim(0), "embedding_backward");
}

void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                             int64_t vocab_size) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_shard_forward");
  shard_forward(out, tokens, table, vocab_begin, vocab_size, "embedding_shard_forward");
}

void embedding_shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_begin,
                              int64_t vocab_size) {
  OpProfileScope profile(OpClass::Elementwise, "embedding_shard_backward");
  shard_backward(dtable, dout, tokens, vocab_begin, vocab_size, "embedding_shard_backward");
}

}  // namespace forge
