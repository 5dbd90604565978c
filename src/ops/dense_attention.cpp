#include "ops/dense_attention.h"

#include "core/op_profile.h"
#include "kernels/cpu/dense_attention.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/dense_attention.h"
#endif

namespace forge {

void dense_attention_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* bias,
                             float scale) {
  OpProfileScope profile(OpClass::Attention, "dense_attention_forward");
  FORGE_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4,
              "dense_attention_forward: q {}, k {}, v {} must be [B, L, H, D]", shape_str(q.shape()),
              shape_str(k.shape()), shape_str(v.shape()));
  const int64_t batch = q.dim(0), q_len = q.dim(1), heads = q.dim(2), head_dim = q.dim(3);
  const int64_t kv_len = k.dim(1), v_head_dim = v.dim(3);
  FORGE_CHECK(kv_len >= 1, "dense_attention_forward: k {} has no keys to attend to", shape_str(k.shape()));
  check_shape(k, {batch, kv_len, heads, head_dim}, "dense_attention_forward k");
  check_shape(v, {batch, kv_len, heads, v_head_dim}, "dense_attention_forward v");
  check_shape(out, {batch, q_len, heads, v_head_dim}, "dense_attention_forward out");
  if (bias) check_shape(*bias, {heads, q_len, kv_len}, "dense_attention_forward bias");
  for (const Tensor* t : {&q, &k, &v})
    FORGE_CHECK(t->raw() != out.raw() || t->numel() == 0, "dense_attention_forward: out must not alias an input");
  if (profile.active())
    profile.set_detail(fmt::format("{}x{} heads, {}x{} tokens, d {}/{}{}", batch, heads, q_len, kv_len, head_dim,
                                   v_head_dim, bias ? ", bias" : ""));
  if (q.device() == Device::CUDA) {
    for (const auto& [t, what] :
         {std::pair{&out, "dense_attention_forward out"}, std::pair{&q, "dense_attention_forward q"},
          std::pair{&k, "dense_attention_forward k"}, std::pair{&v, "dense_attention_forward v"}})
      expect_tensor(*t, Device::CUDA, DType::BF16, what);
    if (bias) expect_tensor(*bias, Device::CUDA, DType::BF16, "dense_attention_forward bias");
    FORGE_CUDA_CALL("dense_attention_forward",
                    cuda::dense_attention_forward(bf16_ptr(out), bf16_ptr(q), bf16_ptr(k), bf16_ptr(v),
                                                  bias ? bf16_ptr(*bias) : nullptr, batch, q_len, kv_len, heads,
                                                  head_dim, v_head_dim, scale));
    return;
  }
  for (const auto& [t, what] :
       {std::pair{&out, "dense_attention_forward out"}, std::pair{&q, "dense_attention_forward q"},
        std::pair{&k, "dense_attention_forward k"}, std::pair{&v, "dense_attention_forward v"}})
    expect_tensor(*t, Device::CPU, DType::F32, what);
  if (bias) expect_tensor(*bias, Device::CPU, DType::F32, "dense_attention_forward bias");
  cpu::dense_attention_forward(out.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
                               bias ? bias->data<float>() : nullptr, batch, q_len, kv_len, heads, head_dim, v_head_dim,
                               scale);
}

}  // namespace forge
