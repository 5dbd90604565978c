#include "data/npy_records.h"

#include <memory>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "data/mapped_file.h"
#include "data/npy_array.h"

namespace forge {

namespace {

// An inert pickled value (NOTE [Pickled records without a Python] in npy_records.h):
// None, bools and ints inline, everything else an Obj owned by the Unpickler's arena (so
// that a pickle referencing a container from inside itself, a cycle, leaks nothing).
struct Obj;
enum class Kind { None, Bool, Int, Str, Bytes, Tuple, List, Dict, Global, Array, DType };
struct Value {
  Kind kind = Kind::None;
  int64_t i = 0;      // Bool, Int
  Obj* obj = nullptr; // every other kind
};

struct Obj {
  Kind kind = Kind::None;
  std::string s;               // Str; Global "module.name"; DType its name ("i4")
  std::string_view bytes;      // Bytes (a view of the mapped file)
  std::vector<Value> items;    // Tuple; List items once one is not an int; Dict keys and values alternately
  std::vector<int64_t> ints;   // List: its items while all are ints (a million-token list stays compact)
  char order = '|';            // DType byte order, set by BUILD
  Obj* dtype = nullptr;        // Array: set by BUILD
  Obj* state = nullptr;        // Array: the BUILD state tuple
  bool is_array_ready = false; // Array: BUILD done
};

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "a bool";
    case Kind::Int: return "an int";
    case Kind::Str: return "a str";
    case Kind::Bytes: return "bytes";
    case Kind::Tuple: return "a tuple";
    case Kind::List: return "a list";
    case Kind::Dict: return "a dict";
    case Kind::Global: return "a global";
    case Kind::Array: return "an ndarray";
    case Kind::DType: return "a dtype";
  }
  return "?";
}

Value scalar(Kind kind, int64_t i) { return Value{kind, i, nullptr}; }

void list_append(Obj& list, Value item) {
  if (list.items.empty() && item.kind == Kind::Int) {
    list.ints.push_back(item.i);
    return;
  }
  if (!list.ints.empty()) {
    for (int64_t v : list.ints) list.items.push_back(scalar(Kind::Int, v));
    list.ints.clear();
  }
  list.items.push_back(item);
}

class Unpickler {
 public:
  Unpickler(std::string_view bytes, size_t base, const std::string& name) : in_(bytes), base_(base), name_(name) {}

