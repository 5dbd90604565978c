// The tar reader (data/tar_archive.h, NOTE [Tar archives]) on archives built byte by byte
// (tar_testing.h): regular members with their offsets, directories skipped, ustar prefixes, pax
// path and size records, GNU long names, and each refusal naming the file and the header's byte
// offset. Python's tarfile output (PAX, GNU and ustar formats) goes through it in
// python.test_flux_prep_webdataset.
#include <gtest/gtest.h>

#include <fstream>

#include "data/tar_archive.h"
#include "expect_error.h"
#include "tar_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using namespace tar_testing;

const std::string kName = "shard-0007.tar";

std::string contents(std::string_view tar, const TarMember& m) { return std::string(tar.substr(m.offset, m.size)); }

TEST(TarArchive, RegularMembersDirectoriesAndPrefixes) {
  const std::string big(700, 'x');
  const std::string tar = member("d/", "", '5') + member("d/a.txt", "hello") + member("b.bin", big) +
                          header("name.json", 2, '\0', kUstarMagic, "some/prefix") + padded("{}") +
                          member("c.jpg", "", '7') + end_blocks() + std::string(512 * 7, '\0');
  const std::vector<TarMember> members = index_tar(tar, kName);
  ASSERT_EQ(members.size(), 4u);
  EXPECT_EQ(members[0].path, "d/a.txt");
  EXPECT_EQ(members[0].header_offset, 512u);
  EXPECT_EQ(members[0].offset, 1024u);
  EXPECT_EQ(members[0].size, 5u);
  EXPECT_EQ(contents(tar, members[0]), "hello");
  EXPECT_EQ(members[1].path, "b.bin");
  EXPECT_EQ(members[1].offset, 2048u);
  EXPECT_EQ(contents(tar, members[1]), big);
  EXPECT_EQ(members[2].path, "some/prefix/name.json");
  EXPECT_EQ(members[2].header_offset, 2048u + 1024u);
  EXPECT_EQ(contents(tar, members[2]), "{}");
  EXPECT_EQ(members[3].path, "c.jpg");
  EXPECT_EQ(members[3].size, 0u);
  // A lone end block is accepted, as GNU tar does; so is an empty archive.
  EXPECT_EQ(index_tar(member("a.txt", "1") + std::string(512, '\0'), kName).size(), 1u);
  EXPECT_TRUE(index_tar(end_blocks(), kName).empty());
}

TEST(TarArchive, PaxPathAndSizeOverrideTheNextMemberOnly) {
  const std::string long_key(150, 'k');
  // The header's own size field says 0 (as for members of 8 GiB and more); pax's size rules.
  const std::string tar = pax({{"comment", "ignored"}}, 'g') + pax({{"path", long_key + ".jpg"}, {"size", "6"}}) +
                          header("truncated-name.jpg", 0) + padded("pixels") + member("next.txt", "caption") +
                          end_blocks();
  const std::vector<TarMember> members = index_tar(tar, kName);
  ASSERT_EQ(members.size(), 2u);
  EXPECT_EQ(members[0].path, long_key + ".jpg");
  EXPECT_EQ(members[0].header_offset,
            1024u);  // the pax header's, after the global one
  EXPECT_EQ(members[0].size, 6u);
  EXPECT_EQ(contents(tar, members[0]), "pixels");
  EXPECT_EQ(members[1].path, "next.txt");
  EXPECT_EQ(members[1].header_offset, members[0].offset + 512);
  EXPECT_EQ(contents(tar, members[1]), "caption");
}

TEST(TarArchive, GnuLongNames) {
  const std::string long_name = "folder/" + std::string(150, 'g') + ".png";
  const std::string tar = gnu_long_name(long_name) + header(long_name.substr(0, 100), 3, '0', kGnuMagic) +
                          padded("png") + header("short.txt", 2, '0', kGnuMagic, "not-a-prefix-in-gnu") + padded("ok") +
                          end_blocks();
  const std::vector<TarMember> members = index_tar(tar, kName);
  ASSERT_EQ(members.size(), 2u);
  EXPECT_EQ(members[0].path, long_name);
  EXPECT_EQ(members[0].header_offset, 0u);
  EXPECT_EQ(contents(tar, members[0]), "png");
  EXPECT_EQ(members[1].path, "short.txt");
}

