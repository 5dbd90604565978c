#include "ckpt/checkpoint_metadata.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/checked_math.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

using nlohmann::json;

// 2^56 elements or bytes (64 PiB): far beyond any checkpoint, and 8 times it still fits in
// int64_t. NOTE [Model sizes are checked before use] in model/config_rules.cpp.
constexpr int64_t kMaxCheckpointSize = int64_t{1} << 56;
// More tensor-parallel ranks than any model has heads.
constexpr int64_t kMaxTensorParallelDegree = int64_t{1} << 16;

json model_to_json(const ModelConfig& m) {
  const RopeScaling& s = m.rope_scaling;
  return json{{"name", m.name},
              {"vocab_size", m.vocab_size},
              {"hidden_size", m.hidden_size},
              {"num_layers", m.num_layers},
              {"num_heads", m.num_heads},
              {"num_kv_heads", m.num_kv_heads},
              {"head_dim", m.head_dim},
              {"ffn_hidden_size", m.ffn_hidden_size},
              {"norm_eps", m.norm_eps},
              {"rope_theta", m.rope_theta},
              {"rope_scaling",
               {{"enabled", s.enabled},
                {"factor", s.factor},
                {"low_freq_factor", s.low_freq_factor},
                {"high_freq_factor", s.high_freq_factor},
                {"original_max_position", s.original_max_position},
                {"type", s.type},
                {"beta_fast", s.beta_fast},
                {"beta_slow", s.beta_slow},
                {"mscale", s.mscale},
                {"mscale_all_dim", s.mscale_all_dim}}},
              {"max_seq_len", m.max_seq_len},
              {"sliding_window", m.sliding_window},
              {"tie_word_embeddings", m.tie_word_embeddings},
              {"num_experts", m.num_experts},
              {"num_experts_per_tok", m.num_experts_per_tok},
              {"moe_ffn_hidden_size", m.moe_ffn_hidden_size},
              {"num_shared_experts", m.num_shared_experts},
              {"first_dense_layers", m.first_dense_layers},
              {"router_score_function", m.router_score_function},
              {"router_normalize_topk", m.router_normalize_topk},
              {"router_scaling_factor", m.router_scaling_factor},
              {"router_num_groups", m.router_num_groups},
              {"router_topk_groups", m.router_topk_groups},
              {"router_bias_update_rate", m.router_bias_update_rate},
              {"router_aux_loss_type", m.router_aux_loss_type},
              {"router_z_loss_coef", m.router_z_loss_coef},
              {"moe_capacity_factor", m.moe_capacity_factor},
              {"moe_token_drop_policy", m.moe_token_drop_policy},
              {"moe_pad_to_capacity", m.moe_pad_to_capacity},
              {"q_lora_rank", m.q_lora_rank},
              {"kv_lora_rank", m.kv_lora_rank},
              {"qk_nope_head_dim", m.qk_nope_head_dim},
              {"qk_rope_head_dim", m.qk_rope_head_dim},
              {"v_head_dim", m.v_head_dim},
              {"init_std", m.init_std}};
}

// Reads the keys of one JSON object, naming the file and the key's dotted path on error.
class ObjectReader {
 public:
  ObjectReader(const json& object, const std::string& file, std::string path)
      : object_(object), file_(file), path_(std::move(path)) {
    if (!object_.is_object()) fail_type("an object");
  }