  Value run() {
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
        case 'N': push(Value{}); break;
        case 0x88: push(scalar(Kind::Bool, 1)); break;  // NEWTRUE
        case 0x89: push(scalar(Kind::Bool, 0)); break;  // NEWFALSE
        case 'J': push(scalar(Kind::Int, static_cast<int32_t>(unsigned_le(4)))); break;  // BININT
        case 'K': push(scalar(Kind::Int, static_cast<int64_t>(unsigned_le(1)))); break;  // BININT1
        case 'M': push(scalar(Kind::Int, static_cast<int64_t>(unsigned_le(2)))); break;  // BININT2
        case 0x8a: {                                                            // LONG1
          const size_t n = static_cast<size_t>(unsigned_le(1));
          if (n > 8) fail("an int of at most 8 bytes");
          uint64_t raw = unsigned_le(n);
          if (n > 0 && n < 8 && (raw >> (8 * n - 1)) & 1) raw |= ~uint64_t{0} << (8 * n);  // sign-extend
          push(scalar(Kind::Int, static_cast<int64_t>(raw)));
          break;
        }
        case 0x8c: push(text(Kind::Str, unsigned_le(1))); break;  // SHORT_BINUNICODE
        case 'X': push(text(Kind::Str, unsigned_le(4))); break;   // BINUNICODE
        case 0x8d: push(text(Kind::Str, unsigned_le(8))); break;  // BINUNICODE8
        case 'U': push(text(Kind::Str, unsigned_le(1))); break;   // SHORT_BINSTRING (protocol 2 str)
        case 'T': push(text(Kind::Str, unsigned_le(4))); break;   // BINSTRING
        case 'C': push(text(Kind::Bytes, unsigned_le(1))); break; // SHORT_BINBYTES
        case 'B': push(text(Kind::Bytes, unsigned_le(4))); break; // BINBYTES
        case 0x8e: push(text(Kind::Bytes, unsigned_le(8))); break;// BINBYTES8
        case ')': push(object(Kind::Tuple)); break;                 // EMPTY_TUPLE
        case 't': push(tuple(pop_mark())); break;                      // TUPLE
        case 0x85: case 0x86: case 0x87: {                             // TUPLE1..3
          const size_t n = op - 0x84u;
          if (stack_.size() < n + floor()) fail(fmt::format("{} values on the stack", n));
          std::vector<Value> items(stack_.end() - static_cast<ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(tuple(std::move(items)));
          break;
        }
        case ']': push(object(Kind::List)); break;                  // EMPTY_LIST
        case '}': push(object(Kind::Dict)); break;                  // EMPTY_DICT
        case 'a': {                                                    // APPEND
          const Value item = pop();
          list_append(expect(top(), Kind::List), item);
          break;
        }
        case 'e': {                                                    // APPENDS
          const std::vector<Value> items = pop_mark();
          Obj& list = expect(top(), Kind::List);
          for (const Value& item : items) list_append(list, item);
          break;
        }
        case 's': {                                                    // SETITEM
          const Value value = pop(), key = pop();
          Obj& dict = expect(top(), Kind::Dict);
          dict.items.push_back(key);
          dict.items.push_back(value);
          break;
        }
        case 'u': {                                                    // SETITEMS
          const std::vector<Value> items = pop_mark();
          if (items.size() % 2 != 0) fail("keys and values in pairs");
          Obj& dict = expect(top(), Kind::Dict);
          dict.items.insert(dict.items.end(), items.begin(), items.end());
          break;
        }
        case 'c': {                                                    // GLOBAL "module\nname\n"
          std::string module = line(), qualname = line();
          push(global(module, qualname));
          break;
        }
        case 0x93: {                                                   // STACK_GLOBAL
          const Value qualname = pop(), module = pop();
          if (module.kind != Kind::Str || qualname.kind != Kind::Str) fail("a module and a name (str)");
          push(global(module.obj->s, qualname.obj->s));
          break;
        }
        case 'q': memo_[unsigned_le(1)] = top_value(); break;            // BINPUT
        case 'r': memo_[unsigned_le(4)] = top_value(); break;            // LONG_BINPUT
        case 0x94: {                                                   // MEMOIZE
          const uint64_t index = memo_.size();
          memo_[index] = top_value();
          break;
        }
        case 'h': push(memo_get(unsigned_le(1))); break;               // BINGET
        case 'j': push(memo_get(unsigned_le(4))); break;               // LONG_BINGET
        case 'R': {                                                    // REDUCE
          const Value args = pop(), callable = pop();
          push(reduce(callable, expect(args, Kind::Tuple)));
          break;
        }
        case 'b': {                                                    // BUILD
          const Value state = pop();
          build(top(), state);
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
  Value text(Kind kind, uint64_t length) {
    if (length > in_.size() - pos_)
      FORGE_FAIL("{}: byte offset {}: a {}-byte string runs past the end of the file", name_, base_ + op_offset_,
                 length);
    Value value = object(kind);
    Obj* obj = value.obj;
    const std::string_view view = in_.substr(pos_, static_cast<size_t>(length));
    if (kind == Kind::Bytes) obj->bytes = view;
    else obj->s = std::string(view);
    pos_ += static_cast<size_t>(length);
    return value;
  }
  std::string line() {
    const size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) fail("a line ended by '\\n'");
    std::string out(in_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return out;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  Value object(Kind kind) {
    arena_.push_back(std::make_unique<Obj>());
    arena_.back()->kind = kind;
    return Value{kind, 0, arena_.back().get()};
  }
  void push(Value value) { stack_.push_back(value); }
  Value pop() {
    if (stack_.size() <= floor()) fail("a value on the stack");
    const Value value = stack_.back();
    stack_.pop_back();
    return value;
  }
  Value top_value() {
    if (stack_.size() <= floor()) fail("a value on the stack");
    return stack_.back();
  }
  Value& top() {
    if (stack_.size() <= floor()) fail("a value on the stack");
    return stack_.back();
  }
  std::vector<Value> pop_mark() {
    if (marks_.empty()) fail("a MARK before it");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Value> items(stack_.begin() + static_cast<ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }
  Obj& expect(const Value& value, Kind kind) {
    if (value.kind != kind || value.obj == nullptr)
      fail(fmt::format("{}, found {}", kind_name(kind), kind_name(value.kind)));
    return *value.obj;
  }
  Value memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail(fmt::format("memo entry {} to have been stored", index));
    return it->second;
  }
  Value tuple(std::vector<Value> items) {
    Value value = object(Kind::Tuple);
    value.obj->items = std::move(items);
    return value;
  }
  Value global(const std::string& module, const std::string& qualname) {
    const std::string full = module + "." + qualname;
    if (full != "numpy.core.multiarray._reconstruct" && full != "numpy._core.multiarray._reconstruct" &&
        full != "numpy.ndarray" && full != "numpy.dtype")
      FORGE_FAIL("{}: byte offset {}: the pickle names the global '{}': forge decodes only numpy arrays "
                 "(numpy.core.multiarray._reconstruct, numpy.ndarray, numpy.dtype) and never runs a pickle",
                 name_, base_ + op_offset_, full);
    Value value = object(Kind::Global);
    value.obj->s = full.ends_with("_reconstruct") ? "_reconstruct" : full;
    return value;
  }
  Value reduce(const Value& callable, const Obj& args) {
    if (callable.kind != Kind::Global) fail(fmt::format("a global to call, found {}", kind_name(callable.kind)));
    if (callable.obj->s == "_reconstruct") {  // _reconstruct(numpy.ndarray, shape, typecode): an empty array
      if (args.items.size() != 3 || args.items[0].kind != Kind::Global || args.items[0].obj->s != "numpy.ndarray")
        fail("_reconstruct(numpy.ndarray, shape, typecode)");
      return object(Kind::Array);
    }
    if (callable.obj->s == "numpy.dtype") {  // dtype(name, align, copy)
      if (args.items.empty() || args.items[0].kind != Kind::Str) fail("numpy.dtype(name, ...)");
      Value value = object(Kind::DType);
      value.obj->s = args.items[0].obj->s;
      return value;
    }
    fail("_reconstruct or numpy.dtype to be called");
  }
  void build(const Value& target, const Value& state) {
    const Obj& st = expect(state, Kind::Tuple);
    if (target.kind == Kind::DType) {  // (version, byte order, subarray, names, fields, ...)
      if (st.items.size() < 2 || st.items[1].kind != Kind::Str || st.items[1].obj->s.size() != 1)
        fail("a dtype state (version, byte order, ...)");
      target.obj->order = st.items[1].obj->s[0];
      return;
    }
    if (target.kind != Kind::Array || target.obj->is_array_ready) fail("an unbuilt ndarray or a dtype to BUILD");
    // (version, shape, dtype, fortran_order, data): data is bytes, or a list for objects.
    if (st.items.size() != 5 || st.items[1].kind != Kind::Tuple || st.items[2].kind != Kind::DType)
      fail("an ndarray state (version, shape, dtype, fortran_order, data)");
    target.obj->dtype = st.items[2].obj;
    target.obj->state = state.obj;
    target.obj->is_array_ready = true;
  }

  std::string_view in_;
  size_t base_, pos_ = 0, op_offset_ = 0;
  const std::string& name_;
  std::vector<std::unique_ptr<Obj>> arena_;  // every Obj of the pickle, freed with the Unpickler
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value> memo_;
};

// Converts a record field (a 1-d integer ndarray, or a list of ints/bools) to int64s.
std::vector<int64_t> field_values(const Value& value, const std::string& where) {
  if (value.kind == Kind::List) {
    const Obj& list = *value.obj;
    if (list.items.empty()) return list.ints;
    std::vector<int64_t> out;
    for (const Value& item : list.items) {
      if (item.kind != Kind::Int && item.kind != Kind::Bool)
        FORGE_FAIL("{}: expected a list of ints, found {} in it", where, kind_name(item.kind));
      out.push_back(item.i);
    }
    return out;
  }
  if (value.kind != Kind::Array || !value.obj->is_array_ready)
    FORGE_FAIL("{}: expected a 1-d integer ndarray or a list of ints, found {}", where, kind_name(value.kind));
  const Obj& array = *value.obj;
  const std::vector<Value>& st = array.state->items;
  const std::string descr = std::string(1, array.dtype->order) + array.dtype->s;
  NpyHeader header;
  if (!parse_npy_descr(descr, header))
    FORGE_FAIL("{}: an ndarray of dtype '{}': expected a 1-d integer array (b1, i1, u1, i2, u2, i4, u4, i8, u8)",
               where, descr);
  const std::vector<Value>& shape = st[1].obj->items;
  if (shape.size() != 1 || shape[0].kind != Kind::Int || shape[0].i < 0)
    FORGE_FAIL("{}: expected a 1-d ndarray, found one of {} dimensions", where, shape.size());
  if (st[3].kind != Kind::Bool || st[3].i != 0) FORGE_FAIL("{}: expected a C-order ndarray (fortran_order False)", where);
  if (st[4].kind != Kind::Bytes)
    FORGE_FAIL("{}: expected the ndarray's data as bytes, found {}", where, kind_name(st[4].kind));
  const uint64_t n = static_cast<uint64_t>(shape[0].i);
  const std::string_view data = st[4].obj->bytes;
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
  const Value root = unpickler.run();
  if (root.kind != Kind::Array || !root.obj->is_array_ready || root.obj->dtype->s.empty() ||
      root.obj->dtype->s[0] != 'O')
    FORGE_FAIL("{}: the pickle holds {}: expected the object ndarray the header declares", path, kind_name(root.kind));
  const std::vector<Value>& st = root.obj->state->items;
  const std::vector<Value>& shape = st[1].obj->items;
  if (shape.size() != 1 || shape[0].kind != Kind::Int || shape[0].i != header.shape[0])
    FORGE_FAIL("{}: the pickled array's shape disagrees with the header's ({},)", path, header.shape[0]);
  if (st[4].kind != Kind::List)
    FORGE_FAIL("{}: the pickled object array's elements: expected a list, found {}", path, kind_name(st[4].kind));
  const Obj& elements = *st[4].obj;
  const int64_t count = static_cast<int64_t>(elements.items.empty() ? elements.ints.size() : elements.items.size());
  if (count != header.shape[0])
    FORGE_FAIL("{}: the header declares {} records, the pickle holds {}", path, header.shape[0], count);
  uint64_t total_values = 0;
  for (int64_t r = 0; r < count; ++r) {
    if (elements.items.empty()) FORGE_FAIL("{}: record {}: expected a dict, found an int", path, r);
    const Value& element = elements.items[static_cast<size_t>(r)];
    if (element.kind != Kind::Dict)
      FORGE_FAIL("{}: record {}: expected a dict, found {}", path, r, kind_name(element.kind));
    const Obj& dict = *element.obj;
    NpyRecord record;
    for (size_t k = 0; k + 1 < dict.items.size(); k += 2) {
      if (dict.items[k].kind != Kind::Str)
        FORGE_FAIL("{}: record {}: expected str keys, found {}", path, r, kind_name(dict.items[k].kind));
      const std::string& key = dict.items[k].obj->s;
      std::vector<int64_t>& values = record[key];
      values = field_values(dict.items[k + 1], fmt::format("{}: record {} '{}'", path, r, key));
      // Every value costs the file at least one byte, unless the pickle repeats a memoized
      // object (BINGET): bounded so that a small file cannot expand without limit.
      total_values += values.size();
      if (total_values > file.size())
        FORGE_FAIL("{}: record {} '{}': the records hold more values than the file has bytes ({}): a pickle that "
                   "repeats shared objects is refused",
                   path, r, key, file.size());
    }
    visit(r, record);
  }
  return count;
}

}  // namespace forge
