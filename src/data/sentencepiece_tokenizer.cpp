#include "data/sentencepiece_tokenizer.h"

#include "core/error.h"
#include "data/mapped_file.h"
#include "data/sentencepiece_bpe.h"
#include "data/sentencepiece_model_proto.h"
#include "data/sentencepiece_unigram.h"
#include "data/utf8.h"

namespace forge {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";           // U+2581
constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD
constexpr std::string_view kDefaultUnknownSurface = " \xE2\x81\x87 ";  // " ⁇ "

const char* model_type_name(SentencePieceModelType type) {
  switch (type) {
    case SentencePieceModelType::Unigram:
      return "UNIGRAM";
    case SentencePieceModelType::Bpe:
      return "BPE";
    case SentencePieceModelType::Word:
      return "WORD";
    case SentencePieceModelType::Char:
      return "CHAR";
  }
  return "unknown";
}

}  // namespace

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& file) {
  const MappedFile bytes(file);
  const SentencePieceModelProto model =
      parse_sentencepiece_model({reinterpret_cast<const char*>(bytes.data()), bytes.size()}, file);
  vocab_ = std::make_unique<SentencePieceVocab>(model, file);
  std::vector<std::pair<std::string, int32_t>> symbols;
  for (const std::string& symbol : vocab_->user_defined_symbols()) symbols.emplace_back(symbol, 0);
  user_defined_symbols_ = ByteTrie(std::move(symbols));

  const SentencePieceNormalizerSpec& spec = model.normalizer_spec;
  normalizer_ = std::make_unique<SentencePieceNormalizer>(spec, model.trainer_spec.treat_whitespace_as_suffix,
                                                          user_defined_symbols_, file + ": normalizer_spec");
  if (model.denormalizer_spec && !model.denormalizer_spec->precompiled_charsmap.empty())
    denormalizer_ = std::make_unique<SentencePieceNormalizer>(*model.denormalizer_spec, false, no_symbols_,
                                                              file + ": denormalizer_spec");
  switch (model.trainer_spec.model_type) {
    case SentencePieceModelType::Bpe:
      model_ = std::make_unique<SentencePieceBpe>(*vocab_, user_defined_symbols_,
                                                  spec.escape_whitespaces ? kSpaceSymbol : " ");
      break;
    case SentencePieceModelType::Unigram:
      model_ = std::make_unique<SentencePieceUnigram>(*vocab_);
      break;
    default:
      FORGE_FAIL("{}: trainer_spec.model_type is {}; forge encodes SentencePiece BPE and UNIGRAM models", file,
                 model_type_name(model.trainer_spec.model_type));
  }

  decode_ids_.resize(vocab_->size());
  for (int32_t id = 0; id < vocab_->size(); ++id) decode_ids_[id] = vocab_->piece_to_id(vocab_->piece(id));
  unknown_surface_ = model.trainer_spec.unk_surface.value_or(std::string(kDefaultUnknownSurface));
  drop_leading_whitespace_ = spec.add_dummy_prefix || spec.remove_extra_whitespaces;
  drop_all_leading_whitespace_ = spec.remove_extra_whitespaces;
  auto or_default = [](const std::string& piece, const char* fallback) { return piece.empty() ? fallback : piece; };
  bos_id_ = control_id(or_default(model.trainer_spec.bos_piece, "<s>"));
  eos_id_ = control_id(or_default(model.trainer_spec.eos_piece, "</s>"));
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

// sentencepiece's bos_id() and eos_id(): the piece's id when it is a CONTROL piece.
std::optional<int32_t> SentencePieceTokenizer::control_id(const std::string& piece) const {
  const int32_t id = vocab_->piece_to_id(piece);
  return vocab_->type(id) == SentencePieceType::Control ? std::optional<int32_t>(id) : std::nullopt;
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  thread_local std::string normalized;
  normalizer_->normalize(text, normalized);
  std::vector<int32_t> ids;
  model_->encode(normalized, ids);
  return ids;
}

// The text of a run of byte pieces (NOTE [SentencePiece decode]).
void SentencePieceTokenizer::append_bytes(const std::string& bytes, std::string& text) const {
  for (size_t pos = 0; pos < bytes.size();) {
    if (utf8::code_point_at(bytes, pos) < 0) {
      text += kReplacementCharacter;
      ++pos;
    } else {
      const size_t length = utf8::unit_length(bytes, pos);
      text.append(bytes, pos, length);
      pos += length;
    }
  }
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text, bytes;
  bool at_start = true;         // no text and no dropped leading "▁" yet
  bool dropped_leading = false;  // the previous piece's leading "▁" was dropped
  for (int32_t given : ids) {
    if (given < 0 || given >= vocab_->size())
      FORGE_FAIL("decode: token id {} is not in the vocab (size {})", given, vocab_->size());
    const int32_t id = decode_ids_[given];
    const SentencePieceType type = vocab_->type(id);
    if (type == SentencePieceType::Byte) {
      bytes += static_cast<char>(vocab_->byte_value(id));
      continue;
    }
    append_bytes(bytes, text);
    bytes.clear();
    if (dropped_leading || !text.empty()) at_start = false;
    dropped_leading = false;
    if (type == SentencePieceType::Control) continue;
    if (type == SentencePieceType::Unknown) {
      text += unknown_surface_;
      continue;
    }
    std::string_view piece = vocab_->piece(id);
    if (at_start && drop_leading_whitespace_ && piece.starts_with(kSpaceSymbol)) {
      piece.remove_prefix(kSpaceSymbol.size());
      dropped_leading = !drop_all_leading_whitespace_;
    }
    for (size_t pos = 0; pos < piece.size();) {
      if (piece.substr(pos).starts_with(kSpaceSymbol)) {
        text += ' ';
        pos += kSpaceSymbol.size();
      } else {
        text += piece[pos++];
      }
    }
  }
  append_bytes(bytes, text);
  if (!denormalizer_) return text;
  std::string denormalized;
  denormalizer_->normalize(text, denormalized);
  return denormalized;
}

}  // namespace forge
