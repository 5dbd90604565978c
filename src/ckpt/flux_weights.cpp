// FLUX weights in diffusers' and BFL's layouts; see flux_weights.h.
#include "ckpt/flux_weights.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt/flux_weights_export.h"
#include "ckpt/hf_weight_files.h"
#include "core/json_input.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDiffusersStem = kFluxDiffusersStem;

// Rows [param_row, param_row + rows) of parameter `param` are rows [file_row, file_row +
// rows) of the file's tensor `name`.
struct FilePiece {
  std::string name;
  int64_t file_row = 0, rows = 0;
  size_t param = 0;
  int64_t param_row = 0;
};

bool starts(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// `name` with `from` (a prefix) replaced by `to`.
std::string renamed(const std::string& name, const std::string& from, const std::string& to) {
  return to + name.substr(from.size());
}

// BFL's pieces of one forge parameter (NOTE [FLUX weight files]).
void bfl_pieces(const FluxConfig& c, const ParamSpec& spec, size_t param, std::vector<FilePiece>& out) {
  const std::string& n = spec.name;
  const int64_t rows = spec.shape[0], d = c.hidden();
  auto whole = [&](const std::string& name) { out.push_back({name, 0, rows, param, 0}); };
  static const std::vector<std::pair<std::string, std::string>> top = {
      {"x_embedder.", "img_in."},
      {"context_embedder.", "txt_in."},
      {"time_text_embed.timestep_embedder.linear_1.", "time_in.in_layer."},
      {"time_text_embed.timestep_embedder.linear_2.", "time_in.out_layer."},
      {"time_text_embed.text_embedder.linear_1.", "vector_in.in_layer."},
      {"time_text_embed.text_embedder.linear_2.", "vector_in.out_layer."},
      {"time_text_embed.guidance_embedder.linear_1.", "guidance_in.in_layer."},
      {"time_text_embed.guidance_embedder.linear_2.", "guidance_in.out_layer."},
      {"proj_out.", "final_layer.linear."}};
  for (const auto& [from, to] : top)
    if (starts(n, from)) return whole(renamed(n, from, to));
  if (starts(n, "norm_out.linear.")) {  // diffusers' (scale, shift) are BFL's (shift, scale)
    const std::string name = renamed(n, "norm_out.linear.", "final_layer.adaLN_modulation.1.");
    out.push_back({name, d, d, param, 0});
    out.push_back({name, 0, d, param, d});
    return;
  }
  const size_t dot1 = n.find('.'), dot2 = n.find('.', dot1 + 1);
  const std::string block = n.substr(dot1 + 1, dot2 - dot1 - 1), rest = n.substr(dot2 + 1);
  if (starts(n, "transformer_blocks.")) {
    static const std::vector<std::pair<std::string, std::string>> parts = {
        {"norm1.linear.", "img_mod.lin."},
        {"norm1_context.linear.", "txt_mod.lin."},
        {"attn.to_qkv.", "img_attn.qkv."},
        {"attn.to_added_qkv.", "txt_attn.qkv."},
        {"attn.to_out.0.", "img_attn.proj."},
        {"attn.to_add_out.", "txt_attn.proj."},
        {"ff.net.0.proj.", "img_mlp.0."},
        {"ff.net.2.", "img_mlp.2."},
        {"ff_context.net.0.proj.", "txt_mlp.0."},
        {"ff_context.net.2.", "txt_mlp.2."},
        {"attn.norm_q.weight", "img_attn.norm.query_norm.scale"},
        {"attn.norm_k.weight", "img_attn.norm.key_norm.scale"},
        {"attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"},
        {"attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"}};
    for (const auto& [from, to] : parts)
      if (starts(rest, from)) return whole("double_blocks." + block + "." + renamed(rest, from, to));
  } else if (starts(n, "single_transformer_blocks.")) {
    const std::string p = "single_blocks." + block + ".";
    if (starts(rest, "attn.to_qkv.")) return out.push_back({p + renamed(rest, "attn.to_qkv.", "linear1."), 0, rows, param, 0});
    if (starts(rest, "proj_mlp."))
      return out.push_back({p + renamed(rest, "proj_mlp.", "linear1."), 3 * d, rows, param, 0});
    static const std::vector<std::pair<std::string, std::string>> parts = {
        {"norm.linear.", "modulation.lin."},
        {"proj_out.", "linear2."},
        {"attn.norm_q.weight", "norm.query_norm.scale"},
        {"attn.norm_k.weight", "norm.key_norm.scale"}};
    for (const auto& [from, to] : parts)
      if (starts(rest, from)) return whole(p + renamed(rest, from, to));
  }
  FORGE_FAIL("no BFL name for FLUX parameter '{}'", n);
}

std::vector<FilePiece> file_pieces(const FluxConfig& c, const std::vector<ParamSpec>& specs, FluxWeightLayout layout) {
  std::vector<FilePiece> pieces;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (layout == FluxWeightLayout::Bfl) {
      bfl_pieces(c, specs[i], i, pieces);
      continue;
    }
    int64_t row = 0;
    for (const HfTensor& t : specs[i].hf_tensors) {
      pieces.push_back({t.name, 0, t.rows, i, row});
      row += t.rows;
    }
  }
  return pieces;
}

