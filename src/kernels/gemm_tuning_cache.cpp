// The GEMM tuning cache's file format, directory and merge (NOTE [GEMM tuning cache]).
#include "kernels/gemm_tuning_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"

namespace forge {
namespace {

constexpr int kFormatVersion = 2;
constexpr int kFirstFormatVersion = 1;  // no fp8gemm lines
constexpr std::string_view kMagic = "forge gemm tuning ";
constexpr DType kDTypes[] = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U16, DType::U8};

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The device name as one header line (a name never holds a line break, but the file's
// structure must not depend on that).
std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return text;
}

template <typename Number>
std::optional<Number> parse_number(std::string_view text, int base = 10) {
  Number value{};
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType t : kDTypes)
    if (dtype_name(t) == name) return t;
  return std::nullopt;
}

std::optional<bool> parse_transpose(std::string_view text) {
  if (text == "N") return false;
  if (text == "T") return true;
  return std::nullopt;
}

std::optional<cpu::Fp8Format> parse_fp8_format(std::string_view name) {
  for (cpu::Fp8Format f : {cpu::Fp8Format::E4M3, cpu::Fp8Format::E5M2})
    if (cpu::fp8_format_name(f) == name) return f;
  return std::nullopt;
}

std::optional<bool> parse_fast_accumulation(std::string_view text) {
  if (text == "fast") return true;
  if (text == "full") return false;
  return std::nullopt;
}

std::optional<bool> parse_beta_zero(std::string_view text) {
  if (text == "zero") return true;
  if (text == "nonzero") return false;
  return std::nullopt;
}

std::optional<GemmAlgorithm> parse_algorithm(std::string_view hex) {
  GemmAlgorithm algorithm{};
  if (hex.size() != algorithm.size() * 16) return std::nullopt;
  for (size_t i = 0; i < algorithm.size(); ++i) {
    auto word = parse_number<uint64_t>(hex.substr(i * 16, 16), 16);
    if (!word) return std::nullopt;
    algorithm[i] = *word;
  }
  return algorithm;
}

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  while (true) {
    size_t at = text.find(separator);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return parts;
    text.remove_prefix(at + 1);
  }
}

// The input part of an entry line: "in=bf16" for a bf16 GEMM, the FP8 fields for an FP8 one.
std::string input_fields(const GemmProblem& p) {
  if (!p.fp8) return fmt::format("in={}", dtype_name(p.input_dtype));
  return fmt::format("in={},{} scale={},{} accumulate={}", cpu::fp8_format_name(p.fp8->a_format),
                     cpu::fp8_format_name(p.fp8->b_format), p.fp8->a_scale_mode, p.fp8->b_scale_mode,
                     p.fp8->fast_accumulation ? "fast" : "full");
}

std::string entry_line(const GemmProblem& p, const GemmAlgorithm& algorithm) {
  std::string line = fmt::format("{} m={} n={} k={} a={} b={} {} out={} beta={} compute={} workspace={} algo=",
                                 p.fp8 ? "fp8gemm" : "gemm", p.m, p.n, p.k, p.transpose_a ? 'T' : 'N',
                                 p.transpose_b ? 'T' : 'N', input_fields(p), dtype_name(p.out_dtype),
                                 p.beta_zero ? "zero" : "nonzero", p.compute_type, p.workspace_bytes);
  if (p.epilogue != 0) line.insert(line.size() - 5, fmt::format("epilogue={} ", p.epilogue));  // before "algo="
  if (p.ld_b != 0 || p.ld_out != 0)  // before "algo=", after any epilogue
    line.insert(line.size() - 5, fmt::format("ld={},{} ", p.ld_b, p.ld_out));
  for (uint64_t word : algorithm) line += fmt::format("{:016x}", word);
  return line + "\n";
}

// The values of a line's "name=value" tokens after its first, the names in the order
// given, or nothing when the tokens are not exactly those.
std::optional<std::vector<std::string_view>> named_values(const std::vector<std::string_view>& tokens,
                                                          std::initializer_list<std::string_view> names) {
  if (tokens.size() != 1 + names.size()) return std::nullopt;
  std::vector<std::string_view> values;
  for (std::string_view name : names) {
    std::string_view token = tokens[values.size() + 1];
    if (token.size() <= name.size() || !token.starts_with(name) || token[name.size()] != '=') return std::nullopt;
    values.push_back(token.substr(name.size() + 1));
  }
  return values;
}

