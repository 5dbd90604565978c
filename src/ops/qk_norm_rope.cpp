#include "ops/qk_norm_rope.h"

#include "core/op_profile.h"
#include "kernels/cpu/qk_norm_rope.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/qk_norm_rope.h"
#endif

namespace forge {
namespace {

// The stream's and the joint tensor's dimensions, checked: qkv [B, T, 3H, D], qkv_in
// [B, Ts, 3H, D] with offset + Ts <= T, rstd [B, Ts, 2H], weights [D], tables [T, D/2], each
// on qkv's device in the dtype NOTE [Op placement] gives it.
cpu::QkNormRopeDims stream_dims(const Tensor& qkv, const Tensor& qkv_in, const Tensor& rstd, const Tensor& q_weight,
                                const Tensor& k_weight, const Tensor& cos, const Tensor& sin, int64_t offset,
                                const char* op, const char* joint) {
  auto name = [op](const char* tensor) { return fmt::format("{} {}", op, tensor); };
  FORGE_CHECK(qkv.ndim() == 4 && qkv.dim(2) % 3 == 0 && qkv.dim(2) > 0 && qkv.dim(3) % 2 == 0,
              "{}: {} {} must be [B, T, 3 H, D] with D even", op, joint, shape_str(qkv.shape()));
  const int64_t batch = qkv.dim(0), seq = qkv.dim(1), heads = qkv.dim(2) / 3, dim = qkv.dim(3);
  FORGE_CHECK(qkv_in.ndim() == 4 && qkv_in.dim(0) == batch && qkv_in.dim(2) == 3 * heads && qkv_in.dim(3) == dim,
              "{}: qkv_in {} must be [{}, Ts, {}, {}] for {} {}", op, shape_str(qkv_in.shape()), batch, 3 * heads, dim,
              joint, shape_str(qkv.shape()));
  const int64_t stream_seq = qkv_in.dim(1);
  FORGE_CHECK(offset >= 0 && offset + stream_seq <= seq,
              "{}: the stream's {} tokens at offset {} are not within {}'s {} tokens", op, stream_seq, offset, joint,
              seq);
  check_shape(rstd, {batch, stream_seq, 2 * heads}, name("rstd").c_str());
  check_shape(q_weight, {dim}, name("q_weight").c_str());
  check_shape(k_weight, {dim}, name("k_weight").c_str());
  FORGE_CHECK(cos.ndim() == 2 && cos.dim(0) == seq && cos.dim(1) == dim / 2,
              "{}: cos table {} must be [{}, {}] (joint tokens, head_dim / 2)", op, shape_str(cos.shape()), seq,
              dim / 2);
  check_shape(sin, cos.shape(), name("sin").c_str());
  const Device device = qkv.device();
  const DType act = device == Device::CUDA ? DType::BF16 : DType::F32;
  expect_tensor(qkv, device, act, name(joint).c_str());
  expect_tensor(qkv_in, device, act, name("qkv_in").c_str());
  expect_tensor(q_weight, device, act, name("q_weight").c_str());
  expect_tensor(k_weight, device, act, name("k_weight").c_str());
  expect_tensor(rstd, device, DType::F32, name("rstd").c_str());
  expect_tensor(cos, device, DType::F32, name("cos").c_str());
  expect_tensor(sin, device, DType::F32, name("sin").c_str());
  return {batch, seq, stream_seq, heads, dim, offset};
}

#ifdef FORGE_CUDA
cuda::QkNormRopeProblem cuda_problem(const cpu::QkNormRopeDims& d) {
  return {d.batch, d.seq, d.stream_seq, d.heads, d.head_dim, d.offset};
}
#endif

}  // namespace

void qk_norm_rope_forward(const Tensor& qkv, const Tensor& rstd, const Tensor& qkv_in, const Tensor& q_weight,
                          const Tensor& k_weight, float eps, const Tensor& cos, const Tensor& sin, int64_t offset) {
  OpProfileScope profile(OpClass::Elementwise, "qk_norm_rope_forward");
  const cpu::QkNormRopeDims d =
      stream_dims(qkv, qkv_in, rstd, q_weight, k_weight, cos, sin, offset, "qk_norm_rope_forward", "qkv");
  FORGE_CHECK(qkv.raw() != qkv_in.raw(), "qk_norm_rope_forward: qkv must not alias qkv_in");
  if (qkv.device() == Device::CUDA) {
    FORGE_CUDA_CALL("qk_norm_rope_forward",
                    cuda::qk_norm_rope_forward(bf16_ptr(qkv), rstd.data<float>(), bf16_ptr(qkv_in),
                                               bf16_ptr(q_weight), bf16_ptr(k_weight), eps, cos.data<float>(),
                                               sin.data<float>(), cuda_problem(d)));
    return;
  }
  cpu::qk_norm_rope_forward(qkv.data<float>(), rstd.data<float>(), qkv_in.data<float>(), q_weight.data<float>(),
                            k_weight.data<float>(), eps, cos.data<float>(), sin.data<float>(), d);
}

void qk_norm_rope_backward(const Tensor& dqkv_in, const Tensor& dq_weight, const Tensor& dk_weight,
                           const Tensor& dqkv, const Tensor& qkv_in, const Tensor& q_weight, const Tensor& k_weight,
                           const Tensor& rstd, const Tensor& cos, const Tensor& sin, int64_t offset) {
  OpProfileScope profile(OpClass::Elementwise, "qk_norm_rope_backward");
  const cpu::QkNormRopeDims d =
      stream_dims(dqkv, qkv_in, rstd, q_weight, k_weight, cos, sin, offset, "qk_norm_rope_backward", "dqkv");
  check_shape(dqkv_in, qkv_in.shape(), "qk_norm_rope_backward dqkv_in");
  check_shape(dq_weight, q_weight.shape(), "qk_norm_rope_backward dq_weight");
  check_shape(dk_weight, k_weight.shape(), "qk_norm_rope_backward dk_weight");
  const Device device = dqkv.device();
  expect_tensor(dqkv_in, device, dqkv.dtype(), "qk_norm_rope_backward dqkv_in");
  expect_tensor(dq_weight, device, DType::F32, "qk_norm_rope_backward dq_weight");
  expect_tensor(dk_weight, device, DType::F32, "qk_norm_rope_backward dk_weight");
  FORGE_CHECK(dqkv_in.raw() != dqkv.raw() && dqkv_in.raw() != qkv_in.raw() && dq_weight.raw() != dk_weight.raw(),
              "qk_norm_rope_backward: dqkv_in must not alias dqkv or qkv_in, nor dq_weight dk_weight");
  if (device == Device::CUDA) {
    FORGE_CUDA_CALL("qk_norm_rope_backward",
                    cuda::qk_norm_rope_backward(bf16_ptr(dqkv_in), dq_weight.data<float>(), dk_weight.data<float>(),
                                                bf16_ptr(dqkv), bf16_ptr(qkv_in), bf16_ptr(q_weight),
                                                bf16_ptr(k_weight), rstd.data<float>(), cos.data<float>(),
                                                sin.data<float>(), cuda_problem(d)));
    return;
  }
  cpu::qk_norm_rope_backward(dqkv_in.data<float>(), dq_weight.data<float>(), dk_weight.data<float>(),
                             dqkv.data<float>(), qkv_in.data<float>(), q_weight.data<float>(), k_weight.data<float>(),
                             rstd.data<float>(), cos.data<float>(), sin.data<float>(), d);
}

}  // namespace forge
