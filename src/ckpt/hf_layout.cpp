#include "ckpt/hf_layout.h"

#include <algorithm>

#include <fmt/format.h>

namespace forge {

std::vector<int64_t> rotary_row_order(const HfRotaryRows& r, int64_t rows) {
  FORGE_CHECK(r.period > 0 && rows % r.period == 0 && r.count % 2 == 0 && r.first + r.count <= r.period,
              "rotary rows (period {}, first {}, count {}) do not fit {} rows", r.period, r.first, r.count, rows);
  std::vector<int64_t> order(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) order[static_cast<size_t>(row)] = row;
  for (int64_t block = 0; block < rows; block += r.period)
    for (int64_t j = 0; j < r.count / 2; ++j) {
      order[static_cast<size_t>(block + r.first + 2 * j)] = block + r.first + j;
      order[static_cast<size_t>(block + r.first + 2 * j + 1)] = block + r.first + r.count / 2 + j;
    }
  return order;
}

std::vector<HfPart> hf_parts(const ParamSpec& spec, bool interleaved_rotary) {
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
    if (interleaved_rotary && tensor.rotary_rows.period > 0)
      parts.back().row_order = rotary_row_order(tensor.rotary_rows, tensor.rows);
    parts.back().keep_fp32 = tensor.keep_fp32;
    row += tensor.rows;
  }
  FORGE_CHECK(row == rows, "Hugging Face parts of '{}' stack to {} rows, expected {}", spec.name, row, rows);
  return parts;
}

std::vector<int64_t> hf_stored_rows(const ParamSpec& spec, bool interleaved_rotary) {
  const std::vector<HfPart> parts = hf_parts(spec, interleaved_rotary);
  if (std::none_of(parts.begin(), parts.end(), [](const HfPart& p) { return !p.row_order.empty(); })) return {};
  const int64_t columns = spec.shape.back();
  std::vector<int64_t> rows;
  for (const HfPart& part : parts) {
    const int64_t first = part.offset / columns;
    for (int64_t r = 0; r < part.shape[0]; ++r)
      rows.push_back(first + (part.row_order.empty() ? r : part.row_order[static_cast<size_t>(r)]));
  }
  return rows;
}

std::vector<HfPart> hf_empty_parts(const ModelConfig& config) {
  std::vector<HfPart> parts;
  if (!config.mla() || !config.moe() || config.num_shared_experts > 0) return parts;
  for (int64_t layer = config.first_dense_layers; layer < config.num_layers; ++layer) {
    const std::string shared = fmt::format("model.layers.{}.mlp.shared_experts.", layer);
    parts.push_back({shared + "gate_proj.weight", {0, config.hidden_size}, 0});
    parts.push_back({shared + "up_proj.weight", {0, config.hidden_size}, 0});
    parts.push_back({shared + "down_proj.weight", {config.hidden_size, 0}, 0});
  }
  return parts;
}

}  // namespace forge
