// Image-caption datasets (data/image_caption_dataset.h) on temporary folders of PNGs that
// forge's writer makes: the three layouts, their order, captions and summaries, every
// refusal naming its file, and load() giving the bucket's normalized tensor. The same with
// JPEG and WebP files and against diffusers' transform: python.test_image_decode_vs_pil.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/image_caption_dataset.h"
#include "expect_error.h"
#include "image_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

void write_png_at(const std::string& path, int w, int h, uint64_t seed = 1) {
  fs::create_directories(fs::path(path).parent_path());
  write_pattern_png(path, w, h, seed);
}

std::vector<std::string> captions(const ImageCaptionDataset& d) {
  std::vector<std::string> out;
  for (const auto& e : d.entries()) out.push_back(e.caption);
  return out;
}

TEST(ImageCaptionDataset, CaptionFilesSortedTrimmedAndSummarized) {
  TempDir dir;
  const std::string root = dir.file("set");
  write_png_at(root + "/b/two.png", 12, 8);
  write_text(root + "/b/two.txt", "  second\n");
  write_png_at(root + "/a.png", 8, 12);
  write_text(root + "/a.txt",
             "\xef\xbb\xbf"
             "first caption");
  write_text(root + "/lonely.txt", "no image");
  write_png_at(root + "/.cache/hidden.png", 4, 4);
  const ImageCaptionDataset d(root, ImageDatasetLayout::CaptionFiles);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.entry(0).image_path, root + "/a.png");
  EXPECT_EQ(d.entry(1).image_path, root + "/b/two.png");
  EXPECT_EQ(captions(d), (std::vector<std::string>{"first caption", "second"}));
  EXPECT_EQ(d.entry(0).info.width(), 8);
  EXPECT_EQ(d.summary().captions_without_image, 1u);
  EXPECT_EQ(d.describe(), root + ": 2 images with captions (caption-files: 2 PNG); 1 caption file without an image");

  write_png_at(root + "/c.png", 4, 4);
  expect_error([&] { ImageCaptionDataset(root, ImageDatasetLayout::CaptionFiles); },
               {"1 problem in the caption-files image dataset", root + "/c.png: no caption file " + root + "/c.txt"});
  ImageDatasetOptions skip;
  skip.missing_captions = MissingCaptions::Skip;
  const ImageCaptionDataset skipped(root, ImageDatasetLayout::CaptionFiles, skip);
  EXPECT_EQ(skipped.size(), 2u);
  EXPECT_EQ(skipped.summary().skipped_without_caption, 1u);
  EXPECT_NE(skipped.describe().find("1 skipped without a caption (c.png)"), std::string::npos);
  ImageDatasetOptions caption_ext;
  caption_ext.caption_extension = ".caption";
  write_text(root + "/a.caption", "other");
  caption_ext.missing_captions = MissingCaptions::Skip;
  EXPECT_EQ(captions(ImageCaptionDataset(root, ImageDatasetLayout::CaptionFiles, caption_ext)),
            std::vector<std::string>{"other"});
  caption_ext.caption_extension = ".png";
  expect_error([&] { ImageCaptionDataset(root, ImageDatasetLayout::CaptionFiles, caption_ext); },
               {"caption extension '.png'"});
}

TEST(ImageCaptionDataset, EveryProblemIsListedWithItsFile) {
  TempDir dir;
  const std::string root = dir.file("set");
  write_png_at(root + "/ok.png", 8, 8);
  write_text(root + "/ok.txt", "fine");
  write_png_at(root + "/blank.png", 8, 8);
  write_text(root + "/blank.txt", " \r\n ");
  write_png_at(root + "/latin1.png", 8, 8);
  write_text(root + "/latin1.txt", "caf\xe9");
  write_text(root + "/notpng.png", std::string("GIF89a\x01\0\x01\0\0\0\0\0\0\0", 16));
  write_text(root + "/notpng.txt", "x");
  write_text(root + "/cut.png", encode_png(pattern_image(20, 20)).substr(0, 40));
  write_text(root + "/cut.txt", "x");
  const std::string message = error_of([&] { ImageCaptionDataset(root, ImageDatasetLayout::CaptionFiles); });
  for (const std::string fragment :
       {root + ": 4 problems in the caption-files image dataset:", root + "/blank.txt: empty caption",
        root + "/cut.png: truncated PNG", root + "/latin1.txt: caption: invalid UTF-8 at byte offset 3",
        root + "/notpng.png: not a JPEG, PNG or WebP image: a GIF image"})
    EXPECT_NE(message.find(fragment), std::string::npos) << message << "\nlacks: " << fragment;
  ImageDatasetOptions allow_empty;
  allow_empty.allow_empty_captions = true;
  EXPECT_NE(
      error_of([&] { ImageCaptionDataset(root, ImageDatasetLayout::CaptionFiles, allow_empty); }).find("3 problems"),
      std::string::npos);
  expect_error([&] { ImageCaptionDataset(dir.file("nowhere"), ImageDatasetLayout::FilenameCaptions); },
               {dir.file("nowhere") + ": cannot open the dataset folder"});
  write_text(dir.file("empty/readme.md"), "no images");
  expect_error([&] { ImageCaptionDataset(dir.file("empty"), ImageDatasetLayout::FilenameCaptions); },
               {"no images with captions in the filename-captions image dataset"});
}