  int64_t integer(const char* key) const {
    const json& v = at(key);
    if (!v.is_number_integer()) fail_key(key, "an integer", v);
    return v.get<int64_t>();
  }
  // A count or offset of elements or bytes: bounded so that the sums and small multiples
  // the loader forms from them (ckpt/checkpoint_load.cpp) cannot overflow.
  int64_t size(const char* key) const {
    const json& v = at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxCheckpointSize)
      fail_key(key, "an integer in [0, 2^56]", v);
    return v.get<int64_t>();
  }
  uint64_t unsigned_integer(const char* key) const {
    const json& v = at(key);
    if (!v.is_number_unsigned()) fail_key(key, "a non-negative integer", v);
    return v.get<uint64_t>();
  }
  double number(const char* key) const {
    const json& v = at(key);
    if (!v.is_number()) fail_key(key, "a number", v);
    return v.get<double>();
  }
  bool boolean(const char* key) const {
    const json& v = at(key);
    if (!v.is_boolean()) fail_key(key, "true or false", v);
    return v.get<bool>();
  }
  std::string string(const char* key) const {
    const json& v = at(key);
    if (!v.is_string()) fail_key(key, "a string", v);
    return v.get<std::string>();
  }
  const json& array(const char* key) const {
    const json& v = at(key);
    if (!v.is_array()) fail_key(key, "an array", v);
    return v;
  }
  bool has(const char* key) const { return object_.contains(key); }
  ObjectReader object(const char* key) const { return ObjectReader(at(key), file_, child(key)); }
  std::string child(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

 private:
  const json& at(const char* key) const {
    auto it = object_.find(key);
    if (it == object_.end()) FORGE_FAIL("checkpoint metadata '{}' lacks the key '{}'", file_, child(key));
    return *it;
  }
  [[noreturn]] void fail_key(const char* key, const char* expected, const json& got) const {
    FORGE_FAIL("checkpoint metadata '{}': '{}' must be {}, got {}", file_, child(key), expected, describe_json(got));
  }
  [[noreturn]] void fail_type(const char* expected) const {
    FORGE_FAIL("checkpoint metadata '{}': '{}' must be {}, got {}", file_, path_.empty() ? "(top level)" : path_,
               expected, describe_json(object_));
  }

  const json& object_;
  const std::string& file_;
  std::string path_;
};

ModelConfig model_from_json(const ObjectReader& r) {
  ModelConfig m;
  m.name = r.string("name");
  m.vocab_size = r.integer("vocab_size");
  m.hidden_size = r.integer("hidden_size");
  m.num_layers = r.integer("num_layers");
  m.num_heads = r.integer("num_heads");
  m.num_kv_heads = r.integer("num_kv_heads");
  m.head_dim = r.integer("head_dim");
  m.ffn_hidden_size = r.integer("ffn_hidden_size");
  m.norm_eps = r.number("norm_eps");
  m.rope_theta = r.number("rope_theta");
  ObjectReader s = r.object("rope_scaling");
  m.rope_scaling.enabled = s.boolean("enabled");
  m.rope_scaling.factor = s.number("factor");
  m.rope_scaling.low_freq_factor = s.number("low_freq_factor");
  m.rope_scaling.high_freq_factor = s.number("high_freq_factor");
  m.rope_scaling.original_max_position = s.integer("original_max_position");
  // Checkpoints from before YaRN have Llama 3.1's scaling only.
  if (s.has("type")) {
    m.rope_scaling.type = s.string("type");
    m.rope_scaling.beta_fast = s.number("beta_fast");
    m.rope_scaling.beta_slow = s.number("beta_slow");
    m.rope_scaling.mscale = s.number("mscale");
    m.rope_scaling.mscale_all_dim = s.number("mscale_all_dim");
  }
  m.max_seq_len = r.integer("max_seq_len");
  m.sliding_window = r.integer("sliding_window");
  m.tie_word_embeddings = r.boolean("tie_word_embeddings");
  m.init_std = r.number("init_std");
  // Checkpoints from before MoE models have neither key: dense.
  if (r.has("num_experts")) m.num_experts = r.integer("num_experts");
  if (r.has("num_experts_per_tok")) m.num_experts_per_tok = r.integer("num_experts_per_tok");
  // Checkpoints from before DeepSeek's models have none of these: Mixtral's routing, GQA.
  if (r.has("moe_ffn_hidden_size")) {
    m.moe_ffn_hidden_size = r.integer("moe_ffn_hidden_size");
    m.num_shared_experts = r.integer("num_shared_experts");
    m.first_dense_layers = r.integer("first_dense_layers");
    m.router_score_function = r.string("router_score_function");
    m.router_normalize_topk = r.boolean("router_normalize_topk");
    m.router_scaling_factor = r.number("router_scaling_factor");
    m.router_num_groups = r.integer("router_num_groups");
    m.router_topk_groups = r.integer("router_topk_groups");
    m.router_bias_update_rate = r.number("router_bias_update_rate");
    m.q_lora_rank = r.integer("q_lora_rank");
    m.kv_lora_rank = r.integer("kv_lora_rank");
    m.qk_nope_head_dim = r.integer("qk_nope_head_dim");
    m.qk_rope_head_dim = r.integer("qk_rope_head_dim");
    m.v_head_dim = r.integer("v_head_dim");
  }
  // Checkpoints from before the per-layer and sequence-wise losses and the z-loss: the
  // pooled loss, no z-loss.
  if (r.has("router_aux_loss_type")) m.router_aux_loss_type = r.string("router_aux_loss_type");
  if (r.has("router_z_loss_coef")) m.router_z_loss_coef = r.number("router_z_loss_coef");
  // From before token dropping: dropless.
  if (r.has("moe_capacity_factor")) m.moe_capacity_factor = r.number("moe_capacity_factor");
  if (r.has("moe_token_drop_policy")) m.moe_token_drop_policy = r.string("moe_token_drop_policy");
  if (r.has("moe_pad_to_capacity")) m.moe_pad_to_capacity = r.boolean("moe_pad_to_capacity");
  return m;
}

