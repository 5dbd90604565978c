"""SentencePiece tokenizer.model files trained by the sentencepiece package itself in the
configurations published models use, and the texts forge's native encoder is compared on.
Shared by test_sentencepiece_model.py and scripts/bench-tokenizer."""
import io
import os
import random

import tokenizer_fixtures

# (name, trainer options) on top of COMMON_OPTIONS; every model is trained on
# tokenizer_fixtures.corpus() plus SPECIAL_LINES.
BPE_CONFIGS = [
    # Llama 2 / Mistral: identity normalization, byte fallback, digits split, whitespace
    # kept as it is, "▁▁" pieces.
    ("bpe-llama2", dict(model_type="bpe", normalization_rule_name="identity", byte_fallback=True, split_digits=True,
                        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                        user_defined_symbols=["<|im_start|>", "<|im_end|>"])),
    ("bpe-nmt-nfkc", dict(model_type="bpe")),
    ("bpe-nfkc-keep-whitespace", dict(model_type="bpe", normalization_rule_name="nfkc", remove_extra_whitespaces=False,
                                      byte_fallback=True)),
    ("bpe-nmt-nfkc-cf-no-dummy-prefix", dict(model_type="bpe", normalization_rule_name="nmt_nfkc_cf",
                                             add_dummy_prefix=False)),
    ("bpe-user-defined-control", dict(model_type="bpe", byte_fallback=True,
                                      user_defined_symbols=["forge", "[TAB]", "<sep>", "\u2581\u2581", "12"],
                                      control_symbols=["<ctrl>", "<mask>"])),
    ("bpe-whitespace-suffix", dict(model_type="bpe", treat_whitespace_as_suffix=True, byte_fallback=True)),
    ("bpe-no-whitespace-split", dict(model_type="bpe", split_by_whitespace=False, normalization_rule_name="identity",
                                     remove_extra_whitespaces=False)),
    ("bpe-custom-rules", dict(model_type="bpe", byte_fallback=True)),  # normalization_rule_tsv added by train_models
]
UNIGRAM_CONFIGS = [
    ("unigram-nmt-nfkc", dict(model_type="unigram")),  # T5 / ALBERT style
    ("unigram-byte-fallback", dict(model_type="unigram", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True)),
    ("unigram-user-defined", dict(model_type="unigram", user_defined_symbols=["forge", "<sep>", "ab"],
                                  control_symbols=["<ctrl>"], treat_whitespace_as_suffix=True)),
]
COMMON_OPTIONS = dict(vocab_size=900, hard_vocab_limit=False, character_coverage=0.98, minloglevel=2, num_threads=2)

# Lines that put the user-defined symbols, full-width forms and runs of whitespace into
# the training data, so pieces for them exist.
SPECIAL_LINES = [
    "forge [TAB] <sep> forge<sep>forge", "ＡＢＣ ｱｲｳ １２３ ﬁ ①", "a  b   c    d", "\tindent\n\tmore",
    "<|im_start|>user hello<|im_end|>",
] * 20

# A custom rule set (normalization_rule_tsv): source code points → target code points,
# including a rule longer than one character and one that deletes.
CUSTOM_RULES = "41\t61\n42 43\t78 79 7A\nDF\t73 73\n200B\t\n3000\t20\n"

TEXTS = tokenizer_fixtures.TEST_TEXTS + [
    "ＡＢＣ ｆｕｌｌｗｉｄｔｈ １２３４ ｶﾀｶﾅ ﬁnance ① ㍻ ™",
    "e\u0301 combining, Å vs A\u030a, ﬀ ligature, Ⅻ",
    "tabs\tand\u000bvertical\u000cform\x00nul\x01\x7f control",
    "zero\u200bwidth\ufeffbom\u00adsoft hyphen",
    "forge [TAB] <sep> forge<sep>forge<ctrl><mask> <s></s> ▁▁ <|im_start|>x<|im_end|> 1212",
    "                    twenty spaces then text",
    "한국어 텍스트 ภาษาไทย עברית Ελληνικά ქართული",
    "\ufffd literal replacement character",
    "AbC ABC abc ß",
    "▁ already ▁escaped▁ text ▁",
    "numbers 0 00 000 0000 3.14 1e10 ١٢٣ ४५६",
]
INVALID_UTF8_TEXTS = tokenizer_fixtures.INVALID_UTF8_TEXTS + [b"\xed\xa0\x80 surrogate", b"\xc0\xaf overlong",
                                                              b"\xf8\x88\x80\x80\x80 five bytes"]