// Every file tensor's shape: its rows (the pieces' extent) by the parameter's row shape.
std::map<std::string, Shape> file_shapes(const std::vector<FilePiece>& pieces, const std::vector<ParamSpec>& specs) {
  std::map<std::string, Shape> shapes;
  for (const FilePiece& p : pieces) {
    Shape shape = specs[p.param].shape;
    shape[0] = std::max(shapes.contains(p.name) ? shapes[p.name][0] : 0, p.file_row + p.rows);
    shapes[p.name] = shape;
  }
  return shapes;
}

// What config.json of a diffusers folder says, against the model.
void check_diffusers_config(const std::string& path, const FluxConfig& c) {
  const nlohmann::json j = read_json_file(path, "the FLUX transformer's config");
  auto expect = [&](const char* key, const nlohmann::json& want) {
    if (!j.contains(key)) return;
    if (j[key] != want)
      FORGE_FAIL("{}: \"{}\" is {}, the model ({}) has {}", path, key, j[key].dump(), c.name, want.dump());
  };
  expect("num_layers", c.num_double_blocks);
  expect("num_single_layers", c.num_single_blocks);
  expect("num_attention_heads", c.num_heads);
  expect("attention_head_dim", c.head_dim);
  expect("in_channels", c.in_channels);
  expect("joint_attention_dim", c.context_dim);
  expect("pooled_projection_dim", c.pooled_dim);
  expect("guidance_embeds", c.guidance_embeds);
  expect("axes_dims_rope", c.axes_dim);
  expect("patch_size", 1);
}

// A diffusers folder: `path` itself, or its transformer/ subfolder (a whole pipeline's).
std::string diffusers_folder(const std::string& path) {
  const fs::path sub = fs::path(path) / "transformer";
  const bool own = fs::exists(fs::path(path) / (std::string(kDiffusersStem) + ".safetensors")) ||
                   fs::exists(fs::path(path) / (std::string(kDiffusersStem) + ".safetensors.index.json"));
  return !own && fs::is_directory(sub) ? sub.string() : path;
}

}  // namespace

FluxWeightLayout flux_weight_layout_of(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) return FluxWeightLayout::Diffusers;
  FORGE_CHECK(fs::is_regular_file(path, error),
              "FLUX weights '{}' not found: expected a diffusers model folder or BFL's .safetensors file", path);
  return FluxWeightLayout::Bfl;
}

