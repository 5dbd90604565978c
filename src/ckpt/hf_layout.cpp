#include "ckpt/hf_layout.h"

#include <algorithm>

namespace forge {

std::vector<HfPart> hf_parts(const ParamSpec& spec) {
  // A stack of matrices [E, R, C] is E x R rows of C; anything else is rows along dim 0.
  const bool stack = spec.shape.size() == 3;
  const int64_t rows = stack ? spec.shape[0] * spec.shape[1] : spec.shape.at(0);
  const int64_t row_elements = shape_numel(spec.shape) / std::max<int64_t>(rows, 1);
  std::vector<HfPart> parts;
  int64_t row = 0;
  for (const HfTensor& tensor : spec.hf_tensors) {
    Shape shape = stack ? Shape{tensor.rows, spec.shape[2]} : spec.shape;
    shape[0] = tensor.rows;
    parts.push_back({tensor.name, shape, row * row_elements});
    row += tensor.rows;
  }
  FORGE_CHECK(row == rows, "Hugging Face parts of '{}' stack to {} rows, expected {}", spec.name, row, rows);
  return parts;
}

}  // namespace forge
