#include "data/npy_records.h"

#include <memory>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "data/mapped_file.h"
#include "data/npy_array.h"

namespace forge {

namespace {

struct Obj;
using Ref = std::shared_ptr<Obj>;

// An inert pickled value (NOTE [Pickled records without a Python] in npy_records.h).
struct Obj {
  enum class Kind { None, Bool, Int, Str, Bytes, Tuple, List, Dict, Global, Array, DType };
  Kind kind = Kind::None;
  int64_t i = 0;               // Bool, Int
  std::string s;               // Str; Global "module.name"; DType its name ("i4")
  std::string_view bytes;      // Bytes (a view of the mapped file)
  std::vector<Ref> items;      // Tuple; List items once one is not an int; Dict keys and values alternately
  std::vector<int64_t> ints;   // List: its items while all are ints (a million-token list stays compact)
  char order = '|';            // DType byte order, set by BUILD
  Ref dtype, state;            // Array: set by BUILD
  bool is_array_ready = false; // Array: BUILD done
};

Ref make(Obj::Kind kind) {
  auto obj = std::make_shared<Obj>();
  obj->kind = kind;
  return obj;
}

Ref make_int(int64_t value, Obj::Kind kind = Obj::Kind::Int) {
  Ref obj = make(kind);
  obj->i = value;
  return obj;
}

std::string_view kind_name(Obj::Kind kind) {
  switch (kind) {
    case Obj::Kind::None: return "None";
    case Obj::Kind::Bool: return "a bool";
    case Obj::Kind::Int: return "an int";
    case Obj::Kind::Str: return "a str";
    case Obj::Kind::Bytes: return "bytes";
    case Obj::Kind::Tuple: return "a tuple";
    case Obj::Kind::List: return "a list";
    case Obj::Kind::Dict: return "a dict";
    case Obj::Kind::Global: return "a global";
    case Obj::Kind::Array: return "an ndarray";
    case Obj::Kind::DType: return "a dtype";
  }
  return "?";
}

void list_append(Obj& list, Ref item) {
  if (list.items.empty() && item->kind == Obj::Kind::Int) {
    list.ints.push_back(item->i);
    return;
  }
  if (!list.ints.empty()) {
    for (int64_t v : list.ints) list.items.push_back(make_int(v));
    list.ints.clear();
  }
  list.items.push_back(std::move(item));
}

class Unpickler {
 public:
  Unpickler(std::string_view bytes, size_t base, const std::string& name) : in_(bytes), base_(base), name_(name) {}

