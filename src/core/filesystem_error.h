// The message for a std::filesystem::filesystem_error that reaches the top of a command: the
// system refused a path forge was given or built from its input (a name longer than the
// system allows, no permission, a loop of symbolic links). Such an error is the user's to
// fix, not a bug in forge, so commands report it like any bad input: the path(s) and the
// system's reason, exit status 1.
#pragma once

#include <filesystem>
#include <string>

namespace forge {

// "'PATH': REASON" (or "'PATH1' -> 'PATH2': REASON" for a rename or copy).
std::string describe_filesystem_error(const std::filesystem::filesystem_error& error);

}  // namespace forge
