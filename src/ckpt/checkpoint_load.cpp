// Finding and reading checkpoints, and the checks that turn a damaged or mismatched one
// into an error naming the file and the tensor. open_checkpoint checks what can be
// checked without reading tensor data (metadata structure, piece layout, shard file
// sizes); read_flat_range checks each piece's CRC-32 as it reads it;
// check_checkpoint_model compares the tensors with the configured model's.
#include <algorithm>
#include <bit>
#include <charconv>
#include <filesystem>
#include <map>
#include <memory>

#include <fmt/ranges.h>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_layout.h"
#include "ckpt/checkpoint_metadata.h"
#include "ckpt/checkpoint_stream.h"
#include "core/error.h"
#include "core/input_file.h"
#include "model/parameters.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "shard files are little-endian fp32");

constexpr int64_t kFloatBytes = sizeof(float);

std::string shard_path(const std::string& dir, int rank) { return fmt::format("{}/rank-{}.bin", dir, rank); }
std::string metadata_path(const std::string& dir) { return dir + "/" + kCheckpointMetadataFile; }

// "tensor 'layers.0.mlp.down.weight' (exp_avg)"
std::string describe(const TensorRecord& rec) {
  return fmt::format("tensor '{}' ({})", rec.name, flat_state_name(rec.state));
}

void check_shards(const std::string& file, const CheckpointMetadata& md) {
  if (md.file_numel.empty()) FORGE_FAIL("checkpoint metadata '{}' lists no shards", file);
  if (md.format_version != kCheckpointFormatVersion) return;  // format 2: the pieces say where (check_bands)
  int64_t covered = 0;
  for (size_t r = 0; r < md.shards.size(); ++r) {
    const ShardRange& s = md.shards[r];
    if (s.begin != covered || s.end < s.begin)
      FORGE_FAIL("checkpoint metadata '{}': shards[{}] covers flat elements [{}, {}), expected to start at {}", file,
                 r, s.begin, s.end, covered);
    covered = s.end;
  }
  if (covered != md.flat_numel)
    FORGE_FAIL("checkpoint metadata '{}': the shards cover {} flat elements, flat_numel is {}", file, covered,
               md.flat_numel);
}

// Format 1: each piece lies inside its rank's range at the byte offset the layout implies,
// and the pieces of a tensor follow each other without gap from its first element to its last.
void check_pieces(const std::string& file, const CheckpointMetadata& md) {
  for (const TensorRecord& rec : md.tensors) {
    const int64_t end = rec.flat_offset + shape_numel(rec.shape);
    if (rec.flat_offset < 0 || end > md.flat_numel)
      FORGE_FAIL("checkpoint metadata '{}': {} spans flat elements [{}, {}), outside [0, {})", file, describe(rec),
                 rec.flat_offset, end, md.flat_numel);
    int64_t next = rec.flat_offset;
    for (const TensorPiece& p : rec.pieces) {
      if (p.rank < 0 || p.rank >= static_cast<int>(md.shards.size()))
        FORGE_FAIL("checkpoint metadata '{}': {} has a piece on rank {}, but the world size is {}", file,
                   describe(rec), p.rank, md.shards.size());
      const ShardRange& s = md.shards[static_cast<size_t>(p.rank)];
      const int64_t count = p.byte_length / kFloatBytes;
      const int64_t expected_offset =
          (static_cast<int64_t>(rec.state) * s.size() + (p.flat_begin - s.begin)) * kFloatBytes;
      if (p.flat_begin != next || p.byte_length <= 0 || p.byte_length % kFloatBytes != 0 || p.flat_begin < s.begin ||
          p.flat_begin + count > s.end || p.byte_offset != expected_offset)
        FORGE_FAIL("checkpoint metadata '{}': {} has an inconsistent piece in rank-{}.bin (flat {} + {} bytes at "
                   "byte {}; expected flat {} at byte {})",
                   file, describe(rec), p.rank, p.flat_begin, p.byte_length, p.byte_offset, next, expected_offset);
      next += count;
    }
    if (next != end)
      FORGE_FAIL("checkpoint metadata '{}': the pieces of {} cover flat elements [{}, {}), expected [{}, {})", file,
                 describe(rec), rec.flat_offset, next, rec.flat_offset, end);
  }
}

