// CSV as RFC 4180 and Python's csv module write it, for perf.csv: fields separated by
// commas; a field holding a comma, a double quote, CR or LF is wrapped in double quotes,
// with each double quote inside doubled. A quoted field may span lines. Lines end in LF
// (CRLF is read too); blank lines are skipped, as Python's csv.reader skips them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace forge {

struct CsvRecord {
  int line = 0;  // 1-based line where the record starts, for messages
  std::vector<std::string> fields;
};

// Every record of `text`. Throws forge::Error "<file>:<line>: ..." on a quote that is never
// closed or text right after a closing quote ("ab"c).
std::vector<CsvRecord> parse_csv(std::string_view text, const std::string& file);

// One record as a line, quoting only the fields that need it, ending in "\n".
std::string csv_line(const std::vector<std::string>& fields);

}  // namespace forge