// "flux_model" (NOTE [FLUX checkpoints] in train/flux_checkpoint.h): every FluxConfig field.
json flux_to_json(const FluxConfig& f) {
  return json{{"name", f.name},
              {"in_channels", f.in_channels},
              {"out_channels", f.out_channels},
              {"num_heads", f.num_heads},
              {"head_dim", f.head_dim},
              {"num_double_blocks", f.num_double_blocks},
              {"num_single_blocks", f.num_single_blocks},
              {"mlp_ratio", f.mlp_ratio},
              {"context_dim", f.context_dim},
              {"pooled_dim", f.pooled_dim},
              {"guidance_embeds", f.guidance_embeds},
              {"axes_dim", f.axes_dim},
              {"rope_theta", f.rope_theta},
              {"timestep_dim", f.timestep_dim},
              {"norm_eps", f.norm_eps}};
}

// Read and validated (FluxConfig::validate names the file and the knob).
FluxConfig flux_from_json(const ObjectReader& r, const std::string& file) {
  FluxConfig f;
  f.name = r.string("name");
  f.in_channels = r.integer("in_channels");
  f.out_channels = r.integer("out_channels");
  f.num_heads = r.integer("num_heads");
  f.head_dim = r.integer("head_dim");
  f.num_double_blocks = r.integer("num_double_blocks");
  f.num_single_blocks = r.integer("num_single_blocks");
  f.mlp_ratio = r.integer("mlp_ratio");
  f.context_dim = r.integer("context_dim");
  f.pooled_dim = r.integer("pooled_dim");
  f.guidance_embeds = r.boolean("guidance_embeds");
  const json& axes = r.array("axes_dim");
  f.axes_dim.clear();
  for (size_t i = 0; i < axes.size(); ++i) {
    if (!axes[i].is_number_integer())
      FORGE_FAIL("checkpoint metadata '{}': '{}[{}]' must be an integer, got {}", file, r.child("axes_dim"), i,
                 describe_json(axes[i]));
    f.axes_dim.push_back(axes[i].get<int64_t>());
  }
  f.rope_theta = r.number("rope_theta");
  f.timestep_dim = r.integer("timestep_dim");
  f.norm_eps = static_cast<float>(r.number("norm_eps"));
  f.validate(fmt::format("checkpoint metadata '{}' (flux_model)", file));
  return f;
}

