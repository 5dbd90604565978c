#include "data/image_caption_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "core/error.h"
#include "core/input_file.h"
#include "core/parallel.h"
#include "data/utf8.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr size_t kProblemsShown = 20;
constexpr size_t kSkippedShown = 5;

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// Extensions of image files in the folder layouts and of image members in webdataset
// samples (NOTE [Image-caption datasets]), with their dot, in any case.
bool is_image_extension(const std::string& extension) {
  static const std::set<std::string> extensions = {".jpg", ".jpeg", ".jpe",  ".jfif", ".png",  ".webp", ".gif", ".bmp",
                                                   ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl",  ".jp2"};
  return extensions.count(lowercase(extension)) > 0;
}

bool has_image_extension(const fs::path& path) { return is_image_extension(path.extension().string()); }

// Every problem found while opening a dataset, reported together at the end.
class Problems {
 public:
  void add(std::string problem) {
    if (list_.size() < kProblemsShown) list_.push_back(std::move(problem));
    ++count_;
  }
  // Another list's problems after these.
  void add_all(const Problems& other) {
    for (const auto& problem : other.list_) add(problem);
    count_ += other.count_ - other.list_.size();
  }
  void raise_if_any(const std::string& path, ImageDatasetLayout layout) const {
    if (count_ == 0) return;
    std::string message = fmt::format("{}: {} problem{} in the {} image dataset:", path, count_, count_ == 1 ? "" : "s",
                                      image_dataset_layout_name(layout));
    for (const auto& problem : list_) message += "\n  " + problem;
    if (count_ > list_.size()) message += fmt::format("\n  ... and {} more", count_ - list_.size());
    throw Error(message);
  }

 private:
  std::vector<std::string> list_;
  size_t count_ = 0;
};

// The regular files under `root`, recursively, as paths relative to it in byte order;
// names starting with '.' (files and whole folders) are skipped.
std::vector<std::string> list_files(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    FORGE_FAIL("{}: {}", root, ec ? "cannot open the dataset folder: " + ec.message() : std::string("not a folder"));
  std::vector<std::string> files;
  fs::recursive_directory_iterator it(root, ec);
  for (const fs::recursive_directory_iterator end; !ec && it != end; it.increment(ec)) {
    const fs::path& path = it->path();
    std::error_code kind_ec;
    if (path.filename().string().starts_with(".")) {
      if (it->is_directory(kind_ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(kind_ec)) files.push_back(path.lexically_relative(root).generic_string());
  }
  if (ec) FORGE_FAIL("{}: cannot list the dataset folder: {}", root, ec.message());
  std::sort(files.begin(), files.end());
  return files;
}

// "" when `text` is valid UTF-8, else where it is not.
std::string utf8_problem(std::string_view text) {
  for (size_t pos = 0; pos < text.size(); pos += utf8::unit_length(text, pos)) {
    if (utf8::code_point_at(text, pos) < 0) return fmt::format("invalid UTF-8 at byte offset {}", pos);
  }
  return "";
}

bool is_blank(std::string_view text) { return text.find_first_not_of(" \t\r\n\v\f") == std::string_view::npos; }

// A caption file's text: without a UTF-8 byte order mark and surrounding whitespace.
std::string trimmed_caption(std::string_view text) {
  if (text.starts_with("\xef\xbb\xbf")) text.remove_prefix(3);
  const size_t begin = text.find_first_not_of(" \t\r\n\v\f");
  if (begin == std::string_view::npos) return "";
  const size_t end = text.find_last_not_of(" \t\r\n\v\f");
  return std::string(text.substr(begin, end - begin + 1));
}

class Builder {
 public:
  Builder(const ImageDatasetOptions& options, std::vector<ImageCaptionEntry>& entries, ImageDatasetSummary& summary)
      : options_(options), entries_(entries), summary_(summary) {}

  // An image with caption `caption` (from `caption_source`, for messages), if both are good.
  void add(std::string image_path, std::string caption, const std::string& where, const std::string& caption_source) {
    add(ImageCaptionEntry{std::move(image_path), std::move(caption), {}}, where, caption_source, nullptr);
  }

  // The same for an entry whose image is in `archive` (webdataset) or, without one, a file.
  void add(ImageCaptionEntry entry, const std::string& where, const std::string& caption_source,
           const TarArchive* archive) {
    if (const std::string problem = utf8_problem(entry.caption); !problem.empty()) {
      problems.add(fmt::format("{}: caption: {}", caption_source, problem));
      return;
    }
    if (is_blank(entry.caption) && !options_.allow_empty_captions) {
      problems.add(fmt::format("{}: empty caption (allow_empty_captions accepts it)", caption_source));
      return;
    }
    try {
      entry.info = archive != nullptr
                       ? probe_image(archive->bytes(entry.archive_offset, entry.archive_size), entry.image_path)
                       : read_image_info(entry.image_path);
    } catch (const Error& e) {
      problems.add(where.empty() ? e.what() : where + ": " + e.what());
      return;
    }
    entries_.push_back(std::move(entry));
  }

  // An image without a caption: a problem, or skipped and counted.
  void missing(const std::string& image, const std::string& problem) {
    if (options_.missing_captions == MissingCaptions::Error) {
      problems.add(problem + " (MissingCaptions::Skip skips such images)");
      return;
    }
    if (summary_.skipped_examples.size() < kSkippedShown) summary_.skipped_examples.push_back(image);
    ++summary_.skipped_without_caption;
  }

  Problems problems;

 private:
  const ImageDatasetOptions& options_;
  std::vector<ImageCaptionEntry>& entries_;
  ImageDatasetSummary& summary_;
};

std::string join(const std::string& root, const std::string& relative) { return (fs::path(root) / relative).string(); }

void read_caption_files(const std::string& root, const ImageDatasetOptions& options, Builder& builder,
                        ImageDatasetSummary& summary) {
  const std::vector<std::string> files = list_files(root);
  std::set<std::string> captions, used;
  for (const auto& file : files)
    if (fs::path(file).extension() == options.caption_extension) captions.insert(file);
  for (const auto& file : files) {
    const fs::path path(file);
    if (!has_image_extension(path)) continue;
    const std::string caption_file = (path.parent_path() / path.stem()).generic_string() + options.caption_extension;
    if (!captions.count(caption_file)) {
      builder.missing(file, fmt::format("{}: no caption file {}", join(root, file), join(root, caption_file)));
      continue;
    }
    used.insert(caption_file);
    std::string text;
    try {
      text = read_regular_file(join(root, caption_file), "the caption file");
    } catch (const Error& e) {
      builder.problems.add(e.what());
      continue;
    }
    builder.add(join(root, file), trimmed_caption(text), "", join(root, caption_file));
  }
  summary.captions_without_image = captions.size() - used.size();
}

void read_filename_captions(const std::string& root, Builder& builder) {
  for (const auto& file : list_files(root)) {
    const fs::path path(file);
    if (!has_image_extension(path)) continue;
    std::string caption = path.stem().string();
    std::replace(caption.begin(), caption.end(), '_', ' ');
    builder.add(join(root, file), std::move(caption), "", join(root, file) + " (its name, the caption)");
  }
}

// The string under the first of `keys` the object has; nullptr when it has none (or null).
const nlohmann::json* field(const nlohmann::json& object, std::initializer_list<const char*> keys, std::string& key,
                            std::string& problem) {
  const nlohmann::json* found = nullptr;
  for (const char* k : keys) {
    const auto it = object.find(k);
    if (it == object.end() || it->is_null()) continue;
    if (found != nullptr) {
      problem = fmt::format("both \"{}\" and \"{}\"", key, k);
      return nullptr;
    }
    if (!it->is_string()) {
      problem = fmt::format("\"{}\" is {}, expected a string", k, it->type_name());
      return nullptr;
    }
    found = &*it;
    key = k;
  }
  return found;
}

void read_jsonl(const std::string& manifest, Builder& builder) {
  const std::string text = read_regular_file(manifest, "the manifest");
  const fs::path folder = fs::path(manifest).parent_path();
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    const std::string_view line = std::string_view(text).substr(begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (is_blank(line)) continue;
    const std::string where = fmt::format("{}:{}", manifest, line_number);
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      builder.problems.add(fmt::format("{}: not valid JSON: {}", where, e.what()));
      continue;
    }
    if (!object.is_object()) {
      builder.problems.add(
          fmt::format("{}: {}, expected an object with \"image\" and \"text\"", where, object.type_name()));
      continue;
    }
    std::string image_key, text_key, problem;
    const nlohmann::json* image = field(object, {"image", "file_name"}, image_key, problem);
    if (!problem.empty() || image == nullptr || image->get_ref<const std::string&>().empty()) {
      builder.problems.add(
          fmt::format("{}: {}", where, problem.empty() ? "no image path (\"image\" or \"file_name\")" : problem));
      continue;
    }
    const std::string& relative = image->get_ref<const std::string&>();
    const std::string image_path = fs::path(relative).is_absolute() ? relative : (folder / relative).string();
    const nlohmann::json* caption = field(object, {"text", "caption"}, text_key, problem);
    if (!problem.empty()) {
      builder.problems.add(fmt::format("{}: {}", where, problem));
    } else if (caption == nullptr) {
      builder.missing(image_path, fmt::format("{}: no caption (\"text\" or \"caption\") for {}", where, relative));
    } else {
      builder.add(image_path, caption->get<std::string>(), where, fmt::format("{} \"{}\"", where, text_key));
    }
  }
}

// The names `pattern` expands to: each brace group a numeric range {A..B} (zero-padded to
// the wider bound when a bound has leading zeros) or a comma list {a,b}.
std::vector<std::string> expand_braces(const std::string& pattern) {
  constexpr size_t kMaxNames = 1000000;
  std::vector<std::string> names = {""};
  const auto bad = [&](const std::string& why) {
    FORGE_FAIL(
        "{}: {}; expected a shard pattern such as "
        "cc12m-train-{{0000..2175}}.tar (numeric ranges {{A..B}} "
        "or lists {{a,b}})",
        pattern, why);
  };
  for (size_t at = 0; at < pattern.size();) {
    const size_t open = pattern.find('{', at);
    const std::string literal = pattern.substr(at, open == std::string::npos ? std::string::npos : open - at);
    if (literal.find('}') != std::string::npos) bad("a '}' without its '{'");
    for (auto& name : names) name += literal;
    if (open == std::string::npos) break;
    const size_t close = pattern.find('}', open);
    if (close == std::string::npos) bad(fmt::format("the '{{' at character {} has no '}}'", open));
    const std::string body = pattern.substr(open + 1, close - open - 1);
    if (body.find('{') != std::string::npos) bad("nested braces");
    std::vector<std::string> choices;
    if (const size_t dots = body.find(".."); dots != std::string::npos) {
      const std::string first = body.substr(0, dots), last = body.substr(dots + 2);
      const auto decimal = [](const std::string& s) {
        return !s.empty() && s.size() <= 18 &&
               std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
      };
      if (!decimal(first) || !decimal(last)) bad(fmt::format("the range {{{}}} is not of two decimal numbers", body));
      const uint64_t lo = std::stoull(first), hi = std::stoull(last);
      if (lo > hi) bad(fmt::format("the range {{{}}} runs backwards", body));
      if (hi - lo >= kMaxNames) bad(fmt::format("the range {{{}}} names more than {} shards", body, kMaxNames));
      const bool padded = (first.size() > 1 && first[0] == '0') || (last.size() > 1 && last[0] == '0');
      const size_t width = padded ? std::max(first.size(), last.size()) : 0;
      for (uint64_t v = lo; v <= hi; ++v) choices.push_back(fmt::format("{:0{}}", v, width));
    } else if (body.find(',') != std::string::npos) {
      for (size_t begin = 0;;) {
        const size_t comma = body.find(',', begin);
        choices.push_back(body.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
    } else {
      bad(
          fmt::format("the brace group {{{}}} is neither a range {{A..B}} nor "
                      "a list {{a,b}}",
                      body));
    }
    if (names.size() * choices.size() > kMaxNames) bad(fmt::format("it names more than {} shards", kMaxNames));
    std::vector<std::string> expanded;
    expanded.reserve(names.size() * choices.size());
    for (const auto& name : names)
      for (const auto& choice : choices) expanded.push_back(name + choice);
    names = std::move(expanded);
    at = close + 1;
  }
  return names;
}

// webdataset's split of a member path into key and extension (NOTE [Image-caption
// datasets]); false for a member it ignores (no '.' in its last component, or a name that
// starts with one).
bool split_key(const std::string& path, std::string& key, std::string& extension) {
  const size_t slash = path.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = path.find('.', base);
  if (dot == std::string::npos || dot == base) return false;
  key = path.substr(0, dot);
  extension = lowercase(path.substr(dot + 1));
  return true;
}

// One shard's samples (NOTE [Image-caption datasets]) into `builder`, entries numbering the
// shard `index`; the mapped shard, or null when it is not a valid tar file.
std::shared_ptr<const TarArchive> read_shard(const std::string& shard, int64_t index, Builder& builder) {
  std::shared_ptr<const TarArchive> archive;
  try {
    archive = std::make_shared<const TarArchive>(shard);
  } catch (const Error& e) {
    builder.problems.add(e.what());
    return nullptr;
  }
  struct Sample {
    std::string key;
    uint64_t header_offset = 0;
    std::vector<std::pair<std::string, const TarMember*>> members;  // (extension, member)
  };
  std::vector<Sample> samples;
  for (const TarMember& member : archive->members()) {
    std::string key, extension;
    if (!split_key(member.path, key, extension)) continue;
    if (samples.empty() || samples.back().key != key) samples.push_back({key, member.header_offset, {}});
    samples.back().members.emplace_back(std::move(extension), &member);
  }
  for (const Sample& sample : samples) {
    const std::string where =
        fmt::format("{}: sample '{}' (tar header at byte offset {})", shard, sample.key, sample.header_offset);
    std::vector<const TarMember*> images;
    const TarMember* caption = nullptr;
    std::set<std::string> seen;
    std::string repeated;
    for (const auto& [extension, member] : sample.members) {
      if (!seen.insert(extension).second && repeated.empty()) repeated = extension;
      if (is_image_extension("." + extension)) images.push_back(member);
      if (extension == "txt") caption = member;
    }
    if (!repeated.empty()) {
      builder.problems.add(fmt::format("{}: two '{}' members, expected one of each extension", where, repeated));
      continue;
    }
    if (images.size() != 1) {
      std::vector<std::string> names;
      for (const auto& [extension, member] : sample.members) names.push_back(member->path);
      builder.problems.add(
          fmt::format("{}: {} image members, expected one (a jpg, jpeg, png or webp member); its members: {}", where,
                      images.empty() ? "no" : std::to_string(images.size()), fmt::join(names, ", ")));
      continue;
    }
    const TarMember& image = *images.front();
    const std::string image_path = shard + ":" + image.path;
    if (caption == nullptr) {
      builder.missing(image_path, fmt::format("{}: no caption ({}.txt member)", where, sample.key));
      continue;
    }
    ImageCaptionEntry entry{image_path, trimmed_caption(archive->bytes(*caption)), {}};
    entry.archive = index;
    entry.archive_offset = image.offset;
    entry.archive_size = image.size;
    builder.add(std::move(entry), "", shard + ":" + caption->path, archive.get());
  }
  return archive;
}

// The shards are read in parallel (CC12M has 2,176 of them, 10 million images whose headers
// are probed), each into a builder of its own, then joined in the order given.
void read_webdataset(const std::string& spec, const ImageDatasetOptions& options, Builder& builder,
                     std::vector<ImageCaptionEntry>& entries, ImageDatasetSummary& summary,
                     std::vector<std::shared_ptr<const TarArchive>>& archives) {
  const std::vector<std::string> shards = list_webdataset_shards(spec);
  summary.shards = shards.size();
  archives.resize(shards.size());
  std::vector<std::vector<ImageCaptionEntry>> shard_entries(shards.size());
  std::vector<ImageDatasetSummary> shard_summaries(shards.size());
  std::vector<Problems> shard_problems(shards.size());
  parallel_for(static_cast<int64_t>(shards.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Builder shard_builder(options, shard_entries[i], shard_summaries[i]);
      archives[i] = read_shard(shards[i], i, shard_builder);
      shard_problems[i] = std::move(shard_builder.problems);
    }
  });
  for (size_t i = 0; i < shards.size(); ++i) {
    builder.problems.add_all(shard_problems[i]);
    for (auto& entry : shard_entries[i]) entries.push_back(std::move(entry));
    summary.skipped_without_caption += shard_summaries[i].skipped_without_caption;
    for (auto& example : shard_summaries[i].skipped_examples)
      if (summary.skipped_examples.size() < kSkippedShown) summary.skipped_examples.push_back(std::move(example));
  }
}

}  // namespace

bool is_shard_pattern(std::string_view path) {
  const size_t open = path.find('{');
  return open != std::string_view::npos && path.find('}', open) != std::string_view::npos;
}

std::vector<std::string> list_webdataset_shards(const std::string& spec) {
  constexpr size_t kMissingShown = 10;
  std::error_code ec;
  if (is_shard_pattern(spec)) {
    const std::vector<std::string> shards = expand_braces(spec);
    std::vector<std::string> missing;
    for (const auto& shard : shards)
      if (!fs::is_regular_file(shard, ec)) missing.push_back(shard);
    if (!missing.empty()) {
      const size_t shown = std::min(missing.size(), kMissingShown);
      FORGE_FAIL("{}: {} of the {} tar shards it names {} missing: {}{}", spec, missing.size(), shards.size(),
                 missing.size() == 1 ? "is" : "are",
                 fmt::join(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
                 missing.size() > shown ? fmt::format(", ... and {} more", missing.size() - shown) : "");
    }
    return shards;
  }
  if (fs::is_directory(spec, ec)) {
    std::vector<std::string> shards;
    for (fs::directory_iterator it(spec, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      std::error_code kind_ec;
      if (!name.starts_with(".") && name.ends_with(".tar") && it->is_regular_file(kind_ec))
        shards.push_back(it->path().string());
    }
    if (ec) FORGE_FAIL("{}: cannot list the shard folder: {}", spec, ec.message());
    if (shards.empty()) FORGE_FAIL("{}: no .tar shards directly in this folder (the webdataset layout)", spec);
    std::sort(shards.begin(), shards.end());
    return shards;
  }
  if (fs::is_regular_file(spec, ec)) return {spec};
  FORGE_FAIL("{}: no such tar file, folder of tar shards or shard pattern", spec);
}

std::string_view image_dataset_layout_name(ImageDatasetLayout layout) {
  switch (layout) {
    case ImageDatasetLayout::CaptionFiles: return "caption-files";
    case ImageDatasetLayout::FilenameCaptions: return "filename-captions";
    case ImageDatasetLayout::Jsonl: return "jsonl";
    case ImageDatasetLayout::Webdataset: return "webdataset";
  }
  return "?";
}

ImageDatasetLayout parse_image_dataset_layout(std::string_view name, std::string_view what) {
  for (auto layout : {ImageDatasetLayout::CaptionFiles, ImageDatasetLayout::FilenameCaptions, ImageDatasetLayout::Jsonl,
                      ImageDatasetLayout::Webdataset})
    if (name == image_dataset_layout_name(layout)) return layout;
  FORGE_FAIL(
      "{}: unknown image dataset layout '{}': expected caption-files (images with same-name .txt captions), "
      "filename-captions (captions in the file names, as bghira/pseudo-camera-10k), jsonl (a manifest of "
      "{{\"image\": ..., \"text\": ...}} lines) or webdataset (tar shards of KEY.jpg and KEY.txt members, as "
      "pixparse/cc12m-wds)",
      what, name);
}

ImageCaptionDataset::ImageCaptionDataset(std::string path, ImageDatasetLayout layout, ImageDatasetOptions options)
    : path_(std::move(path)), layout_(layout) {
  if (layout == ImageDatasetLayout::CaptionFiles &&
      (!options.caption_extension.starts_with(".") || options.caption_extension.size() < 2 ||
       has_image_extension(fs::path("x" + options.caption_extension))))
    FORGE_FAIL("caption extension '{}': expected a dot and a name that is not an image's, such as .txt",
               options.caption_extension);
  Builder builder(options, entries_, summary_);
  switch (layout) {
    case ImageDatasetLayout::CaptionFiles: read_caption_files(path_, options, builder, summary_); break;
    case ImageDatasetLayout::FilenameCaptions: read_filename_captions(path_, builder); break;
    case ImageDatasetLayout::Jsonl: read_jsonl(path_, builder); break;
    case ImageDatasetLayout::Webdataset: read_webdataset(path_, options, builder, entries_, summary_, archives_); break;
  }
  builder.problems.raise_if_any(path_, layout);
  if (entries_.empty())
    FORGE_FAIL("{}: no images with captions in the {} image dataset{}", path_, image_dataset_layout_name(layout),
               summary_.skipped_without_caption
                   ? fmt::format(" ({} images without a caption were skipped)", summary_.skipped_without_caption)
                   : std::string());
  summary_.entries = entries_.size();
  for (const auto& entry : entries_) {
    switch (entry.info.format) {
      case ImageFormat::Jpeg: ++summary_.jpeg; break;
      case ImageFormat::Png: ++summary_.png; break;
      case ImageFormat::Webp: ++summary_.webp; break;
    }
  }
}

std::string ImageCaptionDataset::describe() const {
  std::vector<std::string> formats;
  for (auto [count, name] : {std::pair{summary_.jpeg, "JPEG"}, {summary_.png, "PNG"}, {summary_.webp, "WebP"}})
    if (count > 0) formats.push_back(fmt::format("{} {}", count, name));
  const std::string shards =
      summary_.shards > 0 ? fmt::format(", {} shard{}", summary_.shards, summary_.shards == 1 ? "" : "s") : "";
  std::string text =
      fmt::format("{}: {} image{} with captions ({}{}: {})", path_, summary_.entries, summary_.entries == 1 ? "" : "s",
                  image_dataset_layout_name(layout_), shards, fmt::join(formats, ", "));
  if (summary_.skipped_without_caption > 0)
    text += fmt::format("; {} skipped without a caption ({}{})", summary_.skipped_without_caption,
                        fmt::join(summary_.skipped_examples, ", "),
                        summary_.skipped_without_caption > summary_.skipped_examples.size() ? ", ..." : "");
  if (summary_.captions_without_image > 0)
    text += fmt::format("; {} caption file{} without an image", summary_.captions_without_image,
                        summary_.captions_without_image == 1 ? "" : "s");
  return text;
}

void ImageCaptionDataset::verify() const {
  std::vector<std::string> failures(entries_.size());
  parallel_for(static_cast<int64_t>(entries_.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      try {
        read(static_cast<size_t>(i));
      } catch (const Error& e) {
        failures[i] = e.what();
      }
    }
  });
  Problems problems;
  for (auto& failure : failures)
    if (!failure.empty()) problems.add(std::move(failure));
  problems.raise_if_any(path_, layout_);
}

RgbImage ImageCaptionDataset::read(size_t i) const {
  const ImageCaptionEntry& e = entry(i);
  RgbImage image =
      e.archive >= 0
          ? decode_image(archives_.at(static_cast<size_t>(e.archive))->bytes(e.archive_offset, e.archive_size),
                         e.image_path)
          : read_image(e.image_path);
  if (image.width != e.info.width() || image.height != e.info.height())
    FORGE_FAIL("{}: decodes to {}x{} pixels, but its header read {}x{} when the dataset was opened (has it changed?)",
               e.image_path, image.width, image.height, e.info.width(), e.info.height());
  return image;
}

Tensor ImageCaptionDataset::load(size_t i, ImageBucket bucket, const ImageTransform& transform) const {
  const RgbImage image = read(i);
  const BucketPlacement placement = place_in_bucket(image.width, image.height, bucket, transform, i);
  return normalized_chw(fit_to_bucket(image, bucket, placement));
}

}  // namespace forge
