// Reading tar archives in place: the index of a memory-mapped tar file's regular members,
// each an (offset, size) into the mapping, for the webdataset image layout (NOTE
// [Image-caption datasets]) and any other reader of tar shards.
//
// NOTE [Tar archives]
// A tar file is a sequence of 512-byte headers, each followed by its member's data padded
// to a multiple of 512 bytes; a zero block (512 zero bytes) ends it, normally two of them
// (GNU tar accepts a lone one with a warning; so does this reader; anything after the end
// is ignored, as tar ignores the padding to its 10 KiB records). A header holds the name
// (100 bytes, NUL-terminated unless full; POSIX ustar headers, magic "ustar\0", put a
// directory prefix of up to 155 bytes before it), the size (octal digits, or GNU's
// base-256 with the top bit of the first byte set, for 8 GiB and more), the checksum (the
// sum of the header's bytes with the checksum field read as spaces, as unsigned bytes or,
// as old tars wrote it, signed) and a type flag:
//   '0', '\0', '7'  a regular file (7: "contiguous", a regular file to every reader): indexed
//   '5'             a directory: skipped
//   'x'             a POSIX (pax) extended header: its data is records "LEN key=value\n"
//                   (LEN counts the whole record in decimal); "path" and "size" replace the
//                   next member's name and size, other keys are ignored except GNU's sparse
//                   file keys (refused: the data would not be the file's bytes)
//   'g'             a pax global header: ignored
//   'L'             a GNU long name: its data (up to a NUL) is the next member's name
// Every other type is refused naming the member: links ('1' hard, '2' symbolic, and GNU's
// 'K' long link name), devices and FIFOs ('3', '4', '6'), GNU sparse files ('S'), volume
// headers and multi-volume continuations ('V', 'M'): their data would not be a file's
// bytes, or they would point outside the shard. Validation is strict, so that a damaged or
// truncated download fails when it is opened rather than giving a wrong image: a bad
// checksum, a size that is not octal, a header cut short, a member whose data (or its
// padding) runs past the end of the file, a pax record that does not parse, an archive
// without its end block. Each error names the file, the byte offset of the header concerned
// and what was expected there. Nothing is copied: members are views of the mapping, which
// lives as long as the archive.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/mapped_file.h"

namespace forge {

struct TarMember {
  std::string path;        // as stored, after pax "path" and GNU long names; no "./" removed
  uint64_t header_offset;  // its first header (its pax or long-name header when it has one)
  uint64_t offset;         // its data
  uint64_t size;
};

// The regular files of the tar archive in `bytes` (file `name`, for messages), in archive
// order; throws a forge::Error naming `name` and the header's byte offset when it is malformed.
std::vector<TarMember> index_tar(std::string_view bytes, const std::string& name);

// A tar file mapped into memory with its index. Not copyable or movable (the members point
// into the mapping): hold it in a shared_ptr to share it. Reading members is thread-safe.
class TarArchive {
 public:
  explicit TarArchive(std::string path);

  const std::string& path() const { return file_.path(); }
  const std::vector<TarMember>& members() const { return members_; }
  // The `size` bytes at `offset` in the file (within it: an internal error otherwise).
  std::string_view bytes(uint64_t offset, uint64_t size) const;
  std::string_view bytes(const TarMember& member) const { return bytes(member.offset, member.size); }

 private:
  MappedFile file_;
  std::vector<TarMember> members_;
};

}  // namespace forge
