"""Texts that tell Unicode versions and whitespace semantics apart, for the tokenizer tests:
every whitespace, format and control character (U+180E, which PCRE2 still counts as \\s,
among them) in the contexts split patterns treat differently, and letters, marks, digits and
symbols from blocks added in Unicode 14, 15.0, 15.1, 16.0 and 17.0 (newer than tokenizers'
regex tables, so not letters to it). Characters are chosen by tokenizers' own classes
(unicode_oracle.py)."""
import unicode_oracle as oracle

BLOCKS = {
    "14.0": {"Arabic Extended-B": (0x0870, 0x089F), "Vithkuqi": (0x10570, 0x105BF),
             "Latin Extended-F": (0x10780, 0x107BF), "Old Uyghur": (0x10F70, 0x10FAF),
             "Cypro-Minoan": (0x12F90, 0x12FFF), "Tangsa": (0x16A70, 0x16ACF), "Kana Extended-B": (0x1AFF0, 0x1AFFF),
             "Znamenny Musical Notation": (0x1CF00, 0x1CFCF), "Latin Extended-G": (0x1DF00, 0x1DFFF),
             "Toto": (0x1E290, 0x1E2BF), "Ethiopic Extended-B": (0x1E7E0, 0x1E7FF)},
    "15.0": {"Arabic Extended-C": (0x10EC0, 0x10EFF), "Devanagari Extended-A": (0x11B00, 0x11B5F),
             "Kawi": (0x11F00, 0x11F5F), "Egyptian Hieroglyph Format Controls": (0x13430, 0x1345F),
             "Kaktovik Numerals": (0x1D2C0, 0x1D2DF), "Cyrillic Extended-D": (0x1E030, 0x1E08F),
             "Nag Mundari": (0x1E4D0, 0x1E4FF), "CJK Unified Ideographs Extension H": (0x31350, 0x323AF)},
    "15.1": {"Ideographic Description Characters": (0x2FF0, 0x2FFF),
             "CJK Unified Ideographs Extension I": (0x2EBF0, 0x2EE5F)},
    "16.0": {"Todhri": (0x105C0, 0x105FF), "Garay": (0x10D40, 0x10D8F), "Tulu-Tigalari": (0x11380, 0x113FF),
             "Myanmar Extended-C": (0x116D0, 0x116FF), "Sunuwar": (0x11BC0, 0x11BFF),
             "Egyptian Hieroglyphs Extended-A": (0x13460, 0x143FF), "Gurung Khema": (0x16100, 0x1613F),
             "Kirat Rai": (0x16D40, 0x16D7F), "Symbols for Legacy Computing Supplement": (0x1CC00, 0x1CEBF),
             "Ol Onal": (0x1E5D0, 0x1E5FF)},
    "17.0": {"Sidetic": (0x10940, 0x1095F), "Tolong Siki": (0x11DB0, 0x11DEF), "Tai Yo": (0x1E6C0, 0x1E6FF),
             "CJK Unified Ideographs Extension J": (0x323B0, 0x3347F)},
}
KINDS = {"letters": r"\p{L}", "marks": r"\p{M}", "numbers": r"\p{N}", "others": r"[\p{P}\p{S}\p{Cf}]"}


def members(pattern):
    return [c for first, last in oracle.regex_class(pattern) for c in range(first, last + 1)]


def separators():
    """Every Z, Cf and Cc character (U+180E, a Cf since Unicode 6.3, among them)."""
    return members(r"[\p{Z}\p{Cf}\p{Cc}]")


def block_characters():
    """{(version, block): {"letters": [...], "marks": ..., "numbers": ..., "others": ...,
    "first": the block's first code points}}, up to three of each."""
    sets = {kind: set(members(pattern)) for kind, pattern in KINDS.items()}
    out = {}
    for version, blocks in BLOCKS.items():
        for name, (first, last) in blocks.items():
            chosen = {kind: [c for c in range(first, last + 1) if c in kind_set][:3] for kind, kind_set in sets.items()}
            chosen["first"] = list(range(first, first + 3))
            out[(version, name)] = chosen
    return out


def separator_texts(word="forge", stripped="[TAB]"):
    """Each separator between letters, digits, `word` and `stripped`, doubled, at line
    starts and ends."""
    texts = []
    for code_point in separators():
        c = chr(code_point)
        texts.append(f"a{c}b  {c}{c} x{c}\n{c} 1{c}2 {word}{c}{word} {c}{word}{c} ({c}) {c}{stripped}{c}{c} {c}")
    texts.append("  \u180e\u180e")
    return texts


def block_texts(word="forge"):
    """Each block's characters among Latin letters, digits, punctuation, U+180E and `word`."""
    texts = []
    for chosen in block_characters().values():
        run = "".join(chr(c) for kind in ("letters", "marks", "numbers", "others", "first") for c in chosen[kind])
        letter = chr(chosen["letters"][0]) if chosen["letters"] else "x"
        mark = chr(chosen["marks"][0]) if chosen["marks"] else "\u0301"
        number = "".join(chr(c) for c in chosen["numbers"]) or "7"
        texts.append(f"x{run} {run}1 ({run}) {run[::-1]}\u180e{run}'s {word}{run[0]} {run[-1]}{word} {word}{letter} "
                     f"{letter}{mark}{letter}{word} 12{number}345{number}{number}6 a{mark}b {number}{word}")
    return texts


def digit_texts():
    """Digits that tokenizers' Digits pre-tokenizer (Rust's char::is_numeric, a newer
    Unicode) splits off but its regexes' \\p{N} does not know, among ASCII digits."""
    numbers = set(members(r"\p{N}"))
    only_numeric = [c for first, last in oracle.numeric() for c in range(first, last + 1) if c not in numbers]
    return [f"1{chr(c)}2 {chr(c)}{chr(c)}x 34{chr(c)}" for c in only_numeric]


def word_neighbour_texts(word="forge"):
    """`word` right before and after characters on which tokenizers' single_word check and
    its regexes' \\w disagree (² ¹ ¼, Join_Control, circled letters, Roman numerals,
    connector punctuation, marks)."""
    neighbours = "_\u203f\u00b2\u00b3\u00b9\u00bc\u00bd\u00be\u200c\u200d\u24b6\u24d0\u2160\u216b\u0301\u0903\u3007"
    return [f"{c}{word} {word}{c} {c}{word}{c} x {word} {c}" for c in neighbours]


def corpus_lines(count=2000, seed=0):
    """Training text in which the block characters form words next to Latin letters and
    digits, between separators, so that a tokenizer trained on it has merges across the
    boundaries a wrong class would move."""
    import random

    rng = random.Random(seed)
    words = ["the", "data", "12", "345", "x", "model"]
    for chosen in block_characters().values():
        run = [chr(c) for kind in ("letters", "marks", "numbers") for c in chosen[kind]]
        if run:
            words += ["".join(run), "x" + "".join(run[:2]), "".join(run[:1]) + "1", "".join(run[-2:]) + "s"]
    gaps = [" ", " ", " ", "  ", "\n"] + [chr(c) for c in separators()[::6]] + ["\u180e", "\u3000", "\u200b"]
    return ["".join(rng.choice(words) + rng.choice(gaps) for _ in range(rng.randint(3, 12))) for _ in range(count)]