  Ref run() {
    while (true) {
      op_offset_ = pos_;
      const uint8_t op = byte();
      switch (op) {
        case 0x80: (void)byte(); break;                        // PROTO
        case 0x95: (void)unsigned_le(8); break;                // FRAME: the frames' bytes follow inline
        case '.': {                                            // STOP
          if (stack_.size() != 1 || !marks_.empty()) fail("STOP with exactly one value on the stack");
          if (pos_ != in_.size())
            FORGE_FAIL("{}: byte offset {}: {} trailing bytes after the pickle's STOP", name_, base_ + pos_,
                       in_.size() - pos_);
          return stack_.back();
        }
        case '(': marks_.push_back(stack_.size()); break;      // MARK
        case 'N': push(make(Obj::Kind::None)); break;
        case 0x88: push(make_int(1, Obj::Kind::Bool)); break;  // NEWTRUE
        case 0x89: push(make_int(0, Obj::Kind::Bool)); break;  // NEWFALSE
        case 'J': push(make_int(static_cast<int32_t>(unsigned_le(4)))); break;  // BININT
        case 'K': push(make_int(static_cast<int64_t>(unsigned_le(1)))); break;  // BININT1
        case 'M': push(make_int(static_cast<int64_t>(unsigned_le(2)))); break;  // BININT2
        case 0x8a: {                                                            // LONG1
          const size_t n = static_cast<size_t>(unsigned_le(1));
          if (n > 8) fail("an int of at most 8 bytes");
          uint64_t raw = unsigned_le(n);
          if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) raw |= ~uint64_t{0} << (8 * n);  // sign-extend
          push(make_int(static_cast<int64_t>(raw)));
          break;
        }
        case 0x8c: push(text(Obj::Kind::Str, unsigned_le(1))); break;  // SHORT_BINUNICODE
        case 'X': push(text(Obj::Kind::Str, unsigned_le(4))); break;   // BINUNICODE
        case 0x8d: push(text(Obj::Kind::Str, unsigned_le(8))); break;  // BINUNICODE8
        case 'U': push(text(Obj::Kind::Str, unsigned_le(1))); break;   // SHORT_BINSTRING (protocol 2 str)
        case 'T': push(text(Obj::Kind::Str, unsigned_le(4))); break;   // BINSTRING
        case 'C': push(text(Obj::Kind::Bytes, unsigned_le(1))); break; // SHORT_BINBYTES
        case 'B': push(text(Obj::Kind::Bytes, unsigned_le(4))); break; // BINBYTES
        case 0x8e: push(text(Obj::Kind::Bytes, unsigned_le(8))); break;// BINBYTES8
        case ')': push(make(Obj::Kind::Tuple)); break;                 // EMPTY_TUPLE
        case 't': push(tuple(pop_mark())); break;                      // TUPLE
        case 0x85: case 0x86: case 0x87: {                             // TUPLE1..3
          const size_t n = op - 0x84u;
          if (stack_.size() < n + floor()) fail(fmt::format("{} values on the stack", n));
          std::vector<Ref> items(stack_.end() - static_cast<ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(tuple(std::move(items)));
          break;
        }
        case ']': push(make(Obj::Kind::List)); break;                  // EMPTY_LIST
        case '}': push(make(Obj::Kind::Dict)); break;                  // EMPTY_DICT
        case 'a': {                                                    // APPEND
          Ref item = pop();
          list_append(expect(top(), Obj::Kind::List), std::move(item));
          break;
        }
        case 'e': {                                                    // APPENDS
          std::vector<Ref> items = pop_mark();
          Obj& list = expect(top(), Obj::Kind::List);
          for (Ref& item : items) list_append(list, std::move(item));
          break;
        }
        case 's': {                                                    // SETITEM
          Ref value = pop(), key = pop();
          Obj& dict = expect(top(), Obj::Kind::Dict);
          dict.items.push_back(std::move(key));
          dict.items.push_back(std::move(value));
          break;
        }
        case 'u': {                                                    // SETITEMS
          std::vector<Ref> items = pop_mark();
          if (items.size() % 2 != 0) fail("keys and values in pairs");
          Obj& dict = expect(top(), Obj::Kind::Dict);
          for (Ref& item : items) dict.items.push_back(std::move(item));
          break;
        }
        case 'c': {                                                    // GLOBAL "module\nname\n"
          std::string module = line(), qualname = line();
          push(global(module, qualname));
          break;
        }
        case 0x93: {                                                   // STACK_GLOBAL
          Ref qualname = pop(), module = pop();
          if (module->kind != Obj::Kind::Str || qualname->kind != Obj::Kind::Str) fail("a module and a name (str)");
          push(global(module->s, qualname->s));
          break;
        }
        case 'q': memo_[unsigned_le(1)] = top_ref(); break;            // BINPUT
        case 'r': memo_[unsigned_le(4)] = top_ref(); break;            // LONG_BINPUT
        case 0x94: {                                                   // MEMOIZE
          const uint64_t index = memo_.size();
          memo_[index] = top_ref();
          break;
        }
        case 'h': push(memo_get(unsigned_le(1))); break;               // BINGET
        case 'j': push(memo_get(unsigned_le(4))); break;               // LONG_BINGET
        case 'R': {                                                    // REDUCE
          Ref args = pop(), callable = pop();
          push(reduce(*callable, expect(*args, Obj::Kind::Tuple)));
          break;
        }
        case 'b': {                                                    // BUILD
          Ref state = pop();
          build(top(), std::move(state));
          break;
        }
        default:
          FORGE_FAIL("{}: byte offset {}: pickle opcode 0x{:02x} is not one numpy.save writes for an array of "
                     "records (NOTE [Pickled records without a Python])",
                     name_, base_ + op_offset_, op);
      }
    }
  }

  [[noreturn]] void fail(std::string_view expected) const {
    FORGE_FAIL("{}: byte offset {}: pickle opcode 0x{:02x}: expected {}", name_, base_ + op_offset_,
               static_cast<uint8_t>(in_[op_offset_]), expected);
  }

