// Datasets of images with captions, for FLUX training: the list of (image, caption) pairs
// a `forge prep --images` step encodes, and each image as the VAE's input tensor.
//
// NOTE [Image-caption datasets]
// Four layouts:
//   caption-files      a folder (searched recursively) of images, each captioned by the file
//                      of the same stem and caption extension (".txt") beside it: photo.jpg
//                      and photo.txt (kohya's sd-scripts, SimpleTuner's textfile strategy).
//                      The caption is the file's text, UTF-8, with a leading byte order mark
//                      and surrounding whitespace removed. An image without a caption file
//                      is an error, or skipped and counted with MissingCaptions::Skip;
//                      caption files without an image are counted and ignored.
//   filename-captions  a folder (recursively) of images whose file name is the caption with
//                      underscores for spaces: the layout of bghira/pseudo-camera-10k, the
//                      data of AMD's FluxBenchmark (its train/ folder holds about 2,800 PNGs
//                      such as a_bird_perches_on_a_thin_branch_....png; its caption/ folder
//                      holds the same text as .txt files, made from the names by the
//                      dataset's scripts/khoya.sh). The caption is the name without its
//                      extension, '_' replaced by ' ', as FluxBenchmark's tokenize_captions
//                      and SimpleTuner's "filename" strategy make it. Point it at the
//                      downloaded folder (huggingface-cli download --repo-type dataset
//                      bghira/pseudo-camera-10k --local-dir DIR), or at the snapshot folder in
//                      the Hugging Face cache (its files are symbolic links, which are followed).
//   jsonl              a JSON Lines manifest, one object per line: the image's path under
//                      "image" (or "file_name", as in a Hugging Face imagefolder's
//                      metadata.jsonl), relative to the manifest's folder unless absolute,
//                      and its caption under "text" (or "caption"), as given; other keys are
//                      ignored, blank lines skipped. A line without a caption is an error or skipped
//                      (MissingCaptions), like a missing caption file.
//   webdataset         tar shards as webdataset writes them (pixparse/cc12m-wds, the CC12M
//                      and COCO-2014 data of MLPerf Training's Flux.1 benchmark): one .tar
//                      file, a folder of them (every *.tar directly inside, by name; names
//                      starting with '.' skipped) or a brace pattern such as
//                      cc12m-train-{0000..2175}.tar (numeric ranges, zero-padded to the
//                      wider bound when one has leading zeros, as braceexpand does; comma
//                      lists {a,b}; several groups; every shard must exist, the missing ones
//                      are named). Shards are read in place (NOTE [Tar archives]). As
//                      webdataset groups them, a member's key is its path up to the first
//                      '.' of its last component (the folder part stays in the key), its
//                      extension the rest, lowercased; consecutive members with the same
//                      key are a sample (a member whose last component has no '.', or
//                      starts with one, is ignored, as webdataset does). A sample's image
//                      is its one image member (jpg, jpeg, png, webp, or another image
//                      extension, refused by content as below): a sample with none, or
//                      with several (KEY.jpg and KEY.png), is an error naming it, rather
//                      than a guess at which one was meant. Its caption is the txt member,
//                      trimmed as a caption file is; a sample without one is missing its
//                      caption (MissingCaptions). Other members (json, ...) are ignored; a
//                      repeated extension in a sample is an error, as in webdataset.
//                      Samples keep archive order, shards the order given. The entry's
//                      image_path is "SHARD:MEMBER" (cc12m-train-0000.tar:000000001.jpg),
//                      its image's bytes are read from the mapped shard, which stays
//                      mapped while the dataset lives.
// In the folder layouts (and webdataset's samples), images are the files whose names end in .jpg, .jpeg, .jpe, .jfif,
// .png or .webp, or in another image format's extension (.gif, .bmp, .tif, .tiff, .avif,
// .heic, .heif, .jxl, .jp2): those are listed too and then refused by their content (NOTE
// [Image formats]) unless it is JPEG, PNG or WebP. Names starting with '.' are skipped, so
// is every folder whose name does (the .cache/ that huggingface-cli leaves); symbolic links
// to files are followed, links to folders are not (no loops, no entry listed twice). Entries are
// sorted by path (byte order) in the folder layouts and keep the manifest's order in jsonl:
// the same files give the same list everywhere.
// Every entry is validated when the dataset is opened: its caption (valid UTF-8; empty
// after trimming is an error unless allow_empty_captions, for training with empty prompts)
// and its image's header (format, size, orientation: read_image_info, which maps the file
// and touches only its header). All problems are gathered and reported together, the first
// 20 named with their file (and manifest line), so one pass finds every bad file. Damage
// past the header (a PNG or JPEG cut short in its image data, corrupt compressed data)
// shows only when the pixels are decoded: on load(), naming the file, or for all entries at
// once, in parallel and reported together like the above, with verify().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "data/image_buckets.h"
#include "data/image_decode.h"
#include "data/image_transform.h"
#include "data/tar_archive.h"