def random_texts(count=300, seed=1):
    """Texts of random characters from every script of the corpus with spaces, digits and
    punctuation: merges and lattices in every combination the fixed texts miss."""
    rng = random.Random(seed)
    alphabet = sorted(set("".join(" ".join(words) for words in tokenizer_fixtures.WORDS.values())))
    alphabet += list("0123456789.,;:!?()[]{}\"'-_/\\@#$%^&*+=<>|~`\t\n") + [" "] * 20 + ["ＡＢ", "ﬁ", "\u3000"]
    words = [w for group in tokenizer_fixtures.WORDS.values() for w in group]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            random_word = "".join(rng.choices(alphabet, k=rng.randint(1, 8)))
            parts.append(rng.choice(words) if rng.random() < 0.5 else random_word)
        texts.append(rng.choice(["", " ", "  "]).join(parts))
    return texts


def train(name, options, directory, corpus_lines=None):
    """Trains a model with sentencepiece and saves it as DIRECTORY/NAME.model."""
    import sentencepiece

    model = io.BytesIO()
    lines = corpus_lines if corpus_lines is not None else tokenizer_fixtures.corpus() + SPECIAL_LINES
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                             **{**COMMON_OPTIONS, **options})
    path = os.path.join(directory, f"{name}.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def train_models(directory):
    """{name: path} of every configuration in BPE_CONFIGS and UNIGRAM_CONFIGS."""
    rules = os.path.join(directory, "custom-rules.tsv")
    with open(rules, "w", encoding="utf-8") as f:
        f.write(CUSTOM_RULES)
    models = {}
    for name, options in BPE_CONFIGS + UNIGRAM_CONFIGS:
        if name == "bpe-custom-rules":
            options = dict(options, normalization_rule_tsv=rules)
        models[name] = train(name, options, directory)
    return models


def edit_model(path, edit, out_path):
    """Applies edit(ModelProto) to the model at `path` and saves it to `out_path`."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    edit(proto)
    with open(out_path, "wb") as f:
        f.write(proto.SerializeToString())
    return out_path


def edited_models(models, directory):
    """Models sentencepiece's trainer does not write but published models contain:
    UNUSED pieces (BPE resegments them), a denormalizer, a custom unk_surface, pieces
    appended after training (vocab_size no longer matches, as vocab-extension tools leave
    it), equal scores (ties broken by position), and escape_whitespaces off (the trainer
    refuses it; pieces then hold " " where the text has spaces)."""
    from sentencepiece import sentencepiece_model_pb2

    piece_type = sentencepiece_model_pb2.ModelProto.SentencePiece

    def mark_unused(proto):
        multi = [p for p in proto.pieces if p.type == piece_type.NORMAL and len(p.piece) >= 3]
        for p in multi[::7]:
            p.type = piece_type.UNUSED

    def add_denormalizer(proto):
        proto.denormalizer_spec.CopyFrom(proto.normalizer_spec)
        proto.denormalizer_spec.add_dummy_prefix = False
        proto.denormalizer_spec.remove_extra_whitespaces = False
        proto.denormalizer_spec.escape_whitespaces = False
        proto.trainer_spec.unk_surface = "<?>"

    def extend_vocab(proto):
        existing = {p.piece for p in proto.pieces}
        for piece in ["▁forged", "▁reforge", "中文测试", "▁▁▁▁▁▁▁▁▁▁▁▁"]:
            if piece not in existing:
                added = proto.pieces.add()
                added.piece, added.score = piece, 0.0

    def flatten_scores(proto):
        for p in proto.pieces:
            if p.type == piece_type.NORMAL:
                p.score = float(round(p.score / 50))

    def unescape_whitespace(proto):
        proto.normalizer_spec.escape_whitespaces = False
        for p in proto.pieces:
            if p.type == piece_type.NORMAL:
                p.piece = p.piece.replace("\u2581", " ")

    edits = {
        "bpe-unescaped-whitespace": ("bpe-user-defined-control", unescape_whitespace),
        "unigram-unescaped-whitespace": ("unigram-nmt-nfkc", unescape_whitespace),
        "bpe-unused-pieces": ("bpe-llama2", mark_unused),
        "unigram-unused-pieces": ("unigram-nmt-nfkc", mark_unused),
        "bpe-denormalizer": ("bpe-nmt-nfkc", add_denormalizer),
        "bpe-extended-vocab": ("bpe-llama2", extend_vocab),
        "bpe-tied-scores": ("bpe-nmt-nfkc", flatten_scores),
        "unigram-tied-scores": ("unigram-byte-fallback", flatten_scores),
    }
    return {name: edit_model(models[base], edit, os.path.join(directory, f"{name}.model"))
            for name, (base, edit) in edits.items()}
