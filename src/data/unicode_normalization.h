// Unicode normalization as Hugging Face tokenizers' NFC and Lowercase normalizers do it (the
// first and last steps of CLIP's tokenizer), on UTF-8 text that may hold invalid bytes.
//
// NOTE [NFC and Lowercase as tokenizers runs them]
// NFC: each code point is replaced by its full canonical decomposition (Hangul syllables by
// arithmetic), every run of marks (combining class > 0) is sorted by class, keeping the
// order of equal classes, and each starter then absorbs the following code points it
// composes with that no code point in between blocks (one of class 0, or of a class at
// least theirs), the algorithm of UAX #15 as the unicode-normalization-alignments crate
// tokenizers uses runs it. Lowercase maps each code point by itself (Rust's
// char::to_lowercase: no final-sigma context, U+0130 becomes "i" + U+0307). The data comes
// from tokenizers itself (unicode_normalization_tables.h), so a character tokenizers'
// Unicode does not know is left alone here too. A byte that starts no valid UTF-8 sequence
// stays as it is and, for NFC, blocks like a starter that composes with nothing.
#pragma once

#include <string>

namespace forge::unicode {

void nfc(std::string& text);
void lowercase(std::string& text);

}  // namespace forge::unicode
