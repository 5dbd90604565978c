#include "ops/lora.h"

#include <algorithm>

#include "core/op_profile.h"
#include "core/rng.h"
#include "kernels/cpu/lora.h"
#include "ops/matmul.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/lora.h"
#endif

namespace forge {
namespace {

// A [rows, cols] view of the start of a flat workspace buffer.
Tensor scratch(const Tensor& flat, int64_t rows, int64_t cols, const char* what) {
  FORGE_CHECK(flat.defined() && flat.ndim() == 1 && flat.numel() >= rows * cols,
              "LoRA workspace '{}' holds {} values, {} x {} are needed", what, flat.defined() ? flat.numel() : 0, rows,
              cols);
  return flat.narrow(0, rows * cols).view({rows, cols});
}

// Parts that share one input: all of them without dropout, else each its own (NOTE
// [LoRA dropout]: PEFT draws a mask per module).
struct PartGroup {
  int64_t first = 0, count = 0;
};

std::vector<PartGroup> part_groups(const LoraAdapter& lora) {
  const int64_t parts = static_cast<int64_t>(lora.parts.size());
  if (lora.dropout == 0.0f) return {{0, parts}};
  std::vector<PartGroup> groups;
  for (int64_t k = 0; k < parts; ++k) groups.push_back({k, 1});
  return groups;
}

Tensor rows_of(const Tensor& t, const LoraAdapter& lora, const PartGroup& g) {
  return t.narrow(g.first * lora.rank, (g.first + g.count) * lora.rank);
}

// The group's input: x itself, or its dropout in the workspace.
Tensor group_input(const Tensor& x, const LoraAdapter& lora, const PartGroup& g) {
  if (lora.dropout == 0.0f) return x;
  Tensor dropped = scratch(lora.workspace->wide, x.dim(0), x.dim(1), "wide");
  lora_dropout(dropped, x, lora.dropout, derive_seed(lora.dropout_seed, static_cast<uint64_t>(g.first)), false);
  return dropped;
}

void check_adapter(const LoraAdapter& lora, const Tensor& x, int64_t out_features) {
  FORGE_CHECK(lora.workspace, "LoRA adapter without a workspace");
  FORGE_CHECK(!lora.parts.empty() && lora.rank > 0, "LoRA adapter with {} parts of rank {}", lora.parts.size(),
              lora.rank);
  FORGE_CHECK(lora.dropout >= 0.0f && lora.dropout < 1.0f, "LoRA dropout {} outside [0, 1)", lora.dropout);
  check_shape(lora.a, {lora.low_rank(), x.dim(1)}, "LoRA a");
  check_shape(lora.b, {out_features, lora.low_rank()}, "LoRA b");
}

// g^T = b^T dy^T [parts * rank, tokens] in the workspace.
Tensor low_rank_grad(const Tensor& dy, const LoraAdapter& lora) {
  Tensor g_t = scratch(lora.workspace->low_rank_grad, lora.low_rank(), dy.dim(0), "low_rank_grad");
  matmul(g_t, lora.b, true, dy, true);
  return g_t;
}

}  // namespace

void lora_forward_add(const Tensor& y, const Tensor& x, const LoraAdapter& lora) {
  check_adapter(lora, x, y.dim(1));
  const Tensor u_t = scratch(lora.workspace->low_rank, lora.low_rank(), x.dim(0), "low_rank");
  for (const PartGroup& g : part_groups(lora))
    matmul(rows_of(u_t, lora, g), rows_of(lora.a, lora, g), false, group_input(x, lora, g), true);
  matmul(y, u_t, true, lora.b, true, lora.scale, 1.0f);
}

void lora_backward_input_add(const Tensor& dx, const Tensor& dy, const LoraAdapter& lora) {
  check_adapter(lora, dx, dy.dim(1));
  const Tensor g_t = low_rank_grad(dy, lora);
  if (lora.dropout == 0.0f) return matmul(dx, g_t, true, lora.a, false, lora.scale, 1.0f);
  for (const PartGroup& g : part_groups(lora)) {
    const Tensor t = scratch(lora.workspace->wide, dx.dim(0), dx.dim(1), "wide");
    matmul(t, rows_of(g_t, lora, g), true, rows_of(lora.a, lora, g), false, lora.scale, 0.0f);
    lora_dropout(dx, t, lora.dropout, derive_seed(lora.dropout_seed, static_cast<uint64_t>(g.first)), true);
  }
}

LoraAdapter lora_rows(const LoraAdapter& lora, int64_t begin, int64_t end, bool accumulate_grad_a) {
  FORGE_CHECK(lora.b.defined() && lora.b.ndim() == 2 && 0 <= begin && begin < end && end <= lora.b.dim(0),
              "lora_rows: rows [{}, {}) of a LoRA B {}", begin, end,
              lora.b.defined() ? shape_str(lora.b.shape()) : "undefined");
  LoraAdapter view = lora;
  view.b = lora.b.narrow(begin, end);
  if (lora.grad_b.defined()) view.grad_b = lora.grad_b.narrow(begin, end);
  for (LoraPartRows& p : view.parts) {
    p.begin = std::clamp(p.begin, begin, end) - begin;
    p.end = std::clamp(p.end, begin, end) - begin;
  }
  view.accumulate_grad_a = accumulate_grad_a;
  return view;
}

void lora_backward_weight(const LoraAdapter& lora, const Tensor& dy, const Tensor& x, bool overwrite) {
  check_adapter(lora, x, dy.dim(1));
  FORGE_CHECK(lora.grad_a.defined() && lora.grad_b.defined(), "LoRA gradient descriptor without gradient buffers");
  const float beta = overwrite ? 0.0f : 1.0f;
  const float beta_a = overwrite && !lora.accumulate_grad_a ? 0.0f : 1.0f;
  const Tensor g_t = low_rank_grad(dy, lora);
  const Tensor u_t = scratch(lora.workspace->low_rank, lora.low_rank(), x.dim(0), "low_rank");
  for (const PartGroup& g : part_groups(lora)) {
    const Tensor input = group_input(x, lora, g);
    matmul(rows_of(u_t, lora, g), rows_of(lora.a, lora, g), false, input, true);
    matmul(rows_of(lora.grad_a, lora, g), rows_of(g_t, lora, g), false, input, false, lora.scale, beta_a);
  }
  matmul(lora.grad_b, dy, true, u_t, true, lora.scale, beta);
  lora_mask_blocks(lora.grad_b, lora.rank, lora.parts);
}

void lora_dropout(const Tensor& out, const Tensor& in, float p, uint64_t seed, bool accumulate) {
  OpProfileScope profile(OpClass::Elementwise, "lora_dropout");
  FORGE_CHECK(out.numel() == in.numel() && out.device() == in.device(), "lora_dropout: {} into {}",
              shape_str(in.shape()), shape_str(out.shape()));
  FORGE_CHECK(p >= 0.0f && p < 1.0f, "lora_dropout: probability {} outside [0, 1)", p);
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "lora_dropout out");
    expect_tensor(in, Device::CUDA, DType::BF16, "lora_dropout in");
    FORGE_CUDA_CALL("lora_dropout", cuda::lora_dropout(static_cast<cuda::bf16*>(out.raw()),
                                                       static_cast<const cuda::bf16*>(in.raw()), in.numel(), p, seed,
                                                       accumulate));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "lora_dropout out");
  expect_tensor(in, Device::CPU, DType::F32, "lora_dropout in");
  cpu::lora_dropout(out.data<float>(), in.data<float>(), in.numel(), p, seed, accumulate);
}

void lora_mask_blocks(const Tensor& b, int64_t rank, const std::vector<LoraPartRows>& parts) {
  OpProfileScope profile(OpClass::Elementwise, "lora_mask_blocks");
  const int64_t count = static_cast<int64_t>(parts.size());
  check_shape(b, {b.dim(0), rank * count}, "lora_mask_blocks b");
  std::vector<int64_t> begin, end;
  for (const LoraPartRows& p : parts) {
    begin.push_back(p.begin);
    end.push_back(p.end);
  }
  if (b.device() == Device::CUDA) {
    expect_tensor(b, Device::CUDA, DType::F32, "lora_mask_blocks b");
    FORGE_CUDA_CALL("lora_mask_blocks", cuda::lora_mask_blocks(b.data<float>(), b.dim(0), rank,
                                                               static_cast<int>(count), begin.data(), end.data()));
    return;
  }
  expect_tensor(b, Device::CPU, DType::F32, "lora_mask_blocks b");
  cpu::lora_mask_blocks(b.data<float>(), b.dim(0), rank, static_cast<int>(count), begin.data(), end.data());
}

}  // namespace forge