TEST(TarArchive, RefusalsNameTheFileAndTheHeaderOffset) {
  const std::string first = member("a.txt", "one");  // 1024 bytes: the next header is at 1024
  std::string bad_sum = first + member("b.txt", "two") + end_blocks();
  bad_sum[1024 + 1] ^= 1;
  expect_error([&] { index_tar(bad_sum, kName); },
               {kName + ": tar header at byte offset 1024: checksum", "not a tar file, or a damaged one"});

  std::string bad_size = first + member("b.txt", "two") + end_blocks();
  put(bad_size, 1024 + 124, "00000000x03");
  {
    std::string block = bad_size.substr(1024, 512);
    seal(block);
    bad_size.replace(1024, 512, block);
  }
  expect_error([&] { index_tar(bad_size, kName); },
               {kName + ": tar header at byte offset 1024: size field '00000000x03", "not an octal number"});

  const std::string whole = first + member("b.txt", "two") + end_blocks();
  expect_error([&] { index_tar(whole.substr(0, 1024 + 300), kName); },
               {kName + ": tar header at byte offset 1024: a header cut short "
                        "(300 bytes left, expected 512)"});
  expect_error([&] { index_tar(whole.substr(0, 2048), kName); },
               {kName + ": tar header at byte offset 2048: the file ends here, "
                        "without the end-of-archive block"});

  const std::string past_end = first + header("big.jpg", 5000) + std::string(1000, 'x');
  expect_error([&] { index_tar(past_end, kName); }, {kName + ": tar header at byte offset 1024: member 'big.jpg' "
                                                             "has 5000 bytes of data from byte offset "
                                                             "1536, past the end of the file (2536 bytes)"});
  const std::string unpadded = first + header("c.jpg", 10) + "0123456789";
  expect_error([&] { index_tar(unpadded, kName); },
               {kName + ": tar header at byte offset 1024: member 'c.jpg'", "inside the padding"});

  const std::string symlink = first + header("link.jpg", 0, '2', kUstarMagic, "", "/etc/passwd") + end_blocks();
  expect_error([&] { index_tar(symlink, kName); }, {kName + ": tar header at byte offset 1024: member 'link.jpg' "
                                                            "is a symbolic link to '/etc/passwd'",
                                                    "expected regular files"});
  const std::string hard_link = header("copy.jpg", 0, '1', kUstarMagic, "", "a.jpg") + end_blocks();
  expect_error([&] { index_tar(hard_link, kName); }, {kName + ": tar header at byte offset 0: member 'copy.jpg' is a "
                                                              "hard link to 'a.jpg'"});
  expect_error([&] { index_tar(first + header("fifo", 0, '6') + end_blocks(), kName); },
               {kName + ": tar header at byte offset 1024: member 'fifo' is a FIFO"});
  expect_error([&] { index_tar(header("odd", 0, 'Q') + end_blocks(), kName); },
               {kName + ": tar header at byte offset 0: member 'odd' has type flag 'Q'"});

  const std::string bad_pax = first + header("PaxHeaders/x", 9, 'x') + padded("9 path=ab") + end_blocks();
  expect_error([&] { index_tar(bad_pax, kName); }, {kName + ": tar header at byte offset 1024: pax extended "
                                                            "header: the record at byte 0 of its data "
                                                            "does not end with a newline"});
  const std::string lone_pax = pax({{"path", "x.jpg"}}) + end_blocks();
  expect_error([&] { index_tar(lone_pax, kName); }, {kName + ": tar header at byte offset 1024: the end-of-archive "
                                                             "block right after the extended header "
                                                             "at byte offset 0"});
  expect_error(
      [&] {
        index_tar(pax({{"size", "12x"}}) + member("a", "") + end_blocks(), kName);
      },
      {kName + ": tar header at byte offset 0: pax extended header", "has size '12x'"});
  expect_error(
      [&] {
        index_tar(pax({{"GNU.sparse.size", "10"}}) + member("a", "") + end_blocks(), kName);
      },
      {kName + ": tar header at byte offset 0", "GNU sparse file"});
  expect_error([&] { index_tar("", kName); }, {kName + ": tar header at byte offset 0: the file ends here, "
                                                       "without the end-of-archive block"});
}

TEST(TarArchive, MapsAFileAndReadsMembersInPlace) {
  TempDir dir;
  const std::string path = dir.file("wds.tar");
  std::ofstream(path, std::ios::binary) << member("k.txt", "a caption") + member("k.json", "{}") + end_blocks();
  const TarArchive archive(path);
  EXPECT_EQ(archive.path(), path);
  ASSERT_EQ(archive.members().size(), 2u);
  EXPECT_EQ(archive.bytes(archive.members()[0]), "a caption");
  EXPECT_EQ(archive.bytes(archive.members()[1]), "{}");
  std::ofstream(path, std::ios::binary) << member("k.txt", "a caption");
  expect_error([&] { TarArchive{path}; }, {path + ": tar header at byte offset 1024", "without the end-of-archive"});
}

}  // namespace
}  // namespace forge
