// Test tool: forge's image decoding, resizing, buckets and image-caption datasets, driven
// by tests/python/test_image_decode_vs_pil.py. Errors (forge::Error) go to stderr with
// exit status 1; results are raw files and JSON on stdout.
//
//   forge_image_reference info IMAGE            {"format", "width", "height", "orientation"}
//   forge_image_reference decode IMAGE OUT      OUT: the upright RGB bytes; prints {"width", "height"}
//   forge_image_reference resize IMAGE W H OUT [bilinear|bicubic]
//                                               OUT: RGB bytes of the decoded image resized to W x H
//   forge_image_reference bucket IMAGE BW BH center|random FLIP SEED INDEX OUT
//                                               OUT: float32 [3, BH, BW] as the dataset's load gives it;
//                                               prints the placement
//   forge_image_reference torchtitan IMAGE SIZE MIN_SIZE SEED INDEX OUT
//                                               --transform torchtitan: OUT as for bucket, or nothing
//                                               when skipped; prints the placement or {"skipped": true}
//   forge_image_reference png IMAGE OUT         writes the decoded image as OUT (PNG)
//   forge_image_reference dataset LAYOUT PATH [skip] [allow-empty] [verify]
//                                               one JSON line per entry, then {"summary": describe()};
//                                               with verify, every image decoded first
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/image_caption_dataset.h"
#include "data/image_decode.h"
#include "data/image_png.h"
#include "data/image_resize.h"
#include "data/image_transform.h"

using nlohmann::json;
using namespace forge;

namespace {

void write_bytes(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  FORGE_CHECK(out.good(), "cannot write {}", path);
}

int run(const std::vector<std::string>& args) {
  const std::string& command = args.at(0);
  if (command == "info") {
    const ImageInfo info = read_image_info(args.at(1));
    std::cout << json{{"format", image_format_name(info.format)},
                      {"width", info.width()},
                      {"height", info.height()},
                      {"orientation", info.orientation}}
              << "\n";
  } else if (command == "decode") {
    const RgbImage image = read_image(args.at(1));
    write_bytes(args.at(2), image.pixels.data(), image.pixels.size());
    std::cout << json{{"width", image.width}, {"height", image.height}} << "\n";
  } else if (command == "resize") {
    const ResampleFilter filter =
        args.size() > 5 && args[5] == "bicubic" ? ResampleFilter::Bicubic : ResampleFilter::Bilinear;
    const RgbImage image =
        resize_image(read_image(args.at(1)), std::stoi(args.at(2)), std::stoi(args.at(3)), filter);
    write_bytes(args.at(4), image.pixels.data(), image.pixels.size());
  } else if (command == "bucket") {
    const RgbImage image = read_image(args.at(1));
    const ImageBucket bucket{std::stoi(args.at(2)), std::stoi(args.at(3))};
    ImageTransform transform;
    transform.crop = args.at(4) == "random" ? ImageCrop::Random : ImageCrop::Center;
    transform.random_flip = args.at(5) == "1";
    transform.seed = std::stoull(args.at(6));
    const BucketPlacement p = place_in_bucket(image.width, image.height, bucket, transform, std::stoull(args.at(7)));
    const Tensor t = normalized_chw(fit_to_bucket(image, bucket, p));
    write_bytes(args.at(8), t.data<float>(), t.nbytes());
    std::cout << json{{"resized_width", p.resized_width},
                      {"resized_height", p.resized_height},
                      {"left", p.left},
                      {"top", p.top},
                      {"flip", p.flip}}
              << "\n";
  } else if (command == "torchtitan") {
    const ImageInfo info = read_image_info(args.at(1));
    const int size = std::stoi(args.at(2));
    ImageTransform transform;
    transform.kind = ImageTransformKind::Torchtitan;
    transform.crop = ImageCrop::Random;
    transform.min_size = std::stoi(args.at(3));
    transform.seed = std::stoull(args.at(4));
    const ImageBucket bucket{size, size};
    check_image_transform(transform, {bucket}, false);
    if (image_too_small(info.width(), info.height(), transform)) {
      std::cout << json{{"skipped", true}} << "\n";
      return 0;
    }
    const RgbImage image = read_image(args.at(1));
    const BucketPlacement p = place_in_bucket(image.width, image.height, bucket, transform, std::stoull(args.at(5)));
    const Tensor t = normalized_chw(fit_to_bucket(image, bucket, p));
    write_bytes(args.at(6), t.data<float>(), t.nbytes());
    std::cout << json{{"skipped", false},
                      {"resized_width", p.resized_width},
                      {"resized_height", p.resized_height},
                      {"left", p.left},
                      {"top", p.top}}
              << "\n";
  } else if (command == "png") {
    write_png_file(args.at(2), read_image(args.at(1)));
  } else if (command == "dataset") {
    ImageDatasetOptions options;
    for (size_t i = 3; i < args.size(); ++i) {
      if (args[i] == "skip") options.missing_captions = MissingCaptions::Skip;
      if (args[i] == "allow-empty") options.allow_empty_captions = true;
    }
    const ImageCaptionDataset dataset(args.at(2), parse_image_dataset_layout(args.at(1), "layout"), options);
    if (std::find(args.begin(), args.end(), "verify") != args.end()) dataset.verify();
    for (const auto& e : dataset.entries())
      std::cout << json{{"image", e.image_path},
                        {"caption", e.caption},
                        {"format", image_format_name(e.info.format)},
                        {"width", e.info.width()},
                        {"height", e.info.height()}}
                << "\n";
    const ImageDatasetSummary& s = dataset.summary();
    std::cout << json{{"summary", dataset.describe()},
                      {"skipped_without_caption", s.skipped_without_caption},
                      {"captions_without_image", s.captions_without_image}}
              << "\n";
  } else {
    std::cerr << "unknown command " << command << "\n";
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: forge_image_reference info|decode|resize|bucket|torchtitan|png|dataset ...\n";
    return 2;
  }
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