// "fp8_delayed" (NOTE [FP8 step end] in model/fp8_projections.h): the numbers are what the
// histories and scales can hold (amaxes finite and >= 0, scales finite and > 0, within
// fp32), and the two arrays agree on the number of projections; that the model has as many
// is checked when the run restores them.
Fp8DelayedState fp8_delayed_from_json(const ObjectReader& r, const std::string& file) {
  Fp8DelayedState f;
  f.active = r.boolean("active");
  // NOTE [FP8 routed experts switch]: absent before the switch, when the experts were in FP8.
  f.routed_experts = r.has("routed_experts") ? r.boolean("routed_experts") : true;
  // NOTE [FP8 filter]: absent before the filter, when every block projection was in FP8.
  if (r.has("filter_fqns")) {
    const json& filters = r.array("filter_fqns");
    for (size_t i = 0; i < filters.size(); ++i) {
      if (!filters[i].is_string() || filters[i].get<std::string>().empty())
        FORGE_FAIL("checkpoint metadata '{}': '{}[{}]' must be a non-empty string, got {}", file,
                   r.child("filter_fqns"), i, describe_json(filters[i]));
      f.filter_fqns.push_back(filters[i].get<std::string>());
    }
  }
  f.history_length = r.integer("history_length");
  if (f.history_length < 1 || f.history_length > (1 << 16))
    FORGE_FAIL("checkpoint metadata '{}': '{}' must be in [1, 65536], got {}", file, r.child("history_length"),
               f.history_length);
  auto read = [&](const char* key, bool positive, std::vector<float>& out) {
    const json& values = r.array(key);
    out.reserve(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      const json& v = values[i];
      const double d = v.is_number() ? v.get<double>() : -1.0;
      if (!v.is_number() || !std::isfinite(d) || d < 0 || (positive && d <= 0) || d > 3.4e38)
        FORGE_FAIL("checkpoint metadata '{}': '{}[{}]' must be a finite {} fp32 number, got {}", file, r.child(key),
                   i, positive ? "positive" : "non-negative", describe_json(v));
      out.push_back(static_cast<float>(d));
    }
  };
  read("scales", true, f.scales);
  read("histories", false, f.histories);
  if (f.scales.size() % 3 != 0 || f.histories.size() != f.scales.size() * static_cast<size_t>(f.history_length))
    FORGE_FAIL("checkpoint metadata '{}': '{}' holds {} scales and {} history values; expected 3 scales per "
               "projection and history_length ({}) values per scale",
               file, r.child("scales"), f.scales.size(), f.histories.size(), f.history_length);
  return f;
}

FlatState state_from_name(const std::string& name, const std::string& file, const std::string& key) {
  for (FlatState s : kFlatStates)
    if (name == flat_state_name(s)) return s;
  FORGE_FAIL("checkpoint metadata '{}': '{}' must be param, exp_avg or exp_avg_sq, got '{}'", file, key, name);
}

}  // namespace

