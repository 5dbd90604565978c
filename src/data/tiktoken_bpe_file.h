// A tiktoken BPE file, the tokenizer.model Meta ships in Llama 3's original/ folder
// (openai/tiktoken's load_tiktoken_bpe reads it): one token per line,
//   <base64 of the token's bytes> <rank>
// e.g. "IQ== 0" for the byte "!". The ranks are the merge order of byte-level BPE.
//
// NOTE [tiktoken file checks]
// tiktoken itself reads any lines it can split in two; forge requires what makes the ids
// well defined: every line '<base64> <decimal rank>' (empty lines skipped, "\r\n"
// endings allowed), strict base64 of at least one byte, no token or rank twice, ranks
// 0..n-1 without gaps (Meta numbers the special tokens from n, so a gap would shift
// them), and all 256 single bytes present (byte-level BPE must be able to spell any
// text). Each violation fails naming file:line and what was expected.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

// Whether `file` reads like a tiktoken BPE file: its first 4 KiB are ASCII text and one
// of the lines there is '<base64> <decimal>'. Used to tell it from a SentencePiece
// tokenizer.model (a binary protobuf) of the same name.
bool looks_like_tiktoken_bpe(const std::string& file);

// The bytes `text` spells in standard base64, padded with '=' to a multiple of 4
// characters; nullopt when it is not such base64 (also for an empty text).
std::optional<std::string> decode_base64(std::string_view text);

// The bytes of every token, indexed by rank; fails naming file:line (NOTE [tiktoken file checks]).
std::vector<std::string> read_tiktoken_bpe(const std::string& file);

}  // namespace forge