 private:
  uint8_t byte() {
    if (pos_ >= in_.size())
      FORGE_FAIL("{}: byte offset {}: the pickle ends before its STOP opcode: truncated", name_, base_ + pos_);
    return static_cast<uint8_t>(in_[pos_++]);
  }
  uint64_t unsigned_le(size_t n) {
    if (in_.size() - pos_ < n)
      FORGE_FAIL("{}: byte offset {}: expected {} bytes of an operand, found the end of the file", name_,
                 base_ + pos_, n);
    uint64_t value = 0;
    for (size_t i = 0; i < n; ++i) value |= static_cast<uint64_t>(static_cast<uint8_t>(in_[pos_ + i])) << (8 * i);
    pos_ += n;
    return value;
  }
  Ref text(Obj::Kind kind, uint64_t length) {
    if (length > in_.size() - pos_)
      FORGE_FAIL("{}: byte offset {}: a {}-byte string runs past the end of the file", name_, base_ + op_offset_,
                 length);
    Ref obj = make(kind);
    const std::string_view view = in_.substr(pos_, static_cast<size_t>(length));
    if (kind == Obj::Kind::Bytes) obj->bytes = view;
    else obj->s = std::string(view);
    pos_ += static_cast<size_t>(length);
    return obj;
  }
  std::string line() {
    const size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) fail("a line ended by '\\n'");
    std::string out(in_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return out;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(Ref obj) { stack_.push_back(std::move(obj)); }
  Ref pop() {
    if (stack_.size() <= floor()) fail("a value on the stack");
    Ref obj = std::move(stack_.back());
    stack_.pop_back();
    return obj;
  }
  Ref top_ref() {
    if (stack_.size() <= floor()) fail("a value on the stack");
    return stack_.back();
  }
  Obj& top() { return *top_ref(); }
  std::vector<Ref> pop_mark() {
    if (marks_.empty()) fail("a MARK before it");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Ref> items(stack_.begin() + static_cast<ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }
  Obj& expect(Obj& obj, Obj::Kind kind) {
    if (obj.kind != kind) fail(fmt::format("{}, found {}", kind_name(kind), kind_name(obj.kind)));
    return obj;
  }
  Ref memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail(fmt::format("memo entry {} to have been stored", index));
    return it->second;
  }
  static Ref tuple(std::vector<Ref> items) {
    Ref obj = make(Obj::Kind::Tuple);
    obj->items = std::move(items);
    return obj;
  }
  Ref global(const std::string& module, const std::string& qualname) {
    const std::string full = module + "." + qualname;
    if (full != "numpy.core.multiarray._reconstruct" && full != "numpy._core.multiarray._reconstruct" &&
        full != "numpy.ndarray" && full != "numpy.dtype")
      FORGE_FAIL("{}: byte offset {}: the pickle names the global '{}': forge decodes only numpy arrays "
                 "(numpy.core.multiarray._reconstruct, numpy.ndarray, numpy.dtype) and never runs a pickle",
                 name_, base_ + op_offset_, full);
    Ref obj = make(Obj::Kind::Global);
    obj->s = full.ends_with("_reconstruct") ? "_reconstruct" : full;
    return obj;
  }
  Ref reduce(const Obj& callable, const Obj& args) {
    if (callable.kind != Obj::Kind::Global) fail(fmt::format("a global to call, found {}", kind_name(callable.kind)));
    if (callable.s == "_reconstruct") {  // _reconstruct(numpy.ndarray, shape, typecode): an empty array
      if (args.items.size() != 3 || args.items[0]->kind != Obj::Kind::Global || args.items[0]->s != "numpy.ndarray")
        fail("_reconstruct(numpy.ndarray, shape, typecode)");
      return make(Obj::Kind::Array);
    }
    if (callable.s == "numpy.dtype") {  // dtype(name, align, copy)
      if (args.items.empty() || args.items[0]->kind != Obj::Kind::Str) fail("numpy.dtype(name, ...)");
      Ref obj = make(Obj::Kind::DType);
      obj->s = args.items[0]->s;
      return obj;
    }
    fail("_reconstruct or numpy.dtype to be called");
  }
  void build(Obj& obj, Ref state) {
    const Obj& st = expect(*state, Obj::Kind::Tuple);
    if (obj.kind == Obj::Kind::DType) {  // (version, byte order, subarray, names, fields, ...)
      if (st.items.size() < 2 || st.items[1]->kind != Obj::Kind::Str || st.items[1]->s.size() != 1)
        fail("a dtype state (version, byte order, ...)");
      obj.order = st.items[1]->s[0];
      return;
    }
    if (obj.kind != Obj::Kind::Array || obj.is_array_ready) fail("an unbuilt ndarray or a dtype to BUILD");
    // (version, shape, dtype, fortran_order, data): data is bytes, or a list for objects.
    if (st.items.size() != 5 || st.items[1]->kind != Obj::Kind::Tuple || st.items[2]->kind != Obj::Kind::DType)
      fail("an ndarray state (version, shape, dtype, fortran_order, data)");
    obj.dtype = st.items[2];
    obj.state = std::move(state);
    obj.is_array_ready = true;
  }

  std::string_view in_;
  size_t base_, pos_ = 0, op_offset_ = 0;
  const std::string& name_;
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ref> memo_;
};

// Converts a record field (a 1-d integer ndarray, or a list of ints/bools) to int64s.
std::vector<int64_t> field_values(const Obj& value, const std::string& where) {
  if (value.kind == Obj::Kind::List) {
    if (value.items.empty()) return value.ints;
    std::vector<int64_t> out;
    for (const Ref& item : value.items) {
      if (item->kind != Obj::Kind::Int && item->kind != Obj::Kind::Bool)
        FORGE_FAIL("{}: expected a list of ints, found {} in it", where, kind_name(item->kind));
      out.push_back(item->i);
    }
    return out;
  }
  if (value.kind != Obj::Kind::Array || !value.is_array_ready)
    FORGE_FAIL("{}: expected a 1-d integer ndarray or a list of ints, found {}", where, kind_name(value.kind));
  const auto& st = value.state->items;
  const std::string descr = std::string(1, value.dtype->order) + value.dtype->s;
  NpyHeader header;
  if (!parse_npy_descr(descr, header))
    FORGE_FAIL("{}: an ndarray of dtype '{}': expected a 1-d integer array (b1, i1, u1, i2, u2, i4, u4, i8, u8)",
               where, descr);
  const auto& shape = st[1]->items;
  if (shape.size() != 1 || shape[0]->kind != Obj::Kind::Int || shape[0]->i < 0)
    FORGE_FAIL("{}: expected a 1-d ndarray, found one of {} dimensions", where, shape.size());
  if (st[3]->kind != Obj::Kind::Bool || st[3]->i != 0)
    FORGE_FAIL("{}: expected a C-order ndarray (fortran_order False)", where);
  if (st[4]->kind != Obj::Kind::Bytes)
    FORGE_FAIL("{}: expected the ndarray's data as bytes, found {}", where, kind_name(st[4]->kind));
  const uint64_t n = static_cast<uint64_t>(shape[0]->i);
  const std::string_view data = st[4]->bytes;
  if (n > data.size() / header.item_size || n * header.item_size != data.size())
    FORGE_FAIL("{}: an ndarray of {} '{}' elements holds {} bytes of data, expected {}", where, n, descr, data.size(),
               n * header.item_size);
  std::vector<int64_t> out(n);
  const auto* base = reinterpret_cast<const uint8_t*>(data.data());
  for (uint64_t k = 0; k < n; ++k)
    if (!load_npy_element(base + k * header.item_size, header, &out[k]))
      FORGE_FAIL("{}: element {} is above 2^63 - 1", where, k);
  return out;
}

}  // namespace

int64_t read_npy_records(const std::string& path, const std::function<void(int64_t, const NpyRecord&)>& visit) {
  MappedFile file(path);
  const std::string_view bytes(reinterpret_cast<const char*>(file.data()), file.size());
  const NpyHeader header = parse_npy_header(bytes, path, true);
  if (header.kind != NpyKind::Object)
    FORGE_FAIL("{}: 'descr' is '{}': expected '|O', an array of records (dicts) as numpy.save writes a list of dicts",
               path, header.descr);
  if (header.shape.size() != 1)
    FORGE_FAIL("{}: shape ({}): expected a 1-d array of records", path, fmt::join(header.shape, ", "));
  Unpickler unpickler(bytes.substr(header.data_offset), header.data_offset, path);
  const Ref root = unpickler.run();
  if (root->kind != Obj::Kind::Array || !root->is_array_ready || root->dtype->s.empty() || root->dtype->s[0] != 'O')
    FORGE_FAIL("{}: the pickle holds {}: expected the object ndarray the header declares", path,
               kind_name(root->kind));
  const auto& st = root->state->items;
  if (st[1]->items.size() != 1 || st[1]->items[0]->kind != Obj::Kind::Int || st[1]->items[0]->i != header.shape[0])
    FORGE_FAIL("{}: the pickled array's shape disagrees with the header's ({},)", path, header.shape[0]);
  if (st[4]->kind != Obj::Kind::List)
    FORGE_FAIL("{}: the pickled object array's elements: expected a list, found {}", path, kind_name(st[4]->kind));
  const Obj& elements = *st[4];
  const int64_t count = static_cast<int64_t>(elements.items.empty() ? elements.ints.size() : elements.items.size());
  if (count != header.shape[0])
    FORGE_FAIL("{}: the header declares {} records, the pickle holds {}", path, header.shape[0], count);
  for (int64_t r = 0; r < count; ++r) {
    if (elements.items.empty()) FORGE_FAIL("{}: record {}: expected a dict, found an int", path, r);
    const Obj& dict = *elements.items[static_cast<size_t>(r)];
    if (dict.kind != Obj::Kind::Dict)
      FORGE_FAIL("{}: record {}: expected a dict, found {}", path, r, kind_name(dict.kind));
    NpyRecord record;
    for (size_t k = 0; k + 1 < dict.items.size(); k += 2) {
      if (dict.items[k]->kind != Obj::Kind::Str)
        FORGE_FAIL("{}: record {}: expected str keys, found {}", path, r, kind_name(dict.items[k]->kind));
      const std::string& key = dict.items[k]->s;
      record[key] = field_values(*dict.items[k + 1], fmt::format("{}: record {} '{}'", path, r, key));
    }
    visit(r, record);
  }
  return count;
}

}  // namespace forge
