#include "data/oniguruma_pattern.h"

#include <fmt/format.h>

#include <optional>
#include <vector>

#include "core/error.h"
#include "data/pcre2_class.h"
#include "data/unicode_classes.h"
#include "data/utf8.h"

namespace forge {
namespace {

constexpr size_t kNoAtom = std::string::npos;
// PCRE2's nearest native classes to \w (NOTE [Exact classes at native speed]).
constexpr const char* kWordNatives = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";

bool is_ascii_alnum(char c) { return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z'); }
bool is_ascii_letter(char32_t c) { return c < 0x80 && ((c | 0x20) >= 'a' && (c | 0x20) <= 'z'); }

// Pairs of ASCII letters that Oniguruma's case folding also matches as one character
// (ss: ß ẞ, st: ﬅ ﬆ, ff: ﬀ, fi: ﬁ, fl: ﬂ; ﬃ and ﬄ contain ff).
bool folds_to_one_character(char first, char second) {
  return (first == 's' && (second == 's' || second == 't')) ||
         (first == 'f' && (second == 'f' || second == 'i' || second == 'l'));
}

// A class escape (\s, \W, \p{L}, ...): the positive class and whether it is negated.
struct ClassEscape {
  ClassItem item;
  bool negated;
};

ClassItem class_item(const ClassEscape& escape) {
  if (!escape.negated) return escape.item;
  const std::string& native = escape.item.native;
  // Only a single \p{..} has a native complement (\P{..}).
  const bool single = native.starts_with("\\p{") && native.find('\\', 1) == std::string::npos;
  return {escape.item.set.complement(), single ? "\\P" + native.substr(2) : ""};
}

struct ParsedClass {
  std::vector<ClassItem> items;
  bool negated = false;
};

class Translator {
 public:
  Translator(std::string_view pattern, const std::string& file, const std::string& where)
      : pattern_(pattern), file_(file), where_(where) {
    groups_.push_back({});
  }

  std::string run() {
    while (pos_ < pattern_.size()) step();
    if (groups_.size() > 1) invalid("a ( without its )", groups_.back().pattern_offset);
    out_.append(groups_.back().implicit_groups, ')');
    return out_;
  }

 private:
  struct Flags {
    bool case_insensitive = false, dot_all = false;
  };
  // An open group. An option written alone, a(?i)b|c, opens an implicit group that closes
  // with the group around it (Oniguruma reads it as a(?i:b|c)).
  struct Group {
    Flags outer;
    size_t pattern_offset = 0, out_offset = 0;
    int implicit_groups = 0;
  };
  // How the last atom is repeated, for what a following quantifier character means.
  enum class Repeat { None, Greedy, Interval, FixedInterval, Final };

  [[noreturn]] void invalid(std::string_view what, size_t at) const {
    FORGE_FAIL("{}: {}: invalid regex '{}' at offset {}: {}", file_, where_, pattern_, at, what);
  }
  [[noreturn]] void unsupported(std::string_view what, size_t at) const {
    FORGE_FAIL("{}: {}: regex '{}' at offset {}: forge does not support {} (NOTE [Oniguruma patterns in PCRE2])",
               file_, where_, pattern_, at, what);
  }

  char peek(size_t ahead = 0) const { return pos_ + ahead < pattern_.size() ? pattern_[pos_ + ahead] : '\0'; }
  bool consume(char c) {
    if (pos_ >= pattern_.size() || pattern_[pos_] != c) return false;
    ++pos_;
    return true;
  }

  char32_t next_code_point() {
    const int32_t c = utf8::code_point_at(pattern_, pos_);
    if (c < 0) invalid("a byte that is not UTF-8", pos_);
    pos_ += utf8::unit_length(pattern_, pos_);
    return static_cast<char32_t>(c);
  }

  void step() {
    const size_t at = pos_;
    switch (pattern_[pos_]) {
      case '\\':
        escape();
        break;
      case '[': {
        ++pos_;
        require_case_sensitive("a character class", at);
        const ParsedClass parsed = parse_class(at);
        begin_atom();
        out_ += pcre2_class(parsed.items, parsed.negated);
        break;
      }
      case '(':
        open_group();
        break;
      case ')':
        close_group();
        break;
      case '|':
        ++pos_;
        out_ += '|';
        no_atom();
        break;
      case '*':
      case '+':
      case '?':
        ++pos_;
        quantifier(std::string(1, pattern_[at]), at);
        break;
      case '{':
        if (!interval()) {
          ++pos_;
          literal('{', at);
        }
        break;
      case '.':
        ++pos_;
        begin_atom();
        out_ += flags_.dot_all ? "(?s:.)" : "\\N";
        break;
      case '^':
      case '$':
        ++pos_;
        no_atom();
        out_ += pattern_[at];
        break;
      default:
        literal(next_code_point(), at);
    }
  }

  void begin_atom() {
    atom_start_ = out_.size();
    repeat_ = Repeat::None;
    previous_letter_ = '\0';
  }
  void no_atom() {
    atom_start_ = kNoAtom;
    previous_letter_ = '\0';
  }

  void require_case_sensitive(std::string_view what, size_t at) const {
    if (flags_.case_insensitive)
      unsupported(fmt::format("{} in a case-insensitive group (only ASCII literals there)", what), at);
  }

  void literal(char32_t c, size_t at) {
    char letter = '\0';
    if (flags_.case_insensitive) {
      if (c >= 0x80) unsupported("a non-ASCII character in a case-insensitive group", at);
      if (is_ascii_letter(c)) {
        letter = static_cast<char>(c | 0x20);
        if (previous_letter_ && folds_to_one_character(previous_letter_, letter))
          unsupported(fmt::format("case-insensitive \"{}{}\", which Oniguruma also matches as one character",
                                  previous_letter_, letter),
                      at);
      }
    }
    begin_atom();
    previous_letter_ = letter;
    if (c < 0x80 && std::string_view("\\^$.[]|()?*+{}").find(static_cast<char>(c)) != std::string_view::npos) {
      out_ += '\\';
      out_ += static_cast<char>(c);
    } else if (c > 0x20 && c < 0x7F) {
      out_ += static_cast<char>(c);
    } else {
      out_ += fmt::format("\\x{{{:X}}}", static_cast<uint32_t>(c));
    }
  }

  // The character of \t, \n, \xHH, \x{H..}, \uHHHH, \0oo, ... (pos_ is after the letter).
  char32_t escaped_code_point(char letter, size_t at) {
    auto digits = [&](int base, size_t most) {
      uint64_t value = 0;
      size_t count = 0;
      for (; count < most; ++count) {
        const char c = peek(), lower = static_cast<char>(c | 0x20);
        const int digit = c >= '0' && c <= '9' ? c - '0' : lower >= 'a' && lower <= 'f' ? lower - 'a' + 10 : 99;
        if (digit >= base) break;
        value = value * base + digit;
        ++pos_;
      }
      return std::pair{value, count};
    };
    uint64_t value = 0;
    switch (letter) {
      case 't': return '\t';
      case 'n': return '\n';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case 'a': return '\a';
      case 'e': return 0x1B;
      case '0': return static_cast<char32_t>(digits(8, 2).first);
      case 'x': {
        const bool braced = consume('{');
        auto [number, count] = digits(16, braced ? 8 : 2);
        if (count == 0 || (braced && !consume('}'))) invalid("\\x without hex digits", at);
        value = number;
        break;
      }
      case 'u': {
        auto [number, count] = digits(16, 4);
        if (count != 4) invalid("\\u without four hex digits", at);
        value = number;
        break;
      }
      default:
        if (letter >= '1' && letter <= '9') unsupported("backreferences and octal escapes", at);
        unsupported(fmt::format("the escape \\{}", letter), at);
    }
    if (value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF))
      invalid("an escape that is not a Unicode scalar value", at);
    return static_cast<char32_t>(value);
  }

  // \s \S \w \W \d \D \h \H \p{..} \P{..} (pos_ is after the letter), or nullopt.
  std::optional<ClassEscape> class_escape(char letter, size_t at, bool in_class) {
    switch (letter) {
      case 's':
      case 'S':
        return ClassEscape{{unicode::regex_space(), ""}, letter == 'S'};
      case 'w':
      case 'W':
        return ClassEscape{{unicode::regex_word(in_class), kWordNatives}, letter == 'W'};
      case 'd':
      case 'D':
        return ClassEscape{{unicode::regex_digit(), "\\p{Nd}"}, letter == 'D'};
      case 'h':
      case 'H': {
        CodePointSet hex;
        hex.add('0', '9');
        hex.add('A', 'F');
        hex.add('a', 'f');
        return ClassEscape{{hex, ""}, letter == 'H'};
      }
      case 'p':
      case 'P':
        return property(letter == 'P', at);
      default:
        return std::nullopt;
    }
  }

  ClassEscape property(bool negated, size_t at) {
    if (!consume('{')) unsupported("\\p or \\P without {name}", at);
    if (consume('^')) negated = !negated;
    const size_t close = pattern_.find('}', pos_);
    if (close == std::string_view::npos) invalid("\\p{ without }", at);
    const std::string name(pattern_.substr(pos_, close - pos_));
    pos_ = close + 1;
    auto set = unicode::property(name);
    if (!set)
      unsupported(fmt::format("the property \\p{{{}}} (only general categories by short name, L Lu Ll Lt Lm Lo LC "
                              "M Mn Mc Me N Nd Nl No P Pc Pd Ps Pe Pi Pf Po S Sm Sc Sk So Z Zs Zl Zp C Cc Cf Cs "
                              "Co Cn, and Any)",
                              name),
                  at);
    std::string native;
    if (name == "LC") {
      native = "\\p{Lu}\\p{Ll}\\p{Lt}";
    } else if (name != "Any" && name != "Cs") {
      native = "\\p{" + name + "}";
    }
    return {{std::move(*set), std::move(native)}, negated};
  }

  void escape() {
    const size_t at = pos_++;
    if (pos_ >= pattern_.size()) invalid("a \\ at the end", at);
    const char letter = pattern_[pos_];
    if (!is_ascii_alnum(letter)) {
      literal(next_code_point(), at);
      return;
    }
    ++pos_;
    if (letter == 'b' || letter == 'B') {
      require_case_sensitive("\\b", at);
      no_atom();
      out_ += word_boundary(letter == 'B');
    } else if (letter == 'A' || letter == 'z' || letter == 'Z') {
      no_atom();
      out_ += '\\';
      out_ += letter;
    } else if (letter == 'R') {
      begin_atom();
      out_ += "(?>\\r\\n|[\\n\\x0B\\f\\r\\x{85}\\x{2028}\\x{2029}])";
    } else if (letter == 'N' || letter == 'O') {
      begin_atom();
      out_ += letter == 'N' ? "\\N" : "(?s:.)";
    } else if (auto escape = class_escape(letter, at, false)) {
      require_case_sensitive(fmt::format("\\{}", letter), at);
      begin_atom();
      out_ += pcre2_class({escape->item}, escape->negated);
    } else {
      literal(escaped_code_point(letter, at), at);
    }
  }

  std::string word_boundary(bool negated) const {
    const std::string word = pcre2_class({{unicode::regex_word(false), kWordNatives}}, false);
    const std::string after = "(?<=" + word + ")", not_after = "(?<!" + word + ")";
    const std::string before = "(?=" + word + ")", not_before = "(?!" + word + ")";
    return negated ? "(?:" + after + before + "|" + not_after + not_before + ")"
                   : "(?:" + after + not_before + "|" + not_after + before + ")";
  }

  // A class after its [ (at `open`): items, ranges, escapes, nested classes, && intersections.
  ParsedClass parse_class(size_t open) {
    ParsedClass parsed;
    parsed.negated = consume('^');
    std::vector<ClassItem> operand;
    std::optional<CodePointSet> intersected;
    for (bool first = true;; first = false) {
      if (pos_ >= pattern_.size()) invalid("a [ without its ]", open);
      const size_t at = pos_;
      if (peek() == ']' && !first) {
        ++pos_;
        break;
      }
      if (peek() == '&' && peek(1) == '&') {
        pos_ += 2;
        const CodePointSet left = class_set(operand, false);
        intersected = intersected ? intersected->intersection(left) : left;
        operand.clear();
      } else if (peek() == '[') {
        if (peek(1) == ':') unsupported("POSIX bracket expressions ([:alpha:])", at);
        ++pos_;
        const ParsedClass nested = parse_class(at);
        operand.push_back({class_set(nested.items, nested.negated), ""});
      } else if (auto escape = class_atom_escape()) {
        if (peek() == '-' && peek(1) != ']') invalid("a range that starts at a class", pos_);
        operand.push_back(class_item(*escape));
      } else {
        const char32_t low = class_atom_code_point();
        CodePointSet range;
        if (peek() == '-' && peek(1) != ']' && peek(1) != '[' && pos_ + 1 < pattern_.size()) {
          const size_t dash = pos_++;
          if (class_atom_escape()) invalid("a range that ends at a class", dash);
          const char32_t high = class_atom_code_point();
          if (high < low) invalid("a range whose end comes before its start", at);
          range.add(low, high);
        } else {
          range.add(low);
        }
        operand.push_back({range, ""});
      }
    }
    if (intersected) parsed.items = {{intersected->intersection(class_set(operand, false)), ""}};
    else parsed.items = std::move(operand);
    return parsed;
  }

  // A class escape at pos_ inside a class (consumed), or nullopt (nothing consumed).
  std::optional<ClassEscape> class_atom_escape() {
    if (peek() != '\\' || !is_ascii_alnum(peek(1))) return std::nullopt;
    const size_t at = pos_;
    pos_ += 2;
    if (auto escape = class_escape(pattern_[at + 1], at, true)) return escape;
    pos_ = at;
    return std::nullopt;
  }

  // One character inside a class: itself or an escape (\b is backspace here).
  char32_t class_atom_code_point() {
    const size_t at = pos_;
    if (!consume('\\')) return next_code_point();
    if (pos_ >= pattern_.size()) invalid("a \\ at the end", at);
    const char letter = pattern_[pos_];
    if (!is_ascii_alnum(letter)) return next_code_point();
    ++pos_;
    return letter == 'b' ? '\b' : escaped_code_point(letter, at);
  }

  void open_group() {
    const size_t at = pos_++;
    if (!consume('?')) return push_group(at, "(?:", flags_);
    const char kind = peek();
    if (kind == ':' || kind == '=' || kind == '!' || kind == '>') {
      ++pos_;
      return push_group(at, kind == ':' ? "(?:" : std::string("(?") + kind, flags_);
    }
    if (kind == '<' && (peek(1) == '=' || peek(1) == '!')) {
      pos_ += 2;
      return push_group(at, std::string("(?<") + pattern_[pos_ - 1], flags_);
    }
    if (kind == '<' || kind == '\'') {
      const size_t end = pattern_.find(kind == '<' ? '>' : '\'', pos_ + 1);
      if (end == std::string_view::npos) invalid("a group name without its end", at);
      pos_ = end + 1;
      return push_group(at, "(?:", flags_);
    }
    if (kind == '#') {
      const size_t end = pattern_.find(')', pos_);
      if (end == std::string_view::npos) invalid("a (?# comment without its )", at);
      pos_ = end + 1;
      return;
    }
    options(at);
  }

  // (?im-im) or (?im-im:...) after its "(?".
  void options(size_t at) {
    Flags flags = flags_;
    bool on = true;
    for (;; ++pos_) {
      const char c = peek();
      if (c == 'i') {
        flags.case_insensitive = on;
      } else if (c == 'm') {
        flags.dot_all = on;
      } else if (c == '-' && on) {
        on = false;
      } else if (c == ':' || c == ')') {
        break;
      } else if (c == '\0' && pos_ >= pattern_.size()) {
        invalid("a ( without its )", at);
      } else {
        unsupported(fmt::format("the group (?{}", c), at);
      }
    }
    const std::string opening = flags.case_insensitive == flags_.case_insensitive ? "(?:"
                                : flags.case_insensitive                           ? "(?i:"
                                                                                   : "(?-i:";
    if (pattern_[pos_++] == ':') return push_group(at, opening, flags);
    out_ += opening;
    ++groups_.back().implicit_groups;
    flags_ = flags;
    no_atom();
  }

  void push_group(size_t at, const std::string& opening, Flags inner) {
    groups_.push_back({flags_, at, out_.size(), 0});
    out_ += opening;
    flags_ = inner;
    no_atom();
  }

  void close_group() {
    const size_t at = pos_++;
    if (groups_.size() == 1) invalid("a ) without its (", at);
    const Group group = groups_.back();
    groups_.pop_back();
    out_.append(group.implicit_groups + 1, ')');
    flags_ = group.outer;
    begin_atom();
    atom_start_ = group.out_offset;
  }

  // {n}, {n,}, {,m} or {n,m} at pos_: applied and true, or false for a literal {.
  bool interval() {
    const size_t at = pos_;
    size_t end = at + 1;
    auto number = [&]() -> std::optional<uint64_t> {
      const size_t start = end;
      uint64_t value = 0;
      while (end < pattern_.size() && pattern_[end] >= '0' && pattern_[end] <= '9' && end - start < 9)
        value = value * 10 + (pattern_[end++] - '0');
      return end > start ? std::optional(value) : std::nullopt;
    };
    const auto low = number();
    const bool comma = end < pattern_.size() && pattern_[end] == ',';
    if (comma) ++end;
    const auto high = comma ? number() : low;
    if ((!low && !high) || end >= pattern_.size() || pattern_[end] != '}') return false;
    pos_ = end + 1;
    if (low && high && *high < *low) invalid("a repeat whose maximum is below its minimum", at);
    std::string text = fmt::format("{{{}", low.value_or(0));
    if (comma) text += high ? fmt::format(",{}}}", *high) : ",}";
    else text += "}";
    quantifier(text, at);
    return true;
  }

  // Applies a quantifier (*, +, ?, or a normalized {..}) to the last atom. After a greedy
  // *, + or ? a ? makes it lazy and a + possessive; after {n,m} a ? makes it lazy;
  // anything else repeats the repeat, as Oniguruma reads it.
  void quantifier(const std::string& text, size_t at) {
    if (atom_start_ == kNoAtom) invalid("a quantifier with nothing to repeat", at);
    previous_letter_ = '\0';
    const bool modifier = (text == "?" && (repeat_ == Repeat::Greedy || repeat_ == Repeat::Interval)) ||
                          (text == "+" && repeat_ == Repeat::Greedy);
    if (modifier) {
      out_ += text;
      repeat_ = Repeat::Final;
      return;
    }
    if (repeat_ != Repeat::None) {
      out_.insert(atom_start_, "(?:");
      out_ += ')';
    }
    out_ += text;
    repeat_ = text.size() == 1                          ? Repeat::Greedy
              : text.find(',') == std::string::npos ? Repeat::FixedInterval
                                                        : Repeat::Interval;
  }

  std::string_view pattern_;
  const std::string& file_;
  const std::string& where_;
  size_t pos_ = 0;
  std::string out_;
  Flags flags_;
  std::vector<Group> groups_;  // groups_[0] is the whole pattern
  size_t atom_start_ = kNoAtom;
  Repeat repeat_ = Repeat::None;
  char previous_letter_ = '\0';  // the last atom, when a letter in a case-insensitive group
};

}  // namespace

std::string oniguruma_to_pcre2(std::string_view pattern, const std::string& file, const std::string& where) {
  return Translator(pattern, file, where).run();
}

}  // namespace forge
