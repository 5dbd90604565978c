#include "ops/patchify.h"

#include <string>

#include "core/op_profile.h"
#include "kernels/cpu/patchify.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/patchify.h"
#endif

namespace forge {
namespace {

// Checks both tensors (`op` names the caller in messages) and returns the grid.
cpu::PatchGrid check_patch_grid(const char* op, const Tensor& tokens, const Tensor& latents, int64_t patch) {
  FORGE_CHECK(latents.ndim() == 4, "{}: latents {} must be [B, C, H, W]", op, shape_str(latents.shape()));
  FORGE_CHECK(patch >= 1, "{}: patch {} must be at least 1", op, patch);
  const cpu::PatchGrid g{latents.dim(0), latents.dim(1), latents.dim(2), latents.dim(3), patch};
  FORGE_CHECK(g.height % patch == 0 && g.width % patch == 0,
              "{}: latents {} need a height and width that are multiples of the patch {}", op,
              shape_str(latents.shape()), patch);
  const std::string what = std::string(op) + " tokens";
  check_shape(tokens, {g.batch, (g.height / patch) * (g.width / patch), g.channels * patch * patch}, what.c_str());
  return g;
}

// The dtype both tensors hold: f32 on the CPU, f32 or bf16 (the same) on CUDA.
void check_patch_dtypes(const char* op, const Tensor& tokens, const Tensor& latents) {
  const std::string latents_what = std::string(op) + " latents", tokens_what = std::string(op) + " tokens";
  if (latents.device() == Device::CUDA) {
    FORGE_CHECK(latents.dtype() == DType::F32 || latents.dtype() == DType::BF16,
                "{}: latents hold {}, expected f32 or bf16 on CUDA", op, dtype_name(latents.dtype()));
    expect_tensor(tokens, Device::CUDA, latents.dtype(), tokens_what.c_str());
    return;
  }
  expect_tensor(latents, Device::CPU, DType::F32, latents_what.c_str());
  expect_tensor(tokens, Device::CPU, DType::F32, tokens_what.c_str());
}

#ifdef FORGE_CUDA
cuda::PatchGrid cuda_grid(const cpu::PatchGrid& g) { return {g.batch, g.channels, g.height, g.width, g.patch}; }
#endif

}  // namespace

void patchify(const Tensor& tokens, const Tensor& latents, int64_t patch) {
  OpProfileScope profile(OpClass::Elementwise, "patchify");
  const cpu::PatchGrid g = check_patch_grid("patchify", tokens, latents, patch);
  check_patch_dtypes("patchify", tokens, latents);
  if (latents.device() == Device::CUDA) {
    if (latents.dtype() == DType::F32) {
      FORGE_CUDA_CALL("patchify", cuda::patchify(tokens.data<float>(), latents.data<float>(), cuda_grid(g)));
    } else {
      FORGE_CUDA_CALL("patchify", cuda::patchify(bf16_ptr(tokens), bf16_ptr(latents), cuda_grid(g)));
    }
    return;
  }
  cpu::patchify(tokens.data<float>(), latents.data<float>(), g);
}

void unpatchify(const Tensor& latents, const Tensor& tokens, int64_t patch) {
  OpProfileScope profile(OpClass::Elementwise, "unpatchify");
  const cpu::PatchGrid g = check_patch_grid("unpatchify", tokens, latents, patch);
  check_patch_dtypes("unpatchify", tokens, latents);
  if (latents.device() == Device::CUDA) {
    if (latents.dtype() == DType::F32) {
      FORGE_CUDA_CALL("unpatchify", cuda::unpatchify(latents.data<float>(), tokens.data<float>(), cuda_grid(g)));
    } else {
      FORGE_CUDA_CALL("unpatchify", cuda::unpatchify(bf16_ptr(latents), bf16_ptr(tokens), cuda_grid(g)));
    }
    return;
  }
  cpu::unpatchify(latents.data<float>(), tokens.data<float>(), g);
}

}  // namespace forge
