#include "ops/latent_attention.h"

#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/op_profile.h"
#include "kernels/cpu/latent_attention.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/latent_attention.h"
#endif

namespace forge {
namespace {

// The batch, sequence length and device of a call whose arguments check_pack_args accepted.
struct PackArgs {
  int64_t batch = 0, seq = 0;
  Device device = Device::CPU;
};

// Checks the dims, the packed tensor [B, T, W] and every other operand (named as the
// caller's parameters are) against them: shape, dtype (fp32 on the CPU, bf16 on CUDA; the
// tables fp32, positions int32) and device; positions on the CPU must index the tables.
PackArgs check_pack_args(const Tensor& packed, const char* packed_name, const Tensor& q, const char* q_name,
                         const Tensor& kv_a, const char* kv_a_name, const Tensor& kv, const char* kv_name,
                         const MlaDims& d, const Tensor& cos, const Tensor& sin, const Tensor* positions,
                         const char* op) {
  FORGE_CHECK(d.heads >= 1 && d.nope_dim >= 0 && d.rope_dim >= 2 && d.rope_dim % 2 == 0 && d.v_dim >= 1 &&
                  d.kv_rank >= 0,
              "{}: bad MLA dims (heads {}, nope_dim {}, rope_dim {}, v_dim {}, kv_rank {}): heads and v_dim must be "
              "positive, rope_dim even and positive, nope_dim and kv_rank at least 0",
              op, d.heads, d.nope_dim, d.rope_dim, d.v_dim, d.kv_rank);
  auto name = [op](const char* what) { return fmt::format("{} {}", op, what); };
  FORGE_CHECK(packed.ndim() == 3 && packed.dim(2) == d.packed_width(),
              "{}: {} {} must be [B, T, {}] (heads {} x (2 x ({} + {}) + {}))", op, packed_name,
              shape_str(packed.shape()), d.packed_width(), d.heads, d.nope_dim, d.rope_dim, d.v_dim);
  PackArgs a{packed.dim(0), packed.dim(1), packed.device()};
  const int64_t tokens = a.batch * a.seq;
  check_shape(q, {tokens, d.heads * d.qk_dim()}, name(q_name).c_str());
  check_shape(kv_a, {tokens, d.kv_rank + d.rope_dim}, name(kv_a_name).c_str());
  check_shape(kv, {tokens, d.heads * (d.nope_dim + d.v_dim)}, name(kv_name).c_str());
  const DType rows = a.device == Device::CUDA ? DType::BF16 : DType::F32;
  expect_tensor(packed, a.device, rows, name(packed_name).c_str());
  expect_tensor(q, a.device, rows, name(q_name).c_str());
  expect_tensor(kv_a, a.device, rows, name(kv_a_name).c_str());
  expect_tensor(kv, a.device, rows, name(kv_name).c_str());
  FORGE_CHECK(cos.ndim() == 2 && cos.dim(1) == d.rope_dim / 2 && (positions || cos.dim(0) >= a.seq),
              "{}: cos table {} must be [positions, rope_dim / 2 = {}] covering the {} positions of a row", op,
              shape_str(cos.shape()), d.rope_dim / 2, a.seq);
  check_shape(sin, cos.shape(), name("sin table").c_str());
  expect_tensor(cos, a.device, DType::F32, name("cos table").c_str());
  expect_tensor(sin, a.device, DType::F32, name("sin table").c_str());
  if (!positions) return a;
  check_shape(*positions, {a.batch, a.seq}, name("positions").c_str());
  expect_tensor(*positions, a.device, DType::I32, name("positions").c_str());
  if (a.device != Device::CPU) return a;
  const int32_t* p = positions->data<int32_t>();
  for (int64_t i = 0; i < positions->numel(); ++i)
    FORGE_CHECK(p[i] >= 0 && p[i] < cos.dim(0), "{}: position {} of token {} is outside the table's {} rows", op,
                p[i], i, cos.dim(0));
  return a;
}

}  // namespace

void mla_pack_qkv(const Tensor& qkv, const Tensor& q, const Tensor& kv_a, const Tensor& kv, const MlaDims& dims,
                  const Tensor& cos, const Tensor& sin, const Tensor* positions) {
  OpProfileScope profile(OpClass::Elementwise, "mla_pack_qkv");
  const char* op = "mla_pack_qkv";
  const PackArgs a = check_pack_args(qkv, "qkv", q, "q", kv_a, "kv_a", kv, "kv", dims, cos, sin, positions, op);
  const int32_t* position_data = positions ? positions->data<int32_t>() : nullptr;
  if (a.device == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::mla_pack_qkv(bf16_ptr(qkv), bf16_ptr(q), bf16_ptr(kv_a), bf16_ptr(kv), a.batch, a.seq,
                                           dims.heads, dims.nope_dim, dims.rope_dim, dims.v_dim, dims.kv_rank,
                                           cos.data<float>(), sin.data<float>(), position_data));
    return;
  }
  cpu::mla_pack_qkv(qkv.data<float>(), q.data<float>(), kv_a.data<float>(), kv.data<float>(), a.batch, a.seq,
                    dims.heads, dims.nope_dim, dims.rope_dim, dims.v_dim, dims.kv_rank, cos.data<float>(),
                    sin.data<float>(), position_data);
}

void mla_pack_qkv_backward(const Tensor& d_q, const Tensor& d_kv_a, const Tensor& d_kv, const Tensor& d_qkv,
                           const MlaDims& dims, const Tensor& cos, const Tensor& sin, const Tensor* positions) {
  OpProfileScope profile(OpClass::Elementwise, "mla_pack_qkv_backward");
  const char* op = "mla_pack_qkv_backward";
  const PackArgs a =
      check_pack_args(d_qkv, "d_qkv", d_q, "d_q", d_kv_a, "d_kv_a", d_kv, "d_kv", dims, cos, sin, positions, op);
  const int32_t* position_data = positions ? positions->data<int32_t>() : nullptr;
  if (a.device == Device::CUDA) {
    FORGE_CUDA_CALL(op, cuda::mla_pack_qkv_backward(bf16_ptr(d_q), bf16_ptr(d_kv_a), bf16_ptr(d_kv), bf16_ptr(d_qkv),
                                                    a.batch, a.seq, dims.heads, dims.nope_dim, dims.rope_dim,
                                                    dims.v_dim, dims.kv_rank, cos.data<float>(), sin.data<float>(),
                                                    position_data));
    return;
  }
  cpu::mla_pack_qkv_backward(d_q.data<float>(), d_kv_a.data<float>(), d_kv.data<float>(), d_qkv.data<float>(),
                             a.batch, a.seq, dims.heads, dims.nope_dim, dims.rope_dim, dims.v_dim, dims.kv_rank,
                             cos.data<float>(), sin.data<float>(), position_data);
}

}  // namespace forge
