// Tar archives (data/tar_archive.h, NOTE [Tar archives]): the indexer on the raw bytes, every
// member it returns checked to lie inside the input, then the webdataset image layout's
// grouping and header probing on the same bytes as a one-shard dataset. The input: one
// whole .tar file.
#include <cstdlib>

#include "data/image_caption_dataset.h"
#include "data/tar_archive.h"
#include "harness_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = forge::fuzz::as_view(data, size);
  forge::fuzz::expect_only_forge_errors([&] {
    for (const forge::TarMember& member : forge::index_tar(input, "input.tar"))
      if (member.offset > size || member.size > size - member.offset || member.header_offset >= member.offset)
        std::abort();
  });
  forge::fuzz::expect_only_forge_errors([&] {
    forge::ImageDatasetOptions options;
    options.missing_captions = forge::MissingCaptions::Skip;
    options.allow_empty_captions = true;
    const forge::ImageCaptionDataset dataset(forge::fuzz::write_temp_file("input.tar", input),
                                             forge::ImageDatasetLayout::Webdataset, options);
    (void)dataset.describe();
  });
  return 0;
}
