// FLUX VAE weights from diffusers' and BFL's layouts; see flux_vae_weights.h.
#include "ckpt/flux_vae_weights.h"

#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "ckpt/hf_weight_files.h"
#include "ckpt/safetensors.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDiffusersStem = "diffusion_pytorch_model";

bool has_weights(const fs::path& dir) {
  return fs::exists(dir / (std::string(kDiffusersStem) + ".safetensors")) ||
         fs::exists(dir / (std::string(kDiffusersStem) + ".safetensors.index.json"));
}

// The folder holding a diffusers VAE: `path`, or its vae/ subfolder (a whole pipeline's).
std::string vae_folder(const std::string& path) {
  const fs::path sub = fs::path(path) / "vae";
  return !has_weights(path) && !fs::exists(fs::path(path) / "config.json") && fs::is_directory(sub) ? sub.string()
                                                                                                    : path;
}

std::vector<std::string> split(const std::string& name) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', begin)) {
    parts.push_back(name.substr(begin, dot - begin));
    begin = dot + 1;
  }
  parts.push_back(name.substr(begin));
  return parts;
}

std::string joined(const std::vector<std::string>& parts, size_t from) {
  std::string out;
  for (size_t i = from; i < parts.size(); ++i) out += "." + parts[i];
  return out;
}

// A diffusers attention projection's BFL name part.
std::string bfl_attention_part(const std::vector<std::string>& p, size_t at) {
  static const std::map<std::string, std::string> parts = {
      {"group_norm", "norm"}, {"to_q", "q"}, {"to_k", "k"}, {"to_v", "v"}};
  if (p[at] == "to_out" && at + 1 < p.size() && p[at + 1] == "0") return ".proj_out" + joined(p, at + 2);
  auto it = parts.find(p[at]);
  return it == parts.end() ? "" : "." + it->second + joined(p, at + 1);
}

bool is_bfl_attention_matrix(const std::string& bfl_name) {
  for (const char* part : {".attn_1.q.weight", ".attn_1.k.weight", ".attn_1.v.weight", ".attn_1.proj_out.weight"})
    if (bfl_name.ends_with(part)) return true;
  return false;
}

// One file tensor: where its rows go, and the shape the file must give it.
struct FilePiece {
  std::string name;
  Shape file_shape;
  size_t param = 0;
  int64_t param_row = 0, rows = 0;
};

std::vector<FilePiece> file_pieces(const FluxVaeConfig& config, const std::vector<FluxVaeParamSpec>& specs,
                                   FluxVaeWeightLayout layout) {
  std::vector<FilePiece> pieces;
  const int64_t levels = config.levels();
  for (size_t i = 0; i < specs.size(); ++i) {
    const FluxVaeParamSpec& spec = specs[i];
    int64_t row = 0;
    for (const FluxVaeFileTensor& t : spec.files) {
      FilePiece piece{t.name, spec.file_shape(t.rows), i, row, t.rows};
      if (layout == FluxVaeWeightLayout::Bfl) {
        piece.name = flux_vae_bfl_name(t.name, levels);
        if (is_bfl_attention_matrix(piece.name)) piece.file_shape = {t.rows, spec.shape[1], 1, 1};
      }
      pieces.push_back(std::move(piece));
      row += t.rows;
    }
  }
  return pieces;
}

// Rows of a file tensor, fp32 in the file's layout, into the parameter's rows.
void place(const float* values, const FilePiece& piece, const FluxVaeParamSpec& spec, const Tensor& param) {
  float* dst = param.data<float>();
  const int64_t row = param.numel() / param.dim(0);
  if (!spec.conv) {
    std::copy_n(values, piece.rows * row, dst + piece.param_row * row);
    return;
  }
  const int64_t k = spec.shape[1], in = spec.shape[3];  // [O, I, K, K] -> [O, K, K, I]
  for (int64_t o = 0; o < piece.rows; ++o)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t y = 0; y < k; ++y)
        for (int64_t x = 0; x < k; ++x)
          dst[(((piece.param_row + o) * k + y) * k + x) * in + i] = values[((o * in + i) * k + y) * k + x];
}

}  // namespace

std::string flux_vae_bfl_name(const std::string& name, int64_t levels) {
  const std::vector<std::string> p = split(name);
  if (p.size() < 3 || (p[0] != "encoder" && p[0] != "decoder")) return name;  // conv_in, quant_conv, ...
  const std::string& part = p[1];
  if (part == "conv_norm_out") return p[0] + ".norm_out" + joined(p, 2);
  if ((part == "down_blocks" || part == "up_blocks") && p.size() >= 5) {
    int64_t block = std::stoll(p[2]);
    if (part == "up_blocks") block = levels - 1 - block;
    const std::string prefix = p[0] + (part == "down_blocks" ? ".down." : ".up.") + std::to_string(block);
    if (p[3] == "resnets" && p.size() >= 7) {
      const std::string rest = p[5] == "conv_shortcut" ? ".nin_shortcut" + joined(p, 6) : joined(p, 5);
      return prefix + ".block." + p[4] + rest;
    }
    if (p[3] == "downsamplers") return prefix + ".downsample" + joined(p, 5);
    if (p[3] == "upsamplers") return prefix + ".upsample" + joined(p, 5);
  }
  if (part == "mid_block" && p.size() >= 5) {
    if (p[2] == "resnets") return p[0] + ".mid.block_" + std::to_string(std::stoll(p[3]) + 1) + joined(p, 4);
    if (p[2] == "attentions") {
      const std::string rest = bfl_attention_part(p, 4);
      if (!rest.empty()) return p[0] + ".mid.attn_1" + rest;
    }
  }
  return name;
}

