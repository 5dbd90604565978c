#include "ops/placement.h"

namespace forge {

void expect_tensor(const Tensor& t, Device device, DType dtype, const char* what) {
  FORGE_CHECK(t.device() == device, "{} is on {}, expected {}", what, device_name(t.device()), device_name(device));
  check_dtype(t, dtype, what);
}

void fail_without_cuda(const char* op) {
  FORGE_FAIL("{}: CUDA tensors need the CUDA backend; this build of forge has none (configure with -DFORGE_CUDA=ON)",
             op);
}

}  // namespace forge
