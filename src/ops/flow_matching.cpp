#include "ops/flow_matching.h"

#include <initializer_list>
#include <string>
#include <utility>

#include "core/op_profile.h"
#include "kernels/cpu/flow_matching.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/flow_matching.h"
#endif

namespace forge {
namespace {

// On CUDA `first` may hold f32 or bf16 and the others must hold the same; on the CPU all f32.
void expect_alike(const char* op, const Tensor& first, const char* first_name,
                  std::initializer_list<std::pair<const Tensor*, const char*>> others) {
  const auto what = [op](const char* name) { return std::string(op) + " " + name; };
  DType dtype = DType::F32;
  if (first.device() == Device::CUDA) {
    FORGE_CHECK(first.dtype() == DType::F32 || first.dtype() == DType::BF16,
                "{}: {} holds {}, expected f32 or bf16 on CUDA", op, first_name, dtype_name(first.dtype()));
    dtype = first.dtype();
  }
  expect_tensor(first, first.device(), dtype, what(first_name).c_str());
  for (const auto& [tensor, name] : others) expect_tensor(*tensor, first.device(), dtype, what(name).c_str());
}

}  // namespace

void flow_matching_pair(const Tensor& noisy, const Tensor& target, const Tensor& x0, const Tensor& noise,
                        const Tensor& t) {
  OpProfileScope profile(OpClass::Elementwise, "flow_matching_pair");
  FORGE_CHECK(x0.ndim() == 3, "flow_matching_pair: x0 {} must be [B, N, F]", shape_str(x0.shape()));
  const int64_t batch = x0.dim(0), per_sample = x0.dim(1) * x0.dim(2);
  check_shape(noise, x0.shape(), "flow_matching_pair noise");
  check_shape(noisy, x0.shape(), "flow_matching_pair noisy");
  check_shape(target, x0.shape(), "flow_matching_pair target");
  check_shape(t, {batch}, "flow_matching_pair t");
  expect_alike("flow_matching_pair", x0, "x0", {{&noise, "noise"}, {&noisy, "noisy"}, {&target, "target"}});
  expect_tensor(t, x0.device(), DType::F32, "flow_matching_pair t");
  if (x0.device() == Device::CUDA) {
    if (x0.dtype() == DType::F32) {
      FORGE_CUDA_CALL("flow_matching_pair",
                      cuda::flow_matching_pair(noisy.data<float>(), target.data<float>(), x0.data<float>(),
                                               noise.data<float>(), t.data<float>(), batch, per_sample));
    } else {
      FORGE_CUDA_CALL("flow_matching_pair",
                      cuda::flow_matching_pair(bf16_ptr(noisy), bf16_ptr(target), bf16_ptr(x0), bf16_ptr(noise),
                                               t.data<float>(), batch, per_sample));
    }
    return;
  }
  cpu::flow_matching_pair(noisy.data<float>(), target.data<float>(), x0.data<float>(), noise.data<float>(),
                          t.data<float>(), batch, per_sample);
}

void mse_loss(const Tensor& loss, const Tensor& dpred, const Tensor& pred, const Tensor& target, float grad_scale) {
  OpProfileScope profile(OpClass::Elementwise, "mse_loss");
  const int64_t count = pred.numel();
  FORGE_CHECK(count > 0, "mse_loss: pred {} has no elements to average", shape_str(pred.shape()));
  check_shape(target, pred.shape(), "mse_loss target");
  check_shape(dpred, pred.shape(), "mse_loss dpred");
  check_shape(loss, {1}, "mse_loss loss");
  expect_alike("mse_loss", pred, "pred", {{&target, "target"}, {&dpred, "dpred"}});
  expect_tensor(loss, pred.device(), DType::F32, "mse_loss loss");
  const float scale = static_cast<float>(2.0 * grad_scale / static_cast<double>(count));
  if (pred.device() == Device::CUDA) {
    [[maybe_unused]] const float inv_count = static_cast<float>(1.0 / static_cast<double>(count));
    if (pred.dtype() == DType::F32) {
      FORGE_CUDA_CALL("mse_loss", cuda::mse_loss(loss.data<float>(), dpred.data<float>(), pred.data<float>(),
                                                 target.data<float>(), count, scale, inv_count));
    } else {
      FORGE_CUDA_CALL("mse_loss", cuda::mse_loss(loss.data<float>(), bf16_ptr(dpred), bf16_ptr(pred),
                                                 bf16_ptr(target), count, scale, inv_count));
    }
    return;
  }
  const double sum = cpu::mse_loss(dpred.data<float>(), pred.data<float>(), target.data<float>(), count, scale);
  loss.data<float>()[0] += static_cast<float>(sum / static_cast<double>(count));
}

}  // namespace forge