std::vector<std::pair<std::string, Shape>> flux_vae_file_tensors(const FluxVaeConfig& config,
                                                                 FluxVaeWeightLayout layout) {
  std::vector<std::pair<std::string, Shape>> tensors;
  for (const FilePiece& piece : file_pieces(config, flux_vae_parameter_specs(config), layout))
    tensors.emplace_back(piece.name, piece.file_shape);
  return tensors;
}

FluxVaeWeightLayout flux_vae_weight_layout_of(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) return FluxVaeWeightLayout::Diffusers;
  FORGE_CHECK(fs::is_regular_file(path, error),
              "FLUX VAE weights '{}' not found: expected a diffusers VAE folder or BFL's ae.safetensors file", path);
  return FluxVaeWeightLayout::Bfl;
}

FluxVaeConfig flux_vae_config_at(const std::string& path) {
  if (flux_vae_weight_layout_of(path) == FluxVaeWeightLayout::Bfl) return flux_vae_preset("flux1-vae");
  const std::string folder = vae_folder(path);
  const fs::path config = fs::path(folder) / "config.json";
  FORGE_CHECK(fs::exists(config),
              "{}: no config.json (a diffusers VAE folder holds its AutoencoderKL config beside the weights)", folder);
  return read_flux_vae_config(config.string());
}

void load_flux_vae_weights(const std::string& path, FluxVaeParameters& params) {
  FORGE_CHECK(params.device() == Device::CPU && params.dtype() == DType::F32,
              "load_flux_vae_weights: the parameters must be fp32 on the CPU");
  const FluxVaeConfig& c = params.config();
  const FluxVaeWeightLayout layout = flux_vae_weight_layout_of(path);
  std::unique_ptr<HfWeightFiles> folder;
  std::unique_ptr<SafetensorsFile> single;
  std::string where = path;
  if (layout == FluxVaeWeightLayout::Diffusers) {
    where = vae_folder(path);
    const FluxVaeConfig declared = flux_vae_config_at(path);
    FORGE_CHECK(declared.same_model(c),
                "{}/config.json describes another VAE than the one being loaded ({}): a different architecture or "
                "latent scaling",
                where, c.name);
    folder = std::make_unique<HfWeightFiles>(where, kDiffusersStem);
  } else {
    single = std::make_unique<SafetensorsFile>(path);
  }
  const char* layout_name = layout == FluxVaeWeightLayout::Bfl ? "BFL" : "diffusers";
  auto find = [&](const std::string& name) -> LocatedTensor {
    if (folder) return folder->find(name);
    const SafetensorsEntry* e = single->find(name);
    return {e ? single.get() : nullptr, e};
  };
  const std::vector<FilePiece> pieces = file_pieces(c, params.specs(), layout);
  std::map<std::string, const FilePiece*> expected;
  for (const FilePiece& piece : pieces) {
    expected[piece.name] = &piece;
    const LocatedTensor t = find(piece.name);
    if (!t.file)
      FORGE_FAIL("{}: no tensor '{}', which the VAE {} needs ({} layout)", where, piece.name, c.name, layout_name);
    if (t.entry->shape != piece.file_shape)
      FORGE_FAIL("{}: '{}' is {}, the VAE {} needs {}", t.file->path(), piece.name, shape_str(t.entry->shape), c.name,
                 shape_str(piece.file_shape));
  }
  std::vector<LocatedTensor> everything;
  if (folder)
    everything = folder->all();
  else
    for (const SafetensorsEntry& e : single->entries()) everything.push_back({single.get(), &e});
  for (const LocatedTensor& t : everything)
    if (!expected.contains(t.entry->name))
      FORGE_FAIL("{}: tensor '{}' has no place in the VAE {} ({} layout): another model's weights, or a VAE with "
                 "another config?",
                 t.file->path(), t.entry->name, c.name, layout_name);
  std::vector<float> values;
  for (const FilePiece& piece : pieces) {
    const LocatedTensor t = find(piece.name);
    values.resize(static_cast<size_t>(t.entry->numel()));
    t.file->read_as_float(*t.entry, values.data());
    place(values.data(), piece, params.specs()[piece.param], params.tensors()[piece.param]);
  }
}

std::unique_ptr<FluxVaeParameters> load_flux_vae(const std::string& path, const FluxVaeConfig& config, Device device) {
  auto host = std::make_unique<FluxVaeParameters>(config);
  load_flux_vae_weights(path, *host);
  if (device == Device::CPU) return host;
  auto params = std::make_unique<FluxVaeParameters>(config, device, DType::BF16);
  params->assign_from(*host);
  return params;
}

}  // namespace forge