TEST(ImageCaptionDataset, VerifyDecodesEveryImage) {
  TempDir dir;
  const std::string root = dir.file("set");
  for (int i = 0; i < 5; ++i) {
    write_png_at(root + "/" + std::to_string(i) + ".png", 30, 20, i);
    write_text(root + "/" + std::to_string(i) + ".txt", "caption");
  }
  const ImageCaptionDataset d(root, ImageDatasetLayout::CaptionFiles);
  d.verify();
  for (int i : {1, 3}) {  // cut in the image data: the header still reads
    const std::string png = encode_png(pattern_image(30, 20, i));
    write_text(root + "/" + std::to_string(i) + ".png", png.substr(0, png.size() - 30));
  }
  const ImageCaptionDataset cut(root, ImageDatasetLayout::CaptionFiles);
  expect_error([&] { cut.verify(); }, {root + ": 2 problems in the caption-files image dataset:",
                                       root + "/1.png: truncated PNG", root + "/3.png: truncated PNG"});
}

TEST(ImageCaptionDataset, FilenameCaptionsAsPseudoCamera10k) {
  TempDir dir;
  const std::string root = dir.file("pseudo-camera-10k");
  write_png_at(root + "/train/a_bird_on_a_branch.png", 10, 6);
  write_png_at(root + "/train/the_sea.v2_at_dawn.png", 6, 10);
  write_text(root + "/caption/a_bird_on_a_branch.txt", "a bird on a branch\n");
  write_text(root + "/scripts/khoya.sh", "#!/bin/bash\n");
  write_text(root + "/README.md", "readme");
  const ImageCaptionDataset d(root, ImageDatasetLayout::FilenameCaptions);
  EXPECT_EQ(captions(d), (std::vector<std::string>{"a bird on a branch", "the sea.v2 at dawn"}));
  EXPECT_EQ(d.entry(1).info.height(), 10);
}

TEST(ImageCaptionDataset, JsonlManifest) {
  TempDir dir;
  write_png_at(dir.file("imgs/a.png"), 8, 8);
  write_png_at(dir.file("b.png"), 8, 8, 2);
  write_text(dir.file("m.jsonl"),
             "{\"image\": \"imgs/a.png\", \"text\": \"one\", \"score\": 0.5}\n\n"
             "{\"file_name\": \"b.png\", \"caption\": \"two\"}\n"
             "{\"image\": \"imgs/a.png\", \"text\": \"one again\"}\n");
  const ImageCaptionDataset d(dir.file("m.jsonl"), ImageDatasetLayout::Jsonl);
  EXPECT_EQ(captions(d), (std::vector<std::string>{"one", "two", "one again"}));  // the manifest's order
  EXPECT_EQ(d.entry(1).image_path, (fs::path(dir.file("m.jsonl")).parent_path() / "b.png").string());

  write_text(dir.file("bad.jsonl"),
             "{\"image\": \"imgs/a.png\"}\n{\"image\": \"gone.png\", \"text\": \"x\"}\n"
             "not json\n{\"image\": \"b.png\", \"text\": null, \"caption\": 3}\n");
  const std::string m = dir.file("bad.jsonl");
  expect_error([&] { ImageCaptionDataset(m, ImageDatasetLayout::Jsonl); },
               {"4 problems", m + ":1: no caption (\"text\" or \"caption\") for imgs/a.png", m + ":2: ",
                "gone.png: cannot open", m + ":3: not valid JSON", m + ":4: \"caption\" is number, expected a string"});
  expect_error([&] { ImageCaptionDataset(dir.file("none.jsonl"), ImageDatasetLayout::Jsonl); },
               {dir.file("none.jsonl") + ": cannot open the manifest"});
  expect_error(
      [] { parse_image_dataset_layout("folder", "flux.images.layout"); },
      {"flux.images.layout: unknown image dataset layout 'folder'", "caption-files", "filename-captions", "jsonl"});
}

TEST(ImageCaptionDataset, LoadGivesTheBucketsNormalizedCrop) {
  TempDir dir;
  write_png_at(dir.file("set/wide.png"), 40, 20, 5);
  write_text(dir.file("set/wide.txt"), "wide");
  const ImageCaptionDataset d(dir.file("set"), ImageDatasetLayout::CaptionFiles);
  const ImageBucket bucket{16, 16};
  const Tensor t = d.load(0, bucket, ImageTransform{});
  EXPECT_EQ(t.shape(), (Shape{3, 16, 16}));
  const RgbImage expected = fit_to_bucket(d.read(0), bucket, place_in_bucket(40, 20, bucket, ImageTransform{}, 0));
  const float* v = t.data<float>();
  for (int y = 0; y < 16; ++y)
    for (int x = 0; x < 16; ++x)
      for (int c = 0; c < 3; ++c)
        ASSERT_EQ(v[(c * 16 + y) * 16 + x], (expected.row(y)[3 * x + c] / 255.0f - 0.5f) / 0.5f);
  // A file replaced by one of another size after the dataset was opened.
  write_png_at(dir.file("set/wide.png"), 20, 20, 5);
  expect_error([&] { d.load(0, bucket, ImageTransform{}); }, {"wide.png: decodes to 20x20 pixels", "40x20"});
}

}  // namespace
}  // namespace forge
