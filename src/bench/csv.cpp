// A one-pass CSV reader: a state machine over the characters (outside a field's quotes,
// inside them, just after a closing quote), counting lines as it goes so that errors can
// name the line a bad record starts on.
#include "bench/csv.h"

#include "core/error.h"

namespace forge {

std::vector<CsvRecord> parse_csv(std::string_view text, const std::string& file) {
  std::vector<CsvRecord> records;
  CsvRecord record;
  std::string field;
  bool in_quotes = false, after_quote = false, field_started = false;
  int line = 1, quote_line = 0;

  auto end_field = [&] {
    record.fields.push_back(std::move(field));
    field.clear();
    field_started = after_quote = false;
  };
  auto end_record = [&] {
    // A line with nothing on it is no record (Python's csv.reader skips it too).
    if (!record.fields.empty() || field_started) {
      end_field();
      records.push_back(std::move(record));
    }
    record = CsvRecord{};
  };

  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (record.fields.empty() && !field_started && record.line == 0) record.line = line;
    if (in_quotes) {
      if (c == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field += '"';
          ++i;
        } else {
          in_quotes = false;
          after_quote = true;
        }
      } else {
        if (c == '\n') ++line;
        field += c;
      }
      continue;
    }
    if (c == ',') {
      end_field();
      field_started = true;  // a comma always starts another field, even an empty last one
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      end_record();
      ++line;
    } else if (after_quote) {
      FORGE_FAIL("{}:{}: unexpected '{}' after the closing quote of a field (a quote inside a quoted field is "
                 "written as \"\")",
                 file, line, c);
    } else if (c == '"' && field.empty()) {
      in_quotes = field_started = true;
      quote_line = line;
    } else {
      field += c;
      field_started = true;
    }
  }
  if (in_quotes) FORGE_FAIL("{}:{}: a quoted field is never closed (no matching '\"' before the end)", file, quote_line);
  end_record();
  return records;
}

std::string csv_line(const std::vector<std::string>& fields) {
  std::string line;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) line += ',';
    const std::string& f = fields[i];
    if (f.find_first_of(",\"\r\n") == std::string::npos) {
      line += f;
      continue;
    }
    line += '"';
    for (char c : f) {
      if (c == '"') line += '"';
      line += c;
    }
    line += '"';
  }
  return line + "\n";
}

}  // namespace forge