// The FP8 fields of an fp8gemm line: "e4m3,e5m2", "0,0", "fast".
std::optional<GemmFp8Inputs> parse_fp8_inputs(std::string_view formats, std::string_view scale_modes,
                                              std::string_view accumulate) {
  std::vector<std::string_view> f = split(formats, ','), s = split(scale_modes, ',');
  if (f.size() != 2 || s.size() != 2) return std::nullopt;
  auto a_format = parse_fp8_format(f[0]), b_format = parse_fp8_format(f[1]);
  auto a_mode = parse_number<int32_t>(s[0]), b_mode = parse_number<int32_t>(s[1]);
  auto fast = parse_fast_accumulation(accumulate);
  if (!a_format || !b_format || !a_mode || !b_mode || *a_mode < 0 || *b_mode < 0 || !fast) return std::nullopt;
  return GemmFp8Inputs{*a_format, *b_format, *a_mode, *b_mode, *fast};
}

// One "gemm name=value ..." or (from format 2 on) "fp8gemm name=value ..." line, the
// names in the order entry_line writes them.
std::optional<std::pair<GemmProblem, GemmAlgorithm>> parse_entry(std::string_view line, int format_version) {
  std::vector<std::string_view> tokens = split(line, ' ');
  // A column-block GEMM's "ld=B,OUT" token, just before "algo=" (NOTE [Column-block GEMMs]).
  std::optional<int64_t> ld_b = 0, ld_out = 0;
  if (tokens.size() >= 2 && tokens[tokens.size() - 2].starts_with("ld=")) {
    std::vector<std::string_view> lds = split(tokens[tokens.size() - 2].substr(3), ',');
    if (lds.size() != 2) return std::nullopt;
    ld_b = parse_number<int64_t>(lds[0]), ld_out = parse_number<int64_t>(lds[1]);
    if (!ld_b || !ld_out || *ld_b < 0 || *ld_out < 0 || (*ld_b == 0 && *ld_out == 0)) return std::nullopt;
    tokens.erase(tokens.end() - 2);
  }
  // A fused GEMM's "epilogue=N" token, just before "algo=" (NOTE [GEMM epilogues]).
  std::optional<int32_t> epilogue = 0;
  if (tokens.size() >= 2 && tokens[tokens.size() - 2].starts_with("epilogue=")) {
    epilogue = parse_number<int32_t>(tokens[tokens.size() - 2].substr(9));
    if (!epilogue || *epilogue <= 0) return std::nullopt;
    tokens.erase(tokens.end() - 2);
  }
  const bool fp8 = tokens[0] == "fp8gemm" && format_version >= 2;
  if (tokens[0] != "gemm" && !fp8) return std::nullopt;
  auto values = fp8 ? named_values(tokens, {"m", "n", "k", "a", "b", "in", "scale", "accumulate", "out", "beta",
                                            "compute", "workspace", "algo"})
                    : named_values(tokens, {"m", "n", "k", "a", "b", "in", "out", "beta", "compute", "workspace",
                                            "algo"});
  if (!values) return std::nullopt;
  std::optional<GemmFp8Inputs> fp8_inputs;
  if (fp8) {
    fp8_inputs = parse_fp8_inputs((*values)[5], (*values)[6], (*values)[7]);
    if (!fp8_inputs) return std::nullopt;
    values->erase(values->begin() + 5, values->begin() + 8);  // the rest as in a gemm line, less "in"
    values->insert(values->begin() + 5, dtype_name(DType::U8));
  }
  const std::vector<std::string_view>& v = *values;
  auto m = parse_number<int64_t>(v[0]), n = parse_number<int64_t>(v[1]), k = parse_number<int64_t>(v[2]);
  auto transpose_a = parse_transpose(v[3]), transpose_b = parse_transpose(v[4]);
  auto input_dtype = parse_dtype(v[5]), out_dtype = parse_dtype(v[6]);
  auto beta_zero = parse_beta_zero(v[7]);
  auto compute_type = parse_number<int64_t>(v[8]);
  auto workspace_bytes = parse_number<uint64_t>(v[9]);
  auto algorithm = parse_algorithm(v[10]);
  if (!m || !n || !k || *m <= 0 || *n <= 0 || *k <= 0 || !transpose_a || !transpose_b || !input_dtype || !out_dtype ||
      !beta_zero || !compute_type || !workspace_bytes || !algorithm)
    return std::nullopt;
  GemmProblem problem{*m, *n, *k, *transpose_a, *transpose_b, *input_dtype, *out_dtype, *beta_zero, *compute_type,
                      *workspace_bytes, fp8_inputs, *epilogue, *ld_b, *ld_out};
  return std::pair{problem, *algorithm};
}

// A file's whole contents; `missing` when it (or its directory) does not exist, `error`
// when it cannot be read.
struct FileContents {
  std::string bytes;
  bool missing = false;
  std::string error;
};