// Format 2 (NOTE [Tensor-parallel checkpoints] in ckpt/checkpoint_layout.h): every piece is
// a run of one column band of its tensor (NOTE [Column bands]); the bands of a tensor's
// pieces tile its columns and the pieces of each band tile that band, so the pieces hold
// every element of the tensor exactly once; and the pieces of each file tile its bytes.
void check_bands(const std::string& file, const CheckpointMetadata& md) {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> bytes(md.file_numel.size());  // per file: (offset, length)
  for (const TensorRecord& rec : md.tensors) {
    const int64_t numel = shape_numel(rec.shape);
    if (rec.flat_offset < 0 || rec.flat_offset + numel > md.flat_numel)
      FORGE_FAIL("checkpoint metadata '{}': {} spans flat elements [{}, {}), outside [0, {})", file, describe(rec),
                 rec.flat_offset, rec.flat_offset + numel, md.flat_numel);
    const int64_t columns = band_columns(rec.shape);
    const int64_t rows = numel / columns;
    std::map<int64_t, std::pair<int64_t, std::vector<BandRange>>> bands;  // band_begin -> (width, its pieces)
    for (const TensorPiece& p : rec.pieces) {
      auto bad = [&](const char* why) {
        FORGE_FAIL("checkpoint metadata '{}': {} has an inconsistent piece in rank-{}.bin (flat {} + {} bytes at byte "
                   "{}, columns [{}, +{}) of {}): {}",
                   file, describe(rec), p.rank, p.flat_begin, p.byte_length, p.byte_offset, p.band_begin, p.band_width,
                   columns, why);
      };
      if (p.byte_length <= 0 || p.byte_length % kFloatBytes != 0) bad("its length is not a positive number of floats");
      if (p.flat_begin < rec.flat_offset || p.flat_begin >= rec.flat_offset + numel) bad("it starts outside the tensor");
      const int64_t width = p.band_width > 0 ? p.band_width : columns, band_begin = p.band_width > 0 ? p.band_begin : 0;
      if (band_begin + width > columns) bad("its band lies outside the tensor's columns");
      const int64_t column = (p.flat_begin - rec.flat_offset) % columns;
      if (column < band_begin || column >= band_begin + width) bad("its first element lies outside its band");
      const BandRange band = piece_band(rec, p);
      if (band.end > rows * width) bad("it runs past the tensor's last row");
      if (p.byte_offset + p.byte_length > 3 * md.file_numel[static_cast<size_t>(p.rank)] * kFloatBytes)
        bad("it ends past the end of its file");
      auto [it, added] = bands.try_emplace(band_begin, width, std::vector<BandRange>{});
      if (it->second.first != width) bad("another piece has a band of another width starting at the same column");
      it->second.second.push_back(band);
      bytes[static_cast<size_t>(p.rank)].push_back({p.byte_offset, p.byte_length});
    }
    int64_t next_column = 0;
    for (auto& [band_begin, band] : bands) {
      auto& [width, ranges] = band;
      if (band_begin != next_column)
        FORGE_FAIL("checkpoint metadata '{}': the pieces of {} cover columns from {}, expected from {}", file,
                   describe(rec), band_begin, next_column);
      std::sort(ranges.begin(), ranges.end(), [](const BandRange& a, const BandRange& b) { return a.begin < b.begin; });
      int64_t next = 0;
      for (const BandRange& r : ranges) {
        if (r.begin != next) break;
        next = r.end;
      }
      if (next != rows * width)
        FORGE_FAIL("checkpoint metadata '{}': the pieces of {} in columns [{}, {}) do not hold each of its {} elements "
                   "there exactly once",
                   file, describe(rec), band_begin, band_begin + width, rows * width);
      next_column = band_begin + width;
    }
    if (numel > 0 && next_column != columns)
      FORGE_FAIL("checkpoint metadata '{}': the pieces of {} cover its columns [0, {}), expected [0, {})", file,
                 describe(rec), next_column, columns);
  }
  for (size_t r = 0; r < bytes.size(); ++r) {
    std::sort(bytes[r].begin(), bytes[r].end());
    int64_t next = 0;
    for (const auto& [offset, length] : bytes[r]) {
      if (offset != next)
        FORGE_FAIL("checkpoint metadata '{}': the pieces of rank-{}.bin {} at byte {}, where byte {} was expected", file,
                   r, offset < next ? "overlap" : "leave a gap", offset, next);
      next = offset + length;
    }
    if (next != 3 * md.file_numel[r] * kFloatBytes)
      FORGE_FAIL("checkpoint metadata '{}': the pieces of rank-{}.bin cover {} of its {} bytes", file, r, next,
                 3 * md.file_numel[r] * kFloatBytes);
  }
}

