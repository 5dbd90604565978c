// Opening the files a user names (datasets, safetensors, config.json, tokenizers, report
// inputs, experiment files) only when they are regular files.
//
// NOTE [User files must be regular files]
// Opening a named pipe for reading blocks until a writer appears, and reading a device
// such as /dev/zero never ends: a typo or a hostile path would hang forge with no
// message. Every reader of a user file goes through open_regular_file, which opens with
// O_NONBLOCK (so even a FIFO's open returns at once), checks with fstat that the
// descriptor is a regular file, and only then clears O_NONBLOCK; the check and the read
// are on one descriptor, so the file cannot be swapped in between. Readers built on
// std::ifstream call require_regular_file first (a stat; the window before the ifstream
// opens is the only gap). No forge command reads user input from a pipe or standard
// input: `forge prep` takes regular files only (it sizes its inputs up front for progress,
// data/dataset_prep.cpp), so the rule has no exception.
#pragma once

#include <string>
#include <string_view>

namespace forge {

// Throws forge::Error "<path>: <what> is a named pipe, not a regular file" (or a directory,
// a device, a socket), or "<path>: cannot open <what>: <reason>".
void require_regular_file(const std::string& path, std::string_view what);

// A read-only descriptor of the regular file at `path` (the caller closes it); throws as
// require_regular_file does.
int open_regular_file(const std::string& path, std::string_view what);

// The whole regular file at `path`.
std::string read_regular_file(const std::string& path, std::string_view what);

}  // namespace forge