FileContents read_whole_file(const std::string& path) {
  FileContents file;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) file.missing = true;
    else file.error = std::strerror(errno);
    return file;
  }
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) file.error = std::strerror(errno);
    if (n <= 0) break;
    file.bytes.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return file;
}

std::string describe_target(const GemmTuningTarget& t) {
  return fmt::format("{} ({} SMs), cuBLASLt {}", one_line(t.device_name), t.multiprocessors, t.cublaslt_version);
}

}  // namespace

std::string gemm_tuning_cache_dir(const std::string& setting) {
  if (setting == "off") return "";
  if (!setting.empty()) return setting;
  if (std::string forge_dir = environment("FORGE_CACHE_DIR"); !forge_dir.empty()) return forge_dir;
  // The XDG base directory spec: a relative $XDG_CACHE_HOME is invalid and ignored.
  if (std::string xdg = environment("XDG_CACHE_HOME"); !xdg.empty() && xdg.front() == '/') return xdg + "/forge";
  if (std::string home = environment("HOME"); !home.empty()) return home + "/.cache/forge";
  return "";
}

std::string gemm_tuning_file_name(const GemmTuningTarget& target, int format_version) {
  std::string slug;
  for (unsigned char c : target.device_name) {
    if (std::isalnum(c)) slug += static_cast<char>(std::tolower(c));
    else if (!slug.empty() && slug.back() != '-') slug += '-';
  }
  while (!slug.empty() && slug.back() == '-') slug.pop_back();
  if (slug.empty()) slug = "gpu";
  return fmt::format("gemm-tuning-v{}-{}-{}sm-cublaslt{}.txt", format_version, slug, target.multiprocessors,
                     target.cublaslt_version);
}

std::string serialize_gemm_choices(const GemmTuningTarget& target, const GemmChoices& choices) {
  std::string text = fmt::format("{}{}\ndevice {}\nmultiprocessors {}\ncublaslt {}\n", kMagic, kFormatVersion,
                                 one_line(target.device_name), target.multiprocessors, target.cublaslt_version);
  for (const auto& [problem, algorithm] : choices) text += entry_line(problem, algorithm);
  return text + fmt::format("checksum {:016x}\n", fnv1a64(text));
}

ParsedGemmChoices parse_gemm_choices(std::string_view contents, const GemmTuningTarget& target) {
  auto fail = [](std::string why) { return ParsedGemmChoices{{}, std::move(why)}; };
  if (contents.empty()) return fail("the file is empty");
  if (!contents.starts_with(kMagic)) return fail("not a forge GEMM tuning cache (bad magic line)");
  std::string_view version = contents.substr(kMagic.size(), contents.find('\n') - kMagic.size());
  const std::optional<int> format_version = parse_number<int>(version);
  if (!format_version || *format_version < kFirstFormatVersion || *format_version > kFormatVersion)
    return fail(fmt::format("format version '{}', this forge reads {} to {}", version, kFirstFormatVersion,
                            kFormatVersion));

  // The last line is the checksum of everything before it; a file cut anywhere lacks it.
  if (contents.back() != '\n') return fail("truncated (the last line is incomplete)");
  const size_t checksum_at = contents.rfind('\n', contents.size() - 2) + 1;
  std::string_view checksum_line = contents.substr(checksum_at, contents.size() - 1 - checksum_at);
  if (!checksum_line.starts_with("checksum ")) return fail("truncated (no checksum line at the end)");
  auto stored = parse_number<uint64_t>(checksum_line.substr(9), 16);
  const uint64_t computed = fnv1a64(contents.substr(0, checksum_at));
  if (!stored || *stored != computed)
    return fail(fmt::format("checksum mismatch (stored {}, computed {:016x}): the file is corrupt",
                            checksum_line.substr(9), computed));

  std::vector<std::string_view> lines = split(contents.substr(0, checksum_at - 1), '\n');
  if (lines.size() < 4) return fail("the header is incomplete");
  GemmTuningTarget written;
  if (!lines[1].starts_with("device ") || !lines[2].starts_with("multiprocessors ") ||
      !lines[3].starts_with("cublaslt "))
    return fail("the header lacks its device, multiprocessors or cublaslt line");
  written.device_name = std::string(lines[1].substr(7));
  auto multiprocessors = parse_number<int64_t>(lines[2].substr(16));
  auto cublaslt_version = parse_number<uint64_t>(lines[3].substr(9));
  if (!multiprocessors || !cublaslt_version)
    return fail("the header's multiprocessors or cublaslt line is not a number");
  written.multiprocessors = *multiprocessors;
  written.cublaslt_version = *cublaslt_version;
  if (written.device_name != one_line(target.device_name) || written.multiprocessors != target.multiprocessors ||
      written.cublaslt_version != target.cublaslt_version)
    return fail(fmt::format("written for {}, not for this {}", describe_target(written), describe_target(target)));

  ParsedGemmChoices parsed;
  for (size_t i = 4; i < lines.size(); ++i) {
    auto entry = parse_entry(lines[i], *format_version);
    if (!entry) return fail(fmt::format("line {} is not a GEMM choice of format {}", i + 1, *format_version));
    parsed.choices[entry->first] = entry->second;
  }
  return parsed;
}

