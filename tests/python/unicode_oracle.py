"""What Hugging Face `tokenizers` itself means by each Unicode class, probed code point by
code point through its own components: the Split pre-tokenizer (its regex engine,
Oniguruma), the Digits pre-tokenizer (Rust's char::is_numeric) and a single_word added
token (the regex crate's \\w). Every Unicode scalar value (0..0x10FFFF without the
surrogates) goes through in one text. Sets are lists of inclusive (first, last) code point
ranges. Used by scripts/generate-unicode-tables and the tokenizer tests."""
SURROGATES = (0xD800, 0xDFFF)
SCALAR_VALUES = [c for c in range(0x110000) if not SURROGATES[0] <= c <= SURROGATES[1]]
ALL_SCALAR_VALUES_TEXT = "".join(map(chr, SCALAR_VALUES))

# Oniguruma's general categories as tokenizers' regexes name them (\p{Lu} ...), the order of
# forge's GeneralCategory enum.
GENERAL_CATEGORIES = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi",
                      "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"]


def ranges_of_indices(index_runs):
    """Code point ranges of [begin, end) runs of indices into SCALAR_VALUES (merged; a run
    across the surrogates is cut in two)."""
    ranges = []
    for begin, end in index_runs:
        first, last = SCALAR_VALUES[begin], SCALAR_VALUES[end - 1]
        if first < SURROGATES[0] and last > SURROGATES[1]:
            ranges += [(first, SURROGATES[0] - 1), (SURROGATES[1] + 1, last)]
        else:
            ranges.append((first, last))
    return merge(ranges)


def complement_runs(runs, length):
    """The [begin, end) runs of 0..length not covered by the sorted, disjoint `runs`."""
    out, previous = [], 0
    for begin, end in runs:
        if begin > previous:
            out.append((previous, begin))
        previous = end
    if previous < length:
        out.append((previous, length))
    return out


def regex_class(pattern):
    """The code points a one-character regex matches in tokenizers (Oniguruma): those a
    Replace normalizer deletes from the text of all scalar values (ten times faster than
    splitting it)."""
    import numpy
    from tokenizers import Regex, normalizers

    kept = normalizers.Replace(Regex(f"(?:{pattern})+"), "").normalize_str(ALL_SCALAR_VALUES_TEXT)
    if not kept:
        return ranges_of_indices([(0, len(SCALAR_VALUES))])
    code_points = numpy.frombuffer(kept.encode("utf-32-le"), dtype=numpy.uint32).astype(numpy.int64)
    indices = numpy.where(code_points < SURROGATES[0], code_points, code_points - (SURROGATES[1] - SURROGATES[0] + 1))
    breaks = numpy.flatnonzero(numpy.diff(indices) != 1) + 1
    starts, ends = numpy.concatenate(([0], breaks)), numpy.concatenate((breaks, [len(indices)]))
    runs = [(int(indices[b]), int(indices[e - 1]) + 1) for b, e in zip(starts, ends)]
    return ranges_of_indices(complement_runs(runs, len(SCALAR_VALUES)))


def numeric():
    """The code points the Digits pre-tokenizer splits off (Rust's char::is_numeric)."""
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.Digits(individual_digits=False).pre_tokenize_str(ALL_SCALAR_VALUES_TEXT)
    assert not pieces[0][0].isnumeric(), "the text must start with a non-numeric piece"
    return ranges_of_indices([offsets for i, (_, offsets) in enumerate(pieces) if i % 2 == 1])


def added_token_word():
    """The code points next to which a single_word added token is not matched (the regex
    crate's \\w in tokenizers' AddedVocabulary), probed on both sides."""
    from tokenizers import AddedToken, Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.add_tokens([AddedToken("@", single_word=True, normalized=False)])
    at = tokenizer.token_to_id("@")
    sides = []
    for texts in ([chr(c) + "@" for c in SCALAR_VALUES], ["@" + chr(c) for c in SCALAR_VALUES]):
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        sides.append([i for i, e in enumerate(encodings) if at not in e.ids])
    assert sides[0] == sides[1], "the word characters before and after a single_word token differ"
    return ranges_of_indices([(i, i + 1) for i in sides[0]])


def merge(ranges):
    """Sorted, disjoint, non-adjacent ranges covering the same code points."""
    out = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out
