// The webdataset layout of the image-caption datasets (NOTE [Image-caption datasets]) on tar shards
// built in the test (tar_testing.h) around PNGs from forge's writer: shard lists from files,
// folders and brace patterns; webdataset's grouping of members into samples; each image read from
// its shard; the refusals, naming the shard, the sample and the offset. The whole `forge prep
// --images` path against a caption-files folder: python.test_flux_prep_webdataset.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/image_caption_dataset.h"
#include "expect_error.h"
#include "image_testing.h"
#include "tar_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using namespace tar_testing;

std::string png_bytes(const TempDir& dir, int w, int h, uint64_t seed) {
  const std::string path = dir.file(fmt::format("source-{}x{}-{}.png", w, h, seed));
  write_pattern_png(path, w, h, seed);
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(ImageWebdataset, ShardListsFromFilesFoldersAndPatterns) {
  TempDir dir;
  for (const char* name : {"b-09.tar", "b-10.tar", "b-11.tar", "a.tar", ".hidden.tar", "notes.txt"})
    write_file(dir.file(std::string("shards/") + name), end_blocks());
  fs::create_directories(dir.file("shards/sub.tar.d"));
  const std::string s = dir.file("shards");
  EXPECT_EQ(list_webdataset_shards(s),
            (std::vector<std::string>{s + "/a.tar", s + "/b-09.tar", s + "/b-10.tar", s + "/b-11.tar"}));
  EXPECT_EQ(list_webdataset_shards(s + "/a.tar"), std::vector<std::string>{s + "/a.tar"});
  EXPECT_EQ(list_webdataset_shards(s + "/b-{09..11}.tar"),
            (std::vector<std::string>{s + "/b-09.tar", s + "/b-10.tar", s + "/b-11.tar"}));
  EXPECT_EQ(list_webdataset_shards(s + "/{a,b-10}.tar"), (std::vector<std::string>{s + "/a.tar", s + "/b-10.tar"}));
  EXPECT_TRUE(is_shard_pattern("x-{0..3}.tar"));
  EXPECT_FALSE(is_shard_pattern("x-0.tar"));
  // Padding: to the wider bound when a bound has leading zeros, else none.
  expect_error([&] { list_webdataset_shards(s + "/b-{9..11}.tar"); },
               {s + "/b-{9..11}.tar: 1 of the 3 tar shards it names is missing: " + s + "/b-9.tar"});
  expect_error(
      [&] { list_webdataset_shards(s + "/b-{0000..0011}.tar"); },
      {"12 of the 12 tar shards it names are missing: " + s + "/b-0000.tar, " + s + "/b-0001.tar", "... and 2 more"});
  expect_error([&] { list_webdataset_shards(s + "/b-{11..09}.tar"); }, {"the range {11..09} runs backwards"});
  expect_error([&] { list_webdataset_shards(s + "/b-{1..x}.tar"); },
               {"the range {1..x} is not of two decimal numbers"});
  expect_error([&] { list_webdataset_shards(s + "/b-{1}.tar"); }, {"neither a range {A..B} nor a list {a,b}"});
  expect_error([&] { list_webdataset_shards(s + "/b-{1..{2}.tar"); }, {"nested braces"});
  expect_error([&] { list_webdataset_shards(dir.file("shards/sub.tar.d")); }, {"no .tar shards directly in"});
  expect_error([&] { list_webdataset_shards(dir.file("nothing.tar")); }, {dir.file("nothing.tar") + ": no such"});
}

TEST(ImageWebdataset, SamplesGroupedByKeyInArchiveOrder) {
  TempDir dir;
  const std::string p1 = png_bytes(dir, 12, 8, 1), p2 = png_bytes(dir, 8, 12, 2), p3 = png_bytes(dir, 6, 6, 3);
  const std::string long_key = std::string(150, 'z');
  // Shard 0: a json ignored, a member without extension ignored, a folder in the key, an upper-case
  // extension. Shard 1: a pax path for a 150-character key.
  write_file(dir.file("wds/part-0.tar"), member("__meta__", "ignored") + member("0002.json", "{}") +
                                             member("0002.txt", "  second\n") + member("0002.png", p1) +
                                             member("sub/0001.PNG", p2) +
                                             member("sub/0001.txt",
                                                    "\xef\xbb\xbf"
                                                    "first") +
                                             end_blocks());
  write_file(dir.file("wds/part-1.tar"), pax({{"path", long_key + ".png"}}) + member("short.png", p3) +
                                             pax({{"path", long_key + ".txt"}}) + member("short.txt", "third") +
                                             end_blocks());
  const ImageCaptionDataset d(dir.file("wds/part-{0..1}.tar"), ImageDatasetLayout::Webdataset);
  ASSERT_EQ(d.size(), 3u);
  const std::string s0 = dir.file("wds/part-0.tar"), s1 = dir.file("wds/part-1.tar");
  EXPECT_EQ(d.entry(0).image_path, s0 + ":0002.png");
  EXPECT_EQ(d.entry(0).caption, "second");
  EXPECT_EQ(d.entry(1).image_path, s0 + ":sub/0001.PNG");
  EXPECT_EQ(d.entry(1).caption, "first");
  EXPECT_EQ(d.entry(2).image_path, s1 + ":" + long_key + ".png");
  EXPECT_EQ(d.entry(2).caption, "third");
  EXPECT_EQ(d.entry(2).archive, 1);
  EXPECT_EQ(d.entry(1).info.width(), 8);
  EXPECT_EQ(d.describe(), dir.file("wds/part-{0..1}.tar") + ": 3 images with captions (webdataset, 2 shards: 3 PNG)");
  const RgbImage image = d.read(1);
  EXPECT_EQ(image.pixels, pattern_image(8, 12, 2).pixels);
  EXPECT_EQ(d.read(2).pixels, pattern_image(6, 6, 3).pixels);
  d.verify();
  const Tensor t = d.load(0, {16, 16}, ImageTransform{});
  EXPECT_EQ(t.dim(1), 16);
  // The same shards as a folder, and one shard alone.
  EXPECT_EQ(ImageCaptionDataset(dir.file("wds"), ImageDatasetLayout::Webdataset).size(), 3u);
  EXPECT_EQ(ImageCaptionDataset(s1, ImageDatasetLayout::Webdataset).size(), 1u);
}

TEST(ImageWebdataset, RefusalsNameTheShardSampleAndOffset) {
  TempDir dir;
  const std::string png = png_bytes(dir, 8, 8, 1);
  const std::string shard = dir.file("bad.tar");
  // 0: no caption (header at 0); 1: two images (at 1024 + png's blocks); 2: no image; 3: not an
  // image.
  const std::string first = member("a.png", png);
  const std::string second = member("b.jpg", png) + member("b.png", png) + member("b.txt", "x");
  write_file(shard, first + second + member("c.txt", "lonely") + member("d.webp", "not webp") + member("d.txt", "d") +
                        member("e.png", png) + member("e.txt", " \n") + member("f.png", png) + member("f.txt", "ok") +
                        end_blocks());
  expect_error([&] { ImageCaptionDataset(shard, ImageDatasetLayout::Webdataset); },
               {shard + ": 5 problems in the webdataset image dataset",
                shard + ": sample 'a' (tar header at byte offset 0): no caption (a.txt "
                        "member)",
                fmt::format("{}: sample 'b' (tar header at byte offset {}): 2 image members, "
                            "expected one (a jpg, "
                            "jpeg, png or webp member); its members: b.jpg, b.png, b.txt",
                            shard, first.size()),
                "sample 'c' (tar header at byte offset", "no image members, expected one", "its members: c.txt",
                shard + ":d.webp", shard + ":e.txt: empty caption"});
  ImageDatasetOptions lenient;
  lenient.missing_captions = MissingCaptions::Skip;
  lenient.allow_empty_captions = true;
  write_file(shard, first + member("e.png", png) + member("e.txt", " \n") + member("f.png", png) +
                        member("f.txt", "ok") + member("f.txt", "again") + end_blocks());
  expect_error([&] { ImageCaptionDataset(shard, ImageDatasetLayout::Webdataset, lenient); },
               {"sample 'f'", "two 'txt' members, expected one of each extension"});
  write_file(shard, first + member("e.png", png) + member("e.txt", " \n") + end_blocks());
  const ImageCaptionDataset d(shard, ImageDatasetLayout::Webdataset, lenient);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d.entry(0).caption, "");
  EXPECT_EQ(d.summary().skipped_without_caption, 1u);
  EXPECT_EQ(d.summary().skipped_examples, std::vector<std::string>{shard + ":a.png"});
  // A damaged shard: its tar error, among the dataset's problems.
  std::string damaged = first + member("a.txt", "x") + end_blocks();
  damaged[first.size() + 3] ^= 1;
  write_file(shard, damaged);
  expect_error([&] { ImageCaptionDataset(shard, ImageDatasetLayout::Webdataset); },
               {fmt::format("{}: tar header at byte offset {}: checksum", shard, first.size())});
  // A PNG cut short past its header shows on read(), naming the member.
  const std::string cut = png.substr(0, png.size() - 20);
  write_file(shard, member("g.png", cut) + member("g.txt", "g") + end_blocks());
  const ImageCaptionDataset g(shard, ImageDatasetLayout::Webdataset);
  expect_error([&] { g.verify(); }, {shard + ":g.png"});
  EXPECT_EQ(parse_image_dataset_layout("webdataset", "--layout"), ImageDatasetLayout::Webdataset);
}

}  // namespace
}  // namespace forge