void read_flux_weights(const std::string& path, const FluxConfig& c, const std::vector<ParamSpec>& specs,
                       const std::function<void(size_t, std::span<const float>)>& take) {
  const FluxWeightLayout layout = flux_weight_layout_of(path);
  std::unique_ptr<HfWeightFiles> folder;
  std::unique_ptr<SafetensorsFile> single;
  std::string where = path;
  if (layout == FluxWeightLayout::Diffusers) {
    where = diffusers_folder(path);
    if (fs::exists(fs::path(where) / "config.json")) check_diffusers_config((fs::path(where) / "config.json").string(), c);
    folder = std::make_unique<HfWeightFiles>(where, kDiffusersStem);
  } else {
    single = std::make_unique<SafetensorsFile>(path);
  }
  auto find = [&](const std::string& name) -> LocatedTensor {
    if (folder) return folder->find(name);
    const SafetensorsEntry* e = single->find(name);
    return {e ? single.get() : nullptr, e};
  };
  const std::vector<FilePiece> pieces = file_pieces(c, specs, layout);
  const std::map<std::string, Shape> shapes = file_shapes(pieces, specs);
  for (const auto& [name, shape] : shapes) {
    const LocatedTensor t = find(name);
    if (!t.file)
      FORGE_FAIL("{}: no tensor '{}', which the {} model needs ({} layout)", where, name, c.name,
                 layout == FluxWeightLayout::Bfl ? "BFL" : "diffusers");
    if (t.entry->shape != shape)
      FORGE_FAIL("{}: '{}' is {}, the {} model needs {}", t.file->path(), name, shape_str(t.entry->shape), c.name,
                 shape_str(shape));
  }
  std::vector<LocatedTensor> everything;
  if (folder) everything = folder->all();
  else
    for (const SafetensorsEntry& e : single->entries()) everything.push_back({single.get(), &e});
  for (const LocatedTensor& t : everything)
    if (!shapes.contains(t.entry->name))
      FORGE_FAIL("{}: tensor '{}' has no place in the {} model ({} double and {} single blocks): another "
                 "architecture's weights?",
                 t.file->path(), t.entry->name, c.name, c.num_double_blocks, c.num_single_blocks);
  // One host buffer of the largest parameter; a parameter's pieces are consecutive in
  // `pieces` (file_pieces walks the parameters in order).
  int64_t largest = 0;
  for (const ParamSpec& spec : specs) largest = std::max(largest, shape_numel(spec.shape));
  std::vector<float> buffer(static_cast<size_t>(largest));
  for (size_t at = 0; at < pieces.size();) {
    const size_t param = pieces[at].param;
    const int64_t numel = shape_numel(specs[param].shape);
    const int64_t row = numel / specs[param].shape[0];
    int64_t rows = 0;
    for (; at < pieces.size() && pieces[at].param == param; ++at) {
      const FilePiece& p = pieces[at];
      rows += p.rows;
      const LocatedTensor t = find(p.name);
      t.file->read_as_float(*t.entry, buffer.data() + p.param_row * row, p.file_row * row, p.rows * row);
    }
    FORGE_CHECK(rows == specs[param].shape[0], "FLUX parameter '{}': the file's pieces give {} of its {} rows",
                specs[param].name, rows, specs[param].shape[0]);
    take(param, std::span<const float>(buffer.data(), static_cast<size_t>(numel)));
  }
}

void load_flux_weights(const std::string& path, FluxParameters& params) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "load_flux_weights: the parameters must be fp32 on the CPU");
  read_flux_weights(path, params.config(), params.specs(), [&](size_t param, std::span<const float> values) {
    std::copy(values.begin(), values.end(), params.tensors()[param].data<float>());
  });
}

void save_flux_weights(const std::string& path, const FluxParameters& params, FluxWeightLayout layout,
                       SafetensorsDType stored, uint64_t max_shard_bytes) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "save_flux_weights: the parameters must be fp32 on the CPU");
  const FluxConfig& c = params.config();
  if (layout == FluxWeightLayout::Diffusers) {
    // The files every FSDP rank writes its pieces of (NOTE [FLUX export in pieces]), here
    // written whole by one process.
    FluxWeightsExport out(path, c, stored, "", max_shard_bytes);
    HfExportWriter writer(out.plan(), out.temporary_path());
    for (size_t i = 0; i < params.specs().size(); ++i) {
      const Tensor& t = params.tensors()[i];
      writer.write(i, std::span<const float>(t.data<float>(), static_cast<size_t>(t.numel())));
    }
    writer.close();
    FORGE_CHECK(writer.written() == out.plan().numel(), "FLUX diffusers export: {} of the model's {} elements written",
                writer.written(), out.plan().numel());
    return out.commit();
  }
  const std::vector<FilePiece> pieces = file_pieces(c, params.specs(), layout);
  const std::map<std::string, Shape> shapes = file_shapes(pieces, params.specs());
  // Each file tensor assembled from its pieces (most are one parameter's rows as they are).
  std::map<std::string, std::vector<float>> data;
  for (const auto& [name, shape] : shapes) data[name].resize(static_cast<size_t>(shape_numel(shape)));
  for (const FilePiece& p : pieces) {
    const Tensor& src = params.tensors()[p.param];
    const int64_t row = src.numel() / src.dim(0);
    std::copy_n(src.data<float>() + p.param_row * row, p.rows * row, data[p.name].data() + p.file_row * row);
  }
  std::vector<SafetensorsTensorRef> refs;
  for (const auto& [name, shape] : shapes) refs.push_back({name, shape, data[name].data()});
  write_safetensors(path, refs, stored, {{"format", "pt"}});
}

}  // namespace forge