namespace forge {

enum class ImageDatasetLayout { CaptionFiles, FilenameCaptions, Jsonl, Webdataset };

std::string_view image_dataset_layout_name(ImageDatasetLayout layout);  // "caption-files", ...
// Throws naming `what` and the four names for anything else.
ImageDatasetLayout parse_image_dataset_layout(std::string_view name, std::string_view what);

// Whether `path` holds a brace group ("{0000..2175}", "{a,b}"): a webdataset shard pattern.
bool is_shard_pattern(std::string_view path);
// The tar shards of a webdataset dataset (NOTE [Image-caption datasets]): `spec` is a .tar
// file, a folder of them or a brace pattern. Throws naming the missing shards, a malformed
// pattern, or a folder without shards.
std::vector<std::string> list_webdataset_shards(const std::string& spec);

enum class MissingCaptions { Error, Skip };

struct ImageDatasetOptions {
  MissingCaptions missing_captions = MissingCaptions::Error;
  bool allow_empty_captions = false;
  std::string caption_extension = ".txt";  // caption-files
};

struct ImageCaptionEntry {
  std::string image_path;  // the path opened: the folder or manifest folder joined with the relative path
  std::string caption;     // UTF-8
  ImageInfo info;          // format and upright size, from the header
  // webdataset: the image is archive_size bytes at archive_offset in the dataset's shard
  // number `archive`; -1 in the other layouts, whose image_path is a file.
  int64_t archive = -1;
  uint64_t archive_offset = 0, archive_size = 0;
};

struct ImageDatasetSummary {
  size_t entries = 0;
  size_t jpeg = 0, png = 0, webp = 0;         // entries per format
  size_t skipped_without_caption = 0;         // with MissingCaptions::Skip
  std::vector<std::string> skipped_examples;  // the first few of them
  size_t captions_without_image = 0;          // caption-files: caption files no image has
  size_t shards = 0;                          // webdataset: tar files read
};

class ImageCaptionDataset {
 public:
  // Lists and validates the dataset at `path` (a folder, the manifest for jsonl, the shards
  // for webdataset as list_webdataset_shards takes them); throws
  // a forge::Error listing the problems when any entry is bad.
  ImageCaptionDataset(std::string path, ImageDatasetLayout layout, ImageDatasetOptions options = {});

  const std::string& path() const { return path_; }
  ImageDatasetLayout layout() const { return layout_; }
  size_t size() const { return entries_.size(); }
  const ImageCaptionEntry& entry(size_t i) const { return entries_.at(i); }
  const std::vector<ImageCaptionEntry>& entries() const { return entries_; }
  const ImageDatasetSummary& summary() const { return summary_; }
  // "DIR: 2843 images with captions (filename-captions: 2843 PNG)", then what was skipped.
  std::string describe() const;

  // Decodes every entry's pixels (on num_threads() threads); throws a forge::Error listing
  // every image that fails, as the constructor lists header problems.
  void verify() const;

  // Entry i's upright 8-bit RGB pixels.
  RgbImage read(size_t i) const;
  // Entry i at `bucket`, as the FLUX VAE takes it: float32 [3, bucket.height, bucket.width]
  // in [-1, 1] (NOTE [FLUX image transform]; `i` seeds its random crop and flip). Safe to
  // call from several threads at once.
  Tensor load(size_t i, ImageBucket bucket, const ImageTransform& transform) const;

 private:
  std::string path_;
  ImageDatasetLayout layout_;
  std::vector<ImageCaptionEntry> entries_;
  ImageDatasetSummary summary_;
  std::vector<std::shared_ptr<const TarArchive>> archives_;  // webdataset: the mapped shards
};

}  // namespace forge