void check_shard_files(const std::string& dir, const CheckpointMetadata& md) {
  for (size_t r = 0; r < md.file_numel.size(); ++r) {
    const std::string path = shard_path(dir, static_cast<int>(r));
    if (!fs::is_regular_file(path))
      FORGE_FAIL("checkpoint '{}' lacks its shard file '{}' (world size {})", dir, path, md.file_numel.size());
    const int64_t expected = 3 * md.file_numel[r] * kFloatBytes;
    const int64_t actual = static_cast<int64_t>(fs::file_size(path));
    if (actual == expected) continue;
    if (actual > expected)
      FORGE_FAIL("shard file '{}' is {} bytes, longer than the {} its metadata describes", path, actual, expected);
    std::string first_cut = "its end";
    for (const TensorRecord& rec : md.tensors)
      for (const TensorPiece& p : rec.pieces)
        if (p.rank == static_cast<int>(r) && p.byte_offset + p.byte_length > actual) {
          first_cut = describe(rec);
          break;
        }
    FORGE_FAIL("shard file '{}' is {} bytes, shorter than the {} its metadata describes: {} is cut off", path, actual,
               expected, first_cut);
  }
}

std::string read_text(const std::string& path) {
  return read_regular_file(path, "the checkpoint metadata");  // NOTE [User files must be regular files]
}

void check_architecture(const std::string& file, const ModelConfig& saved, const ModelConfig& model) {
  auto same = [&](const char* key, auto a, auto b) {
    if (a != b)
      FORGE_FAIL("checkpoint '{}' was saved for a different model: model.{} = {} there, {} in the configured model",
                 file, key, a, b);
  };
  same("vocab_size", saved.vocab_size, model.vocab_size);
  same("hidden_size", saved.hidden_size, model.hidden_size);
  same("num_layers", saved.num_layers, model.num_layers);
  same("num_heads", saved.num_heads, model.num_heads);
  same("num_kv_heads", saved.num_kv_heads, model.num_kv_heads);
  same("head_dim", saved.resolved_head_dim(), model.resolved_head_dim());
  same("ffn_hidden_size", saved.ffn_hidden_size, model.ffn_hidden_size);
  same("norm_eps", saved.norm_eps, model.norm_eps);
  same("rope_theta", saved.rope_theta, model.rope_theta);
  same("rope_scaling.enabled", saved.rope_scaling.enabled, model.rope_scaling.enabled);
  if (model.rope_scaling.enabled) {
    same("rope_scaling.factor", saved.rope_scaling.factor, model.rope_scaling.factor);
    same("rope_scaling.low_freq_factor", saved.rope_scaling.low_freq_factor, model.rope_scaling.low_freq_factor);
    same("rope_scaling.high_freq_factor", saved.rope_scaling.high_freq_factor, model.rope_scaling.high_freq_factor);
    same("rope_scaling.original_max_position", saved.rope_scaling.original_max_position,
         model.rope_scaling.original_max_position);
    same("rope_scaling.type", saved.rope_scaling.type, model.rope_scaling.type);
    if (model.rope_scaling.yarn()) {
      same("rope_scaling.beta_fast", saved.rope_scaling.beta_fast, model.rope_scaling.beta_fast);
      same("rope_scaling.beta_slow", saved.rope_scaling.beta_slow, model.rope_scaling.beta_slow);
      same("rope_scaling.mscale", saved.rope_scaling.mscale, model.rope_scaling.mscale);
      same("rope_scaling.mscale_all_dim", saved.rope_scaling.mscale_all_dim, model.rope_scaling.mscale_all_dim);
    }
  }
  same("sliding_window", saved.sliding_window, model.sliding_window);
  same("tie_word_embeddings", saved.tie_word_embeddings, model.tie_word_embeddings);
  same("num_experts", saved.num_experts, model.num_experts);
  same("num_experts_per_tok", saved.num_experts_per_tok, model.num_experts_per_tok);
  same("moe_ffn_hidden_size", saved.resolved_moe_ffn(), model.resolved_moe_ffn());
  same("num_shared_experts", saved.num_shared_experts, model.num_shared_experts);
  same("first_dense_layers", saved.first_dense_layers, model.first_dense_layers);
  same("router_score_function", saved.router_score_function, model.router_score_function);
  same("router_normalize_topk", saved.router_normalize_topk, model.router_normalize_topk);
  same("router_scaling_factor", saved.router_scaling_factor, model.router_scaling_factor);
  same("router_num_groups", saved.router_num_groups, model.router_num_groups);
  same("router_topk_groups", saved.router_topk_groups, model.router_topk_groups);
  same("q_lora_rank", saved.q_lora_rank, model.q_lora_rank);
  same("kv_lora_rank", saved.kv_lora_rank, model.kv_lora_rank);
  same("qk_nope_head_dim", saved.qk_nope_head_dim, model.qk_nope_head_dim);
  same("qk_rope_head_dim", saved.qk_rope_head_dim, model.qk_rope_head_dim);
  same("v_head_dim", saved.v_head_dim, model.v_head_dim);
}

