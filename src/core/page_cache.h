// Evicting files from the operating system's page cache, so that the next read comes from
// the storage device: what MLPerf submissions do before each run with `sync; echo 3 >
// /proc/sys/vm/drop_caches` (the log's cache_clear), limited to the files a run reads and
// without root. posix_fadvise(POSIX_FADV_DONTNEED) drops a file's clean cached pages; the
// kernel may keep pages another process has mapped or locked.
#pragma once

#include <string>
#include <vector>

namespace forge {

// Evicts each regular file of `paths` (a directory: its regular files, not recursing);
// paths that do not exist are skipped. Returns how many files were evicted; throws
// forge::Error naming the file when one cannot be opened or advised.
int evict_from_page_cache(const std::vector<std::string>& paths);

}  // namespace forge
