// MLLOG lines and their writer: NOTE [MLLOG line format] in mllog.h.
#include "train/mllog.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/error.h"

namespace forge::mllog {

const char* event_type_name(EventType type) {
  switch (type) {
    case EventType::kPoint: return "POINT_IN_TIME";
    case EventType::kIntervalStart: return "INTERVAL_START";
    case EventType::kIntervalEnd: return "INTERVAL_END";
  }
  return "POINT_IN_TIME";
}

namespace {

// Python's float repr (what json.dumps writes): the shortest digits that round-trip, in
// positional notation when the decimal exponent is in [-4, 16), else d.ddde+XX with at
// least two exponent digits; an integral value keeps ".0". json.dumps(allow_nan=True)
// spells the non-finite values as JavaScript does.
std::string python_float(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), x, std::chars_format::scientific);
  const std::string_view text(buffer, static_cast<size_t>(result.ptr - buffer));
  const size_t e_at = text.find('e');
  const bool negative = text.front() == '-';
  std::string digits;
  for (char c : text.substr(negative ? 1 : 0, e_at - (negative ? 1 : 0)))
    if (c != '.') digits += c;
  const int exponent = std::stoi(std::string(text.substr(e_at + 1)));
  const std::string_view sign = negative ? "-" : "";
  if (exponent >= 16 || exponent < -4)
    return fmt::format("{}{}{}{}e{}{:02d}", sign, digits.substr(0, 1), digits.size() > 1 ? "." : "",
                       digits.substr(1), exponent < 0 ? '-' : '+', std::abs(exponent));
  if (exponent < 0) return fmt::format("{}0.{}{}", sign, std::string(static_cast<size_t>(-exponent - 1), '0'), digits);
  const size_t int_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= int_digits)
    return fmt::format("{}{}{}.0", sign, digits, std::string(int_digits - digits.size(), '0'));
  return fmt::format("{}{}.{}", sign, digits.substr(0, int_digits), digits.substr(int_digits));
}

void dump_into(const Json& value, std::string& out) {
  if (value.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, v] : value.items()) {
      if (!first) out += ", ";
      first = false;
      out += Json(k).dump(-1, ' ', true);
      out += ": ";
      dump_into(v, out);
    }
    out += '}';
  } else if (value.is_array()) {
    out += '[';
    for (size_t i = 0; i < value.size(); ++i) {
      if (i) out += ", ";
      dump_into(value[i], out);
    }
    out += ']';
  } else if (value.is_number_float()) {
    out += python_float(value.get<double>());
  } else {
    out += value.dump(-1, ' ', true);
  }
}

int64_t system_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string dump_like_python(const Json& value) {
  std::string out;
  dump_into(value, out);
  return out;
}

std::string encode_line(const std::string& name_space, int64_t time_ms, EventType type, const std::string& key,
                        const Json& value, const Json& metadata) {
  Json line = Json::object();
  line["namespace"] = name_space;
  line["time_ms"] = time_ms;
  line["event_type"] = event_type_name(type);
  line["key"] = key;
  line["value"] = value;
  line["metadata"] = metadata;
  return kLineToken + dump_like_python(line);
}

std::string source_file_name(const char* file) {
  std::string_view path(file);
  for (const char* root : {"src/", "tests/"}) {
    if (path.starts_with(root)) return std::string(path);
    const size_t at = path.rfind(std::string("/") + root);
    if (at != std::string_view::npos) return std::string(path.substr(at + 1));
  }
  while (path.starts_with("../") || path.starts_with("./")) path.remove_prefix(path.find('/') + 1);
  return std::string(path);
}

Writer::Writer(std::string result_path, bool echo, std::string name_space, Clock clock)
    : path_(std::move(result_path)), echo_(echo), name_space_(std::move(name_space)), clock_(std::move(clock)) {
  if (!clock_) clock_ = system_ms;
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) FORGE_FAIL("MLLOG result file '{}': cannot open for appending: {}", path_, std::strerror(errno));
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
}

void Writer::event(const std::string& key, const Json& value, const Json& metadata, std::source_location where) {
  write(EventType::kPoint, key, value, metadata, where);
}
void Writer::start(const std::string& key, const Json& value, const Json& metadata, std::source_location where) {
  write(EventType::kIntervalStart, key, value, metadata, where);
}
void Writer::end(const std::string& key, const Json& value, const Json& metadata, std::source_location where) {
  write(EventType::kIntervalEnd, key, value, metadata, where);
}

void Writer::write(EventType type, const std::string& key, const Json& value, const Json& metadata,
                   const std::source_location& where) {
  FORGE_CHECK(metadata.is_null() || metadata.is_object(), "MLLOG metadata of '{}' must be a JSON object, got {}", key,
              metadata.dump());
  Json full = Json::object();
  full["file"] = source_file_name(where.file_name());
  full["lineno"] = static_cast<int64_t>(where.line());
  if (metadata.is_object())
    for (const auto& [k, v] : metadata.items()) full[k] = v;  // as mllog.py: the caller's keys override
  const std::string line = encode_line(name_space_, clock_(), type, key, value, full) + "\n";
  // One write(2) per line on an O_APPEND descriptor: NOTE [MLLOG line format].
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) FORGE_FAIL("MLLOG result file '{}': write failed: {}", path_, std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  if (echo_) {
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fflush(stdout);
  }
}

}  // namespace forge::mllog