GemmTuningCache::GemmTuningCache(std::string directory, GemmTuningTarget target)
    : directory_(std::move(directory)),
      path_((std::filesystem::path(directory_) / gemm_tuning_file_name(target)).string()),
      target_(std::move(target)) {
  FileContents file = read_whole_file(path_);
  if (file.missing) {
    read_first_format_file();
    return;
  }
  if (!file.error.empty()) {
    log_warn("GEMM tuning cache {} cannot be read ({}): this run measures every shape and leaves the file alone",
             path_, file.error);
    saving_ = false;
    return;
  }
  ParsedGemmChoices parsed = parse_gemm_choices(file.bytes, target_);
  if (!parsed.error.empty()) {
    log_warn("GEMM tuning cache {} is ignored: {}; shapes are timed again and the file rewritten", path_,
             parsed.error);
    return;
  }
  choices_ = std::move(parsed.choices);
  loaded_ = choices_.size();
}

void GemmTuningCache::read_first_format_file() {
  const std::string path =
      (std::filesystem::path(directory_) / gemm_tuning_file_name(target_, kFirstFormatVersion)).string();
  FileContents file = read_whole_file(path);
  if (file.missing) return;
  ParsedGemmChoices parsed =
      file.error.empty() ? parse_gemm_choices(file.bytes, target_) : ParsedGemmChoices{{}, file.error};
  if (!parsed.error.empty()) {
    log_warn("GEMM tuning cache {} (format {}) is not taken over into {}: {}", path, kFirstFormatVersion, path_,
             parsed.error);
    return;
  }
  choices_ = std::move(parsed.choices);
  loaded_ = choices_.size();
}

std::optional<GemmAlgorithm> GemmTuningCache::find(const GemmProblem& problem) const {
  auto it = choices_.find(problem);
  if (it == choices_.end()) return std::nullopt;
  return it->second;
}

void GemmTuningCache::add(const GemmProblem& problem, const GemmAlgorithm& algorithm) {
  choices_[problem] = algorithm;
  if (saving_) save();
}

void GemmTuningCache::save() {
  // AtomicFile names its temporary by host and process id: two saves of one process must not interleave.
  static std::mutex one_save_at_a_time;
  std::lock_guard lock(one_save_at_a_time);
  try {
    std::error_code error;
    std::filesystem::create_directories(directory_, error);
    if (error) FORGE_FAIL("cannot create directory '{}': {}", directory_, error.message());
    // Another process's choices stay, ours win where both have one (a choice of ours for a
    // shape on disk was measured because the one on disk was rejected).
    GemmChoices merged;
    FileContents file = read_whole_file(path_);
    if (file.error.empty() && !file.missing) {
      ParsedGemmChoices on_disk = parse_gemm_choices(file.bytes, target_);
      if (on_disk.error.empty()) merged = std::move(on_disk.choices);
    }
    for (const auto& [p, algorithm] : choices_) merged[p] = algorithm;
    write_file_atomic(path_, serialize_gemm_choices(target_, merged), DurableOptions{.sync = false});
    choices_ = std::move(merged);
  } catch (const Error& e) {
    saving_ = false;
    log_warn("GEMM tuning cache {} cannot be saved ({}); this run's choices are kept in memory only", path_,
             e.what());
  }
}

std::string describe_gemm_tuning(const GemmTuningStats& stats) {
  if (stats.cache_file.empty())
    return fmt::format("GEMM tuning: {} shapes timed, not kept on disk (training.gemm_tuning_cache is off or no "
                       "cache directory is set)",
                       stats.shapes_tuned);
  std::string line =
      fmt::format("GEMM tuning cache {}: {} choices loaded, {} shapes taken from it, {} timed and added",
                  stats.cache_file, stats.choices_loaded, stats.shapes_from_cache, stats.shapes_tuned);
  if (stats.cached_rejected > 0)
    line += fmt::format(" ({} cached choices rejected by cuBLASLt and timed again)", stats.cached_rejected);
  return line;
}

}  // namespace forge