std::string describe_model(const ModelConfig& m) {
  std::string ffn = fmt::format("ffn {}", m.ffn_hidden_size);
  if (m.moe() && (m.moe_ffn_hidden_size > 0 || m.num_shared_experts > 0 || m.first_dense_layers > 0))
    ffn = fmt::format("ffn {} in the first {} blocks, then {} experts of {} (top-{}, {} shared)", m.ffn_hidden_size,
                      m.first_dense_layers, m.num_experts, m.resolved_moe_ffn(), m.num_experts_per_tok,
                      m.num_shared_experts);
  else if (m.moe())
    ffn += fmt::format(" in {} experts (top-{})", m.num_experts, m.num_experts_per_tok);
  return fmt::format("'{}': {} layers, hidden {}, {}{}, vocab {}", m.name, m.num_layers, m.hidden_size, ffn,
                     m.mla() ? fmt::format(", MLA (q rank {}, kv rank {})", m.q_lora_rank, m.kv_lora_rank) : "",
                     m.vocab_size);
}

}  // namespace

std::string checkpoint_dir(const std::string& folder, int64_t step) { return fmt::format("{}/step-{}", folder, step); }

std::vector<int64_t> checkpoint_steps(const std::string& folder) {
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("step-") || !entry.is_directory()) continue;
    int64_t step = -1;
    const char* digits = name.data() + 5;
    auto [end, error] = std::from_chars(digits, name.data() + name.size(), step);
    if (error == std::errc() && end == name.data() + name.size() && step >= 0) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<std::string> find_checkpoint(const std::string& folder, int64_t load_step) {
  const std::vector<int64_t> steps = checkpoint_steps(folder);
  if (load_step < 0) {
    if (steps.empty()) return std::nullopt;
    return checkpoint_dir(folder, steps.back());
  }
  if (std::find(steps.begin(), steps.end(), load_step) == steps.end())
    FORGE_FAIL("checkpoint.load_step {}: there is no checkpoint '{}' (the folder holds {})", load_step,
               checkpoint_dir(folder, load_step),
               steps.empty() ? std::string("none") : fmt::format("steps {}", fmt::join(steps, ", ")));
  return checkpoint_dir(folder, load_step);
}

Checkpoint open_checkpoint(const std::string& dir) {
  if (!fs::is_directory(dir)) FORGE_FAIL("checkpoint directory '{}' does not exist", dir);
  const std::string file = metadata_path(dir);
  if (!fs::is_regular_file(file))
    FORGE_FAIL("checkpoint '{}' has no {} (not a forge checkpoint, or a damaged one)", dir, kCheckpointMetadataFile);
  Checkpoint ck{dir, metadata_from_json(read_text(file), file)};
  // A step-<N> directory holds step N: one that says otherwise would be resumed at the wrong
  // step and its saves would overwrite other checkpoints.
  fs::path normal = fs::path(dir).lexically_normal();
  if (!normal.has_filename()) normal = normal.parent_path();
  const std::string name = normal.filename().string();
  int64_t named_step = -1;
  if (name.starts_with("step-")) {
    auto [end, error] = std::from_chars(name.data() + 5, name.data() + name.size(), named_step);
    if (error != std::errc() || end != name.data() + name.size()) named_step = -1;
  }
  if (named_step >= 0 && named_step != ck.metadata.training.step)
    FORGE_FAIL("checkpoint '{}' is refused: its {} says step {}, its directory name says step {}", dir,
               kCheckpointMetadataFile, ck.metadata.training.step, named_step);
  check_shards(file, ck.metadata);
  if (ck.metadata.format_version == kCheckpointFormatVersion) check_pieces(file, ck.metadata);
  else check_bands(file, ck.metadata);
  check_shard_files(dir, ck.metadata);
  return ck;
}