const char* flat_state_name(FlatState state) {
  switch (state) {
    case FlatState::Param: return "param";
    case FlatState::ExpAvg: return "exp_avg";
    case FlatState::ExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

std::string metadata_to_json(const CheckpointMetadata& md) {
  const TrainingState& t = md.training;
  const OptimizerConfig& o = t.optimizer;
  const bool format1 = md.format_version == kCheckpointFormatVersion;
  json shards = json::array();
  const size_t files = format1 ? md.shards.size() : md.file_numel.size();
  for (size_t r = 0; r < files; ++r) {
    json shard = {{"rank", r}, {"file", fmt::format("rank-{}.bin", r)}};
    if (format1) {
      shard["flat_begin"] = md.shards[r].begin;
      shard["flat_end"] = md.shards[r].end;
    } else {
      shard["numel"] = md.file_numel[r];
    }
    shards.push_back(shard);
  }
  json tensors = json::array();
  for (const TensorRecord& rec : md.tensors) {
    json pieces = json::array();
    for (const TensorPiece& p : rec.pieces) {
      json piece = {{"rank", p.rank},
                    {"flat_begin", p.flat_begin},
                    {"byte_offset", p.byte_offset},
                    {"byte_length", p.byte_length},
                    {"crc32", p.crc32}};
      if (p.band_width > 0) {
        piece["band_begin"] = p.band_begin;
        piece["band_width"] = p.band_width;
      }
      pieces.push_back(piece);
    }
    tensors.push_back({{"name", rec.name},
                       {"state", flat_state_name(rec.state)},
                       {"dtype", "fp32"},
                       {"shape", rec.shape},
                       {"flat_offset", rec.flat_offset},
                       {"pieces", pieces}});
  }
  json j = {{"format", "forge-checkpoint"},
            {"format_version", md.format_version},
            {"step", t.step},
            {"experiment_config", md.experiment_yaml},
            {"data", {{"position", t.data_position}}},
            {"rng", {{"seed", t.seed}}},
            {"lr_scheduler", {{"step", t.step}, {"total_steps", t.lr_schedule_steps}}},
            {"optimizer",
             {{"name", o.name},
              {"lr", o.lr},
              {"beta1", o.beta1},
              {"beta2", o.beta2},
              {"eps", o.eps},
              {"weight_decay", o.weight_decay},
              {"step", t.optimizer_step}}},
            {"loss_spike", {{"recent_losses", t.recent_losses}}},
            {"world_size", files},
            {"flat_numel", md.flat_numel},
            {"shards", shards},
            {"tensors", tensors}};
  if (md.flux) j["flux_model"] = flux_to_json(*md.flux);  // NOTE [FLUX checkpoints]
  else j["model"] = model_to_json(md.model);
  if (!format1) j["tensor_parallel_degree"] = md.tensor_parallel;
  if (t.fp8_delayed) {
    const Fp8DelayedState& f = *t.fp8_delayed;
    j["fp8_delayed"] = {{"active", f.active},
                        {"routed_experts", f.routed_experts},
                        {"filter_fqns", f.filter_fqns},
                        {"history_length", f.history_length},
                        {"scales", f.scales},
                        {"histories", f.histories}};
  }
  return j.dump(1) + "\n";
}

CheckpointMetadata metadata_from_json(const std::string& text, const std::string& file) {
  const json j = parse_json(text, fmt::format("checkpoint metadata '{}'", file));
  ObjectReader top(j, file, "");
  if (top.string("format") != "forge-checkpoint")
    FORGE_FAIL("'{}' is not forge checkpoint metadata ('format' is not 'forge-checkpoint')", file);
  CheckpointMetadata md;
  const int64_t format_version = top.integer("format_version");
  if (format_version != kCheckpointFormatVersion && format_version != kTensorParallelCheckpointFormatVersion)
    FORGE_FAIL("checkpoint metadata '{}' has format_version {}; this forge reads format_version {} and {}", file,
               format_version, kCheckpointFormatVersion, kTensorParallelCheckpointFormatVersion);
  md.format_version = static_cast<int>(format_version);
  const bool format1 = format_version == kCheckpointFormatVersion;
  TrainingState& t = md.training;
  t.step = top.integer("step");
  // NOTE [FLUX checkpoints]: a FLUX transformer's checkpoint has "flux_model" instead of "model".
  if (top.has("flux_model") && !top.has("model")) md.flux = flux_from_json(top.object("flux_model"), file);
  else md.model = model_from_json(top.object("model"));
  md.experiment_yaml = top.string("experiment_config");
  t.data_position = top.object("data").integer("position");
  t.seed = top.object("rng").unsigned_integer("seed");
  t.lr_schedule_steps = top.object("lr_scheduler").integer("total_steps");
  ObjectReader o = top.object("optimizer");
  t.optimizer.name = o.string("name");
  t.optimizer.lr = o.number("lr");
  t.optimizer.beta1 = o.number("beta1");
  t.optimizer.beta2 = o.number("beta2");
  t.optimizer.eps = o.number("eps");
  t.optimizer.weight_decay = o.number("weight_decay");
  t.optimizer_step = o.integer("step");
  if (top.has("loss_spike")) {  // absent before the loss-spike detector: an empty window
    const ObjectReader spike = top.object("loss_spike");
    const json& losses = spike.array("recent_losses");
    for (size_t i = 0; i < losses.size(); ++i) {
      if (!losses[i].is_number() || !std::isfinite(losses[i].get<double>()) || losses[i].get<double>() < 0)
        FORGE_FAIL("checkpoint metadata '{}': 'loss_spike.recent_losses[{}]' must be a finite non-negative number, "
                   "got {}",
                   file, i, describe_json(losses[i]));
      t.recent_losses.push_back(losses[i].get<double>());
    }
  }
  if (top.has("fp8_delayed")) t.fp8_delayed = fp8_delayed_from_json(top.object("fp8_delayed"), file);
  md.flat_numel = top.size("flat_numel");

  if (!format1) {
    const int64_t degree = top.integer("tensor_parallel_degree");
    if (degree < 1 || degree > kMaxTensorParallelDegree)
      FORGE_FAIL("checkpoint metadata '{}': 'tensor_parallel_degree' must be in [1, {}], got {}", file,
                 kMaxTensorParallelDegree, degree);
    md.tensor_parallel = static_cast<int>(degree);
  }
  const json& shards = top.array("shards");
  for (size_t r = 0; r < shards.size(); ++r) {
    ObjectReader s(shards[r], file, fmt::format("shards[{}]", r));
    if (s.integer("rank") != static_cast<int64_t>(r))
      FORGE_FAIL("checkpoint metadata '{}': shards[{}] has rank {}, expected {}", file, r, s.integer("rank"), r);
    if (s.string("file") != fmt::format("rank-{}.bin", r))
      FORGE_FAIL("checkpoint metadata '{}': shards[{}] names file '{}', expected 'rank-{}.bin'", file, r,
                 s.string("file"), r);
    if (format1) {
      md.shards.push_back({s.size("flat_begin"), s.size("flat_end")});
      md.file_numel.push_back(md.shards.back().size());
    } else {
      md.file_numel.push_back(s.size("numel"));
    }
  }
  if (top.integer("world_size") != static_cast<int64_t>(md.file_numel.size()))
    FORGE_FAIL("checkpoint metadata '{}': world_size is {} but {} shards are listed", file, top.integer("world_size"),
               md.file_numel.size());

  const json& tensors = top.array("tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    ObjectReader r(tensors[i], file, fmt::format("tensors[{}]", i));
    TensorRecord rec;
    rec.name = r.string("name");
    rec.state = state_from_name(r.string("state"), file, r.child("state"));
    if (r.string("dtype") != "fp32")
      FORGE_FAIL("checkpoint metadata '{}': tensor '{}' ({}) has dtype '{}', expected fp32", file, rec.name,
                 flat_state_name(rec.state), r.string("dtype"));
    std::optional<int64_t> numel = 1;
    for (const json& d : r.array("shape")) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        FORGE_FAIL("checkpoint metadata '{}': tensor '{}' has a bad shape: dimension {} is not a non-negative integer",
                   file, rec.name, describe_json(d));
      rec.shape.push_back(d.get<int64_t>());
      numel = numel ? checked_mul(*numel, d.get<int64_t>()) : std::nullopt;
    }
    if (!numel || *numel > kMaxCheckpointSize)
      FORGE_FAIL("checkpoint metadata '{}': tensor '{}' has shape {}, more than 2^56 elements", file, rec.name,
                 shape_str(rec.shape));
    rec.flat_offset = r.size("flat_offset");
    const json& pieces = r.array("pieces");
    for (size_t k = 0; k < pieces.size(); ++k) {
      ObjectReader p(pieces[k], file, fmt::format("tensors[{}].pieces[{}]", i, k));
      const int64_t rank = p.integer("rank");
      if (rank < 0 || rank >= static_cast<int64_t>(md.file_numel.size()))
        FORGE_FAIL("checkpoint metadata '{}': tensors[{}].pieces[{}].rank is {}, but the world size is {}", file, i, k,
                   rank, md.file_numel.size());
      const uint64_t crc32 = p.unsigned_integer("crc32");
      if (crc32 > UINT32_MAX)
        FORGE_FAIL("checkpoint metadata '{}': tensors[{}].pieces[{}].crc32 is {}, more than 32 bits", file, i, k, crc32);
      TensorPiece piece{static_cast<int>(rank), p.size("flat_begin"), p.size("byte_offset"), p.size("byte_length"),
                        static_cast<uint32_t>(crc32)};
      // Format 2's band pieces (NOTE [Column bands]); whether they fit the tensor is open_checkpoint's check.
      if (!format1 && (p.has("band_begin") || p.has("band_width"))) {
        piece.band_begin = p.size("band_begin");
        piece.band_width = p.size("band_width");
        if (piece.band_width == 0)
          FORGE_FAIL("checkpoint metadata '{}': tensors[{}].pieces[{}].band_width must be positive", file, i, k);
      }
      rec.pieces.push_back(piece);
    }
    md.tensors.push_back(std::move(rec));
  }
  return md;
}

}  // namespace forge
