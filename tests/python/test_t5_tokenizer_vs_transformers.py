"""forge's T5 prompt tokenization (data/t5_prompt_tokenizer.h) against transformers'
T5TokenizerFast called as FluxPipeline calls it (padding="max_length", truncation=True),
id for id. T5-layout SentencePiece models (<pad>, </s>, <unk> as 0, 1, 2; unigram) are
trained by sentencepiece on the fixture corpus: nmt_nfkc as T5's, identity normalization
(no charsmap), user-defined and control symbols, and tied scores (ties broken as
tokenizers breaks them). forge reads each as spiece.model, as the tokenizer.json
transformers writes from it, and as a folder; captions are the SentencePiece fixture texts
(many scripts, full-width forms, every kind of whitespace), random texts, captions with
T5's special and sentinel tokens written in them, and captions long enough to be truncated
(512 and a short max_length). Also: refusals of tokenizers without T5's layout and of
invalid UTF-8."""
import io
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import forge_test_util  # noqa: E402
import sentencepiece_fixtures as fixtures  # noqa: E402
import tokenizer_fixtures  # noqa: E402
import unicode_texts  # noqa: E402

REFERENCE = forge_test_util.tool("forge_t5_reference")
T5_IDS = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)

MODELS = [
    ("t5-nmt-nfkc", dict(model_type="unigram")),
    ("t5-identity", dict(model_type="unigram", normalization_rule_name="identity", remove_extra_whitespaces=False)),
    ("t5-user-defined", dict(model_type="unigram", user_defined_symbols=["forge", "<sep>", "ab"],
                             control_symbols=["<ctrl>"])),
]

CAPTIONS = [
    "",
    "a photo of a cat",
    "A red fox jumping over a lazy dog, digital art, 4k, highly detailed",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\nand newlines\r\nhere",
    "text with </s> end token and <pad> pad and <unk> unknown",
    "sentinels <extra_id_0> and <extra_id_99><extra_id_5>glued",
    "user symbols: forge<sep>forgeab <ctrl> control",
    "emoji 😀🎉 and CJK 漢字 かな and accents café naïve",
    "▁ literal ▁escaped▁ spaces ▁",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ １２３ and ﬁ ligature",
    "word " * 600,
]


def train_t5_model(name, options, directory):
    import sentencepiece

    model = io.BytesIO()
    lines = tokenizer_fixtures.corpus() + fixtures.SPECIAL_LINES
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                             **{**fixtures.COMMON_OPTIONS, **T5_IDS, **options})
    folder = os.path.join(directory, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "spiece.model"), "wb") as f:
        f.write(model.getvalue())
    return folder


def tied_scores(folder, directory):
    """The folder's model with its scores rounded to few values: many exact ties."""
    from sentencepiece import sentencepiece_model_pb2

    out = os.path.join(directory, "t5-tied-scores")
    os.makedirs(out)

    def flatten(proto):
        for p in proto.pieces:
            if p.type == sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL:
                p.score = float(round(p.score / 2))

    fixtures.edit_model(os.path.join(folder, "spiece.model"), flatten, os.path.join(out, "spiece.model"))
    return out


def forge_tokenize(tokenizer, captions, max_length):
    d = forge_test_util.scratch_dir()
    with open(os.path.join(d, "captions.json"), "w", encoding="utf-8") as f:
        json.dump(captions, f)
    forge_test_util.run([REFERENCE, "tokenize", tokenizer, os.path.join(d, "captions.json"),
                         os.path.join(d, "out.json"), str(max_length)])
    with open(os.path.join(d, "out.json")) as f:
        return json.load(f)


class T5TokenizerVsTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = forge_test_util.scratch_dir()
        cls.folders = {name: train_t5_model(name, options, cls.directory) for name, options in MODELS}
        cls.folders["t5-tied-scores"] = tied_scores(cls.folders["t5-nmt-nfkc"], cls.directory)
        cls.captions = (CAPTIONS + fixtures.TEXTS + fixtures.random_texts(200) + unicode_texts.separator_texts())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, ignore_errors=True)

    def check(self, name, folder):
        from transformers import T5TokenizerFast

        reference = T5TokenizerFast.from_pretrained(folder)
        saved = os.path.join(self.directory, name + "-saved")
        reference.save_pretrained(saved)
        for max_length in (512, 16):
            expected = reference(self.captions, padding="max_length", max_length=max_length, truncation=True).input_ids
            plain = reference(self.captions, add_special_tokens=False).input_ids
            for source in (os.path.join(folder, "spiece.model"), os.path.join(saved, "tokenizer.json"), saved):
                got = forge_tokenize(source, self.captions, max_length)
                for caption, want, want_plain, result in zip(self.captions, expected, plain, got):
                    self.assertEqual(result["prompt"], want, f"{source}, max_length {max_length}: {caption!r}")
                    self.assertEqual(result["ids"], want_plain, f"{source}: {caption!r}")

    def test_models(self):
        for name, folder in self.folders.items():
            with self.subTest(name):
                self.check(name, folder)

    def test_refusals(self):
        import sentencepiece

        bad = os.path.join(self.directory, "bad-layout")
        os.makedirs(bad)
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(tokenizer_fixtures.corpus(300)),
                                                 model_writer=model, **fixtures.COMMON_OPTIONS)  # <unk>, <s>, </s>
        with open(os.path.join(bad, "spiece.model"), "wb") as f:
            f.write(model.getvalue())
        result = subprocess.run([REFERENCE, "tokenize", bad, "/dev/null", "/dev/null", "8"], capture_output=True,
                                text=True)
        self.assertEqual(result.returncode, 1)
        self.assertIn("T5's tokenizer has <pad>, </s>, <unk> as ids 0, 1, 2", result.stderr)
        self.assertIn("spiece.model", result.stderr)

        empty = forge_test_util.scratch_dir()
        result = subprocess.run([REFERENCE, "tokenize", empty, "/dev/null", "/dev/null", "8"], capture_output=True,
                                text=True)
        self.assertEqual(result.returncode, 1)
        self.assertIn("no T5 tokenizer here", result.stderr)


if __name__ == "__main__":
    unittest.main()