void check_checkpoint_model(const Checkpoint& ck, const ModelConfig& model, bool same_architecture) {
  check_checkpoint_model(ck, model, parameter_specs(model), same_architecture);
}

void check_checkpoint_model(const Checkpoint& ck, const ModelConfig& model, const std::vector<ParamSpec>& specs,
                            bool same_architecture) {
  const std::string file = metadata_path(ck.dir);
  const CheckpointMetadata& md = ck.metadata;
  if (md.flux)  // NOTE [FLUX checkpoints]
    FORGE_FAIL("checkpoint '{}' holds a FLUX transformer ('{}', {} double + {} single blocks), not a language model; "
               "the configured model is {}",
               ck.dir, md.flux->name, md.flux->num_double_blocks, md.flux->num_single_blocks, describe_model(model));
  std::map<std::pair<int, std::string>, const TensorRecord*> saved;
  for (const TensorRecord& rec : md.tensors)
    if (!saved.emplace(std::make_pair(static_cast<int>(rec.state), rec.name), &rec).second)
      FORGE_FAIL("checkpoint metadata '{}' lists {} twice", file, describe(rec));

  std::vector<std::pair<const TensorRecord*, int64_t>> placed;  // record, flat offset the model gives it
  for (FlatState state : kFlatStates) {
    int64_t offset = 0;
    for (const ParamSpec& spec : specs) {
      auto it = saved.find({static_cast<int>(state), spec.name});
      if (it == saved.end())
        FORGE_FAIL("checkpoint '{}' has no tensor '{}' ({}), which the configured model has: it was saved for model "
                   "{}, the configured model is {}",
                   ck.dir, spec.name, flat_state_name(state), describe_model(md.model), describe_model(model));
      const TensorRecord& rec = *it->second;
      if (rec.shape != spec.shape)
        FORGE_FAIL("checkpoint '{}': {} has shape {}, the configured model expects {} (saved for model {}, the "
                   "configured model is {})",
                   ck.dir, describe(rec), shape_str(rec.shape), shape_str(spec.shape), describe_model(md.model),
                   describe_model(model));
      placed.emplace_back(&rec, offset);
      saved.erase(it);
      offset += shape_numel(spec.shape);
    }
  }
  if (!saved.empty())
    FORGE_FAIL("checkpoint '{}' holds {}, which the configured model does not have: it was saved for model {}, the "
               "configured model is {}",
               ck.dir, describe(*saved.begin()->second), describe_model(md.model), describe_model(model));
  for (const auto& [rec, offset] : placed)
    if (rec->flat_offset != offset)
      FORGE_FAIL("checkpoint '{}': {} is at flat offset {}, the configured model places it at {}", ck.dir,
                 describe(*rec), rec->flat_offset, offset);
  if (same_architecture) check_architecture(file, md.model, model);
}

void read_flat_range(const Checkpoint& ck, FlatState state, int64_t begin, std::span<float> out) {
  const int64_t end = begin + static_cast<int64_t>(out.size());
  FORGE_CHECK(begin >= 0 && end <= ck.metadata.flat_numel, "range [{}, {}) of {}", begin, end,
              ck.metadata.flat_numel);
  const size_t bytes = std::clamp<size_t>(out.size() * sizeof(float), size_t{1} << 20, size_t{1} << 28);
  ShardFileReader(ck, bytes).read(state, {begin, Tensor::wrap(out.data(), {static_cast<int64_t>(out.size())}, DType::F32)});
}

}  // namespace forge
