// forge prep --format sft, the library half: parsing the three example shapes and their
// errors, the built-in chat templates' exact text, template recognition, the loss mask
// (including tokens that straddle a response boundary), --seq-len handling, BOS, and
// prepare_dataset end to end with the paired mask dataset and its atomic replacement.
// Token-for-token agreement with transformers is tests/python/test_sft_prep_vs_hf.py's.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/chat_template_choice.h"
#include "data/dataset_prep.h"
#include "data/indexed_dataset.h"
#include "data/sft_dataset_writer.h"
#include "data/sft_example.h"
#include "data/sft_tokenize.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"
#include "test_prep_support.h"

namespace forge {
namespace {

// Greedy longest match over special tokens, optional multi-byte pieces and single bytes
// (byte b is id b + 100), so a test controls which texts merge into one token.
class PieceTokenizer : public Tokenizer {
 public:
  explicit PieceTokenizer(std::map<std::string, int32_t> pieces = {}) : pieces_(std::move(pieces)) {
    const std::vector<std::string> specials = {"<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|eot_id|>"};
    for (size_t i = 0; i < specials.size(); ++i) pieces_[specials[i]] = static_cast<int32_t>(i + 1);
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t best = 0;
      int32_t id = 100 + static_cast<unsigned char>(text[pos]);
      for (const auto& [piece, piece_id] : pieces_)
        if (piece.size() > best && text.substr(pos, piece.size()) == piece) best = piece.size(), id = piece_id;
      ids.push_back(id);
      pos += std::max<size_t>(best, 1);
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>&) const override { return ""; }
  int64_t vocab_size() const override { return 1000; }
  std::optional<int32_t> bos_id() const override { return bos; }
  std::optional<int32_t> eos_id() const override { return eos; }

  std::optional<int32_t> bos = 1, eos = 2;

 private:
  std::map<std::string, int32_t> pieces_;
};

std::vector<ChatMessage> chat(std::initializer_list<std::pair<ChatRole, std::string>> turns) {
  std::vector<ChatMessage> messages;
  for (const auto& [role, content] : turns) messages.push_back({role, content});
  return messages;
}

constexpr ChatRole S = ChatRole::System, U = ChatRole::User, A = ChatRole::Assistant;

std::vector<std::string> span_texts(const RenderedText& rendered) {
  std::vector<std::string> texts;
  for (const auto& [b, e] : rendered.response_spans) texts.push_back(rendered.text.substr(b, e - b));
  return texts;
}

TEST(SftExample, ThreeShapes) {
  SftExample pc = parse_sft_line(R"({"prompt": "p", "completion": "c", "id": 3})");
  EXPECT_EQ(pc.shape, SftShape::PromptCompletion);
  EXPECT_EQ(pc.prompt + "|" + pc.completion, "p|c");

  SftExample alpaca = parse_sft_line(R"({"instruction": "Add.", "input": "2 3", "output": "5"})");
  EXPECT_EQ(alpaca.shape, SftShape::Alpaca);
  EXPECT_EQ(alpaca.prompt,
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Input:\n"
            "2 3\n\n### Response:\n");
  EXPECT_EQ(alpaca.completion, "5");
  const std::string no_input =
      "Below is an instruction that describes a task. Write a response that appropriately completes the request."
      "\n\n### Instruction:\nAdd.\n\n### Response:\n";
  EXPECT_EQ(parse_sft_line(R"({"instruction": "Add.", "output": "5"})").prompt, no_input);
  EXPECT_EQ(parse_sft_line(R"({"instruction": "Add.", "input": "", "output": "5"})").prompt, no_input);
  EXPECT_EQ(parse_sft_line(R"({"instruction": "Add.", "input": null, "output": "5"})").prompt, no_input);

  SftExample messages = parse_sft_line(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": "a\u00e9"}]})");
  ASSERT_EQ(messages.messages.size(), 3u);
  EXPECT_EQ(messages.messages[0].role, ChatRole::System);
  EXPECT_EQ(messages.messages[2].content, "a\xc3\xa9");
}

TEST(SftExample, BadLinesNameTheField) {
  auto parse = [](const std::string& line) { return [line] { parse_sft_line(line); }; };
  expect_error(parse("{\"prompt\": 1"), {"not valid JSON"});
  expect_error(parse("[1, 2]"), {"is a list, expected a JSON object"});
  expect_error(parse(R"({"text": "x"})"), {"no known keys", "\"messages\"", "\"prompt\"", "\"instruction\""});
  expect_error(parse(R"({"prompt": "p"})"), {"\"completion\" is missing"});
  expect_error(parse(R"({"prompt": "p", "completion": 5})"), {"\"completion\" is a number, expected a string"});
  expect_error(parse(R"({"instruction": "i"})"), {"\"output\" is missing"});
  expect_error(parse(R"({"instruction": "i", "input": 3, "output": "o"})"), {"\"input\" is a number"});
  expect_error(parse(R"({"messages": [], "prompt": "p"})"), {"mixes shapes"});
  expect_error(parse(R"({"messages": []})"), {"\"messages\" is an empty list"});
  expect_error(parse(R"({"messages": {"role": "user"}})"), {"\"messages\" is an object, expected a list"});
  expect_error(parse(R"({"messages": ["hi"]})"), {"messages[0] is a string, expected an object"});
  expect_error(parse(R"({"messages": [{"content": "x"}]})"), {"messages[0].role is missing"});
  expect_error(parse(R"({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})"),
               {"messages[1].role is \"tool\"", "expected \"system\", \"user\" or \"assistant\""});
  expect_error(parse(R"({"messages": [{"role": "user", "content": null}]})"),
               {"messages[0].content is null, expected a string"});
  expect_error(parse(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})"),
               {"messages[0].content is a list"});
}

TEST(ChatTemplate, Llama3Text) {
  const auto messages = chat({{S, "  Be brief. "}, {U, " hi\n"}, {A, "\u00a0hello "}, {U, "x"}, {A, "y"}});
  const RenderedText r =
      render_chat(ChatTemplate::Llama3, messages, default_special_tokens(ChatTemplate::Llama3), TrainOn::AllAssistantTurns);
  EXPECT_EQ(r.text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>user<|end_header_id|>"
            "\n\nx<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\ny<|eot_id|>");
  EXPECT_EQ(span_texts(r), (std::vector<std::string>{"hello<|eot_id|>", "y<|eot_id|>"}));
  const RenderedText last = render_chat(ChatTemplate::Llama3, messages, default_special_tokens(ChatTemplate::Llama3),
                                        TrainOn::LastAssistantTurn);
  EXPECT_EQ(last.text, r.text);
  EXPECT_EQ(span_texts(last), (std::vector<std::string>{"y<|eot_id|>"}));
  // Without a system message the system turn is still there, empty.
  const RenderedText bare = render_chat(ChatTemplate::Llama3, chat({{U, "q"}, {A, "a"}}),
                                        default_special_tokens(ChatTemplate::Llama3), TrainOn::AllAssistantTurns);
  EXPECT_NE(bare.text.find("Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user"), std::string::npos);
}

TEST(ChatTemplate, Llama2AndMistralText) {
  const ChatSpecialTokens tokens{.bos = "<s>", .eos = "</s>"};
  const RenderedText llama2 = render_chat(ChatTemplate::Llama2, chat({{S, " sys "}, {U, " q1 "}, {A, " a1 "}, {U, "q2"}, {A, "a2"}}),
                                          tokens, TrainOn::AllAssistantTurns);
  EXPECT_EQ(llama2.text, "<s>[INST] <<SYS>>\n sys \n<</SYS>>\n\n q1 [/INST] a1 </s><s>[INST] q2 [/INST] a2 </s>");
  EXPECT_EQ(span_texts(llama2), (std::vector<std::string>{" a1 </s>", " a2 </s>"}));

  const RenderedText mistral =
      render_chat(ChatTemplate::Mistral, chat({{U, " q1 "}, {A, " a1 "}, {U, "q2"}, {A, "a2"}}), tokens,
                  TrainOn::AllAssistantTurns);
  EXPECT_EQ(mistral.text, "<s>[INST]  q1  [/INST] a1 </s>[INST] q2 [/INST]a2</s>");
  EXPECT_EQ(span_texts(mistral), (std::vector<std::string>{" a1 </s>", "a2</s>"}));
}

TEST(ChatTemplate, RefusedConversationsNameTheMessage) {
  const ChatSpecialTokens tokens{.bos = "<s>", .eos = "</s>"};
  auto render = [&](ChatTemplate t, std::vector<ChatMessage> m) {
    return [=] { render_chat(t, m, tokens, TrainOn::AllAssistantTurns); };
  };
  expect_error(render(ChatTemplate::Llama3, chat({{U, "q"}})), {"no assistant message"});
  expect_error(render(ChatTemplate::Llama3, {}), {"empty list"});
  expect_error(render(ChatTemplate::Llama2, chat({{U, "q"}, {U, "q"}, {A, "a"}})),
               {"messages[1].role is \"user\"", "alternating", "must be \"assistant\""});
  expect_error(render(ChatTemplate::Llama2, chat({{A, "a"}, {U, "q"}})), {"messages[0].role is \"assistant\""});
  expect_error(render(ChatTemplate::Llama2, chat({{U, "q"}, {A, "a"}, {S, "s"}})),
               {"messages[2].role is \"system\"", "only as the first message"});
  expect_error(render(ChatTemplate::Mistral, chat({{S, "s"}, {U, "q"}, {A, "a"}})),
               {"messages[0].role is \"system\"", "mistral", "no system message"});
}

TEST(ChatTemplate, PythonStripIsUnicodeAware) {
  EXPECT_EQ(python_strip(" \t\n\x1c\u00a0\u3000x y\u2028\r "), "x y");
  EXPECT_EQ(python_strip("\u200bx"), "\u200bx");  // zero width space is not whitespace
  EXPECT_EQ(python_strip("   "), "");
}

TEST(ChatTemplate, RecognitionIgnoresLayoutNotContent) {
  for (ChatTemplate t : {ChatTemplate::Llama3, ChatTemplate::Llama2, ChatTemplate::Mistral}) {
    const std::string source(chat_template_source(t));
    EXPECT_EQ(recognize_chat_template(source), t);
    std::string reindented;  // a line break and indentation after every tag
    for (size_t i = 0; i < source.size(); ++i) {
      reindented += source[i];
      if (i > 0 && source[i] == '}' && (source[i - 1] == '}' || source[i - 1] == '%')) reindented += "\n  ";
    }
    EXPECT_EQ(recognize_chat_template(reindented), t) << chat_template_name(t);
  }
  std::string llama2(chat_template_source(ChatTemplate::Llama2));
  EXPECT_EQ(recognize_chat_template(llama2.replace(llama2.find("'[INST] '"), 9, "'[INST]'")), std::nullopt);
  std::string mistral(chat_template_source(ChatTemplate::Mistral));
  EXPECT_EQ(recognize_chat_template("X" + mistral), std::nullopt);
  EXPECT_EQ(recognize_chat_template("{{ messages }}"), std::nullopt);
  // Comments and whitespace-control markers do not matter; literal whitespace does.
  EXPECT_EQ(normalize_chat_template("{#- note #}{{- 'a b' -}}\n  {% if x %}"), "{{'a b'}}{%ifx%}");
}

TEST(SftTokens, MaskCoversResponsesAndStraddlingTokens) {
  const PieceTokenizer tokenizer({{"ab", 500}});
  RenderedText rendered{.text = "xxab</s>", .response_spans = {{3, 8}}};  // "b</s>": "ab" straddles the start
  SftTokens tokens = tokenize_rendered(tokenizer, rendered);
  EXPECT_EQ(tokens.ids, (std::vector<int32_t>{220, 220, 500, 2}));
  EXPECT_EQ(tokens.mask, (std::vector<uint8_t>{0, 0, 1, 1}));
  rendered = {.text = "xab", .response_spans = {{0, 2}}};  // "xa": "ab" straddles the end
  tokens = tokenize_rendered(tokenizer, rendered);
  EXPECT_EQ(tokens.mask, (std::vector<uint8_t>{1, 1}));
  rendered = {.text = "q<s>r", .response_spans = {{4, 5}}};  // clean boundaries
  EXPECT_EQ(tokenize_rendered(tokenizer, rendered).mask, (std::vector<uint8_t>{0, 0, 1}));
}

TEST(SftTokens, EncoderPlainAndTemplatedWithBos) {
  PieceTokenizer tokenizer;
  const SftExample example = parse_sft_line(R"({"prompt": "ab", "completion": "c"})");
  const SftEncoder plain(tokenizer, {.prepend_bos = true});
  SftTokens tokens = plain.encode(example);
  EXPECT_EQ(tokens.ids, (std::vector<int32_t>{1, 197, 198, 199, 2}));
  EXPECT_EQ(tokens.mask, (std::vector<uint8_t>{0, 0, 0, 1, 1}));

  const SftEncoder mistral(tokenizer, {.chat_template = ChatTemplate::Mistral,
                                       .special_tokens = default_special_tokens(ChatTemplate::Mistral),
                                       .prepend_bos = true});
  tokens = mistral.encode(example);  // the template's <s> is the BOS: not doubled
  EXPECT_EQ(mistral.render(example).text, "<s>[INST] ab [/INST]c</s>");
  EXPECT_EQ(std::count(tokens.ids.begin(), tokens.ids.end(), 1), 1);
  EXPECT_EQ(tokens.ids.front(), 1);
  EXPECT_EQ(std::vector<uint8_t>(tokens.mask.end() - 3, tokens.mask.end()), (std::vector<uint8_t>{0, 1, 1}));

  std::vector<int32_t> ids = {7};
  EXPECT_TRUE(prepend_bos_once(ids, 1));
  EXPECT_FALSE(prepend_bos_once(ids, 1));
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 7}));

  expect_error([&] { plain.encode(parse_sft_line(R"({"messages": [{"role": "user", "content": "x"}]})")); },
               {"needs a chat template", "--chat-template llama3|llama2|mistral"});
  test::ByteTokenizer bytes;
  expect_error([&] { SftEncoder(bytes, {.chat_template = ChatTemplate::Llama3}); },
               {"llama3 chat template writes", "not as one special token"});
  expect_error([&] { SftEncoder(bytes, {.prepend_bos = true}); }, {"--prepend-bos", "no BOS"});
  tokenizer.eos = std::nullopt;
  expect_error([&] { SftEncoder(tokenizer, {}); }, {"no EOS"});
}

TEST(SftTokens, SeqLenTruncatesDropsAndCounts) {
  auto example = [] { return SftTokens{.ids = {1, 2, 3, 4, 5}, .mask = {0, 0, 1, 1, 1}}; };
  SftTokens t = example();
  EXPECT_EQ(fit_to_seq_len(t, 4, Overlong::Truncate), SeqLenFit::Fits);  // 5 tokens = seq_len + 1
  EXPECT_EQ(fit_to_seq_len(t, 0, Overlong::Drop), SeqLenFit::Fits);
  EXPECT_EQ(fit_to_seq_len(t, 3, Overlong::Truncate), SeqLenFit::Truncated);
  EXPECT_EQ(t.ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(t.mask, (std::vector<uint8_t>{0, 0, 1, 1}));
  t = example();
  EXPECT_EQ(fit_to_seq_len(t, 3, Overlong::Drop), SeqLenFit::DroppedOverlong);
  t = example();
  EXPECT_EQ(fit_to_seq_len(t, 1, Overlong::Truncate), SeqLenFit::DroppedNoResponse);
}

// The tokens of each document (its sequences concatenated).
std::vector<std::vector<int64_t>> documents(const std::string& prefix) {
  IndexedDataset data(prefix);
  std::vector<std::vector<int64_t>> out;
  for (int64_t d = 0; d < data.num_documents(); ++d) {
    std::vector<int64_t> tokens;
    for (int64_t s = data.document_index(d); s < data.document_index(d + 1); ++s)
      for (int64_t i = 0; i < data.sequence_length(s); ++i) tokens.push_back(data.token(s, i));
    out.push_back(tokens);
  }
  return out;
}

PrepOptions sft_options(std::vector<std::string> inputs, std::string prefix) {
  PrepOptions options{.format = PrepFormat::Sft, .inputs = std::move(inputs), .output_prefix = std::move(prefix)};
  options.workers = 2;
  return options;
}

TEST(SftPrep, WritesTokensAndMaskPairAndCounts) {
  TempDir dir;
  test::write_gzip_file(dir.file("a.jsonl.gz"),
                        "{\"prompt\": \"ab\", \"completion\": \"c\"}\n\n"
                        "{\"prompt\": \"long prompt\", \"completion\": \"long completion\"}\n"
                        "{\"prompt\": \"a very long prompt indeed\", \"completion\": \"x\"}\n");
  PieceTokenizer tokenizer;
  PrepOptions options = sft_options({dir.file("a.jsonl.gz")}, dir.file("out"));
  options.seq_len = 14;
  const PrepSummary summary = prepare_dataset(options, tokenizer);
  EXPECT_EQ(summary.examples_read, 3);
  EXPECT_EQ(summary.documents, 2);
  EXPECT_EQ(summary.truncated, 1);  // the third, cut, has no response left: counted as dropped
  EXPECT_EQ(summary.dropped_no_response, 1);
  EXPECT_EQ(summary.tokens, 4 + 15);
  EXPECT_EQ(summary.response_tokens, 2 + 4);
  const auto tokens = documents(dir.file("out"));
  const auto mask = documents(dir.file("out.mask"));
  const IndexedDataset token_data(dir.file("out")), mask_data(dir.file("out.mask"));
  EXPECT_EQ(mask_data.dtype(), IndexedDType::U8);
  EXPECT_EQ(token_data.num_sequences(), 2);
  EXPECT_EQ(token_data.num_documents(), 2);
  EXPECT_EQ(mask_data.num_sequences(), 2);
  EXPECT_EQ(mask_data.num_documents(), 2);
  ASSERT_EQ(tokens.size(), 2u);
  EXPECT_EQ(tokens[0], (std::vector<int64_t>{197, 198, 199, 2}));
  EXPECT_EQ(mask[0], (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(tokens[1].size(), 15u);
  EXPECT_EQ(mask[1], (std::vector<int64_t>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1}));

  options.overlong = Overlong::Drop;
  const PrepSummary dropped = prepare_dataset(options, tokenizer);
  EXPECT_EQ(dropped.documents, 1);
  EXPECT_EQ(dropped.dropped_overlong, 2);
  EXPECT_EQ(documents(dir.file("out.mask")).size(), 1u);
}

TEST(SftPrep, BadLinesNameFileLineAndFieldAndKeepTheOldPair) {
  TempDir dir;
  test::write_file(dir.file("good.jsonl"), "{\"prompt\": \"a\", \"completion\": \"b\"}\n");
  test::write_file(dir.file("bad.jsonl"),
                   "{\"prompt\": \"a\", \"completion\": \"b\"}\n\n{\"messages\": [{\"role\": \"bot\", \"content\": "
                   "\"x\"}]}\n");
  PieceTokenizer tokenizer;
  const std::string prefix = dir.file("out");
  prepare_dataset(sft_options({dir.file("good.jsonl")}, prefix), tokenizer);
  const std::string bin = test::read_file(prefix + ".bin"), mask_idx = test::read_file(prefix + ".mask.idx");
  expect_error([&] { prepare_dataset(sft_options({dir.file("bad.jsonl")}, prefix), tokenizer); },
               {dir.file("bad.jsonl") + ":3:", "messages[0].role is \"bot\"", "--skip-bad-lines"});
  PrepOptions messages_without_template = sft_options({dir.file("bad.jsonl")}, prefix);
  messages_without_template.skip_bad_lines = true;
  const PrepSummary skipped = prepare_dataset(messages_without_template, tokenizer);
  EXPECT_EQ(skipped.skipped_lines, 1);
  EXPECT_EQ(skipped.documents, 1);
  prepare_dataset(sft_options({dir.file("good.jsonl")}, prefix), tokenizer);
  EXPECT_EQ(test::read_file(prefix + ".bin"), bin);
  EXPECT_EQ(test::read_file(prefix + ".mask.idx"), mask_idx);

  // A directory where the mask goes: refused before anything moves; the old pair stays.
  std::filesystem::remove(prefix + ".mask.bin");
  std::filesystem::create_directory(prefix + ".mask.bin");
  expect_error([&] { prepare_dataset(sft_options({dir.file("good.jsonl")}, prefix), tokenizer); },
               {prefix + ".mask.bin", "is a directory"});
  EXPECT_EQ(test::read_file(prefix + ".bin"), bin);
  EXPECT_EQ(test::read_file(prefix + ".mask.idx"), mask_idx);
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file(""))) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"bad.jsonl", "good.jsonl", "out.bin", "out.idx", "out.mask.bin",
                                             "out.mask.idx"}));
}

TEST(SftPrep, TextPrepRemovesAStaleMaskAndPrependsBos) {
  TempDir dir;
  test::write_file(dir.file("sft.jsonl"), "{\"prompt\": \"a\", \"completion\": \"b\"}\n");
  test::write_file(dir.file("text.jsonl"), "{\"text\": \"xy\"}\n{\"text\": \"<s>z\"}\n{\"text\": \"\"}\n");
  PieceTokenizer tokenizer;
  const std::string prefix = dir.file("out");
  prepare_dataset(sft_options({dir.file("sft.jsonl")}, prefix), tokenizer);
  ASSERT_TRUE(std::filesystem::exists(prefix + ".mask.idx"));
  PrepOptions text{.inputs = {dir.file("text.jsonl")}, .output_prefix = prefix};
  text.prepend_bos = true;
  prepare_dataset(text, tokenizer);
  EXPECT_FALSE(std::filesystem::exists(prefix + ".mask.idx"));
  EXPECT_FALSE(std::filesystem::exists(prefix + ".mask.bin"));
  const auto tokens = documents(prefix);
  ASSERT_EQ(tokens.size(), 3u);
  EXPECT_EQ(tokens[0], (std::vector<int64_t>{1, 220, 221, 2}));
  EXPECT_EQ(tokens[1], (std::vector<int64_t>{1, 222, 2}));  // already started with BOS
  EXPECT_EQ(tokens[2], std::vector<int64_t>{});             // an empty text stays an empty document
}

TEST(SftPrep, BadOptionsAreRefused) {
  TempDir dir;
  test::write_file(dir.file("a.jsonl"), "{\"prompt\": \"a\", \"completion\": \"b\"}\n");
  test::write_file(dir.file("a.txt"), "text");
  PieceTokenizer tokenizer;
  expect_error([&] { prepare_dataset(sft_options({dir.file("a.txt")}, dir.file("o")), tokenizer); },
               {dir.file("a.txt"), "--format sft reads JSON Lines"});
  PrepOptions options = sft_options({dir.file("a.jsonl")}, dir.file("o"));
  options.json_key = "body";
  expect_error([&] { prepare_dataset(options, tokenizer); }, {"--json-key", "--format text"});
  PrepOptions text{.inputs = {dir.file("a.jsonl")}, .output_prefix = dir.file("o")};
  text.seq_len = 8;
  expect_error([&] { prepare_dataset(text, tokenizer); }, {"--seq-len applies to --format sft"});
  tokenizer.bos = std::nullopt;
  text.seq_len = 0;
  text.prepend_bos = true;
  expect_error([&] { prepare_dataset(text, tokenizer); }, {"--prepend-bos", "no BOS"});
  EXPECT_FALSE(std::filesystem::exists(dir.file("o.bin")));
}

TEST(ChatTemplateChoice, FromOptionAndTokenizerConfig) {
  TempDir dir;
  const std::string tokenizer = dir.file("tokenizer.json");
  test::write_file(tokenizer, "{}");
  EXPECT_EQ(choose_chat_template("", tokenizer).chat_template, std::nullopt);
  expect_error([&] { choose_chat_template("auto", tokenizer); }, {"tokenizer_config.json not found", "llama3"});
  const ChatTemplateChoice named = choose_chat_template("llama2", tokenizer);
  EXPECT_EQ(named.chat_template, ChatTemplate::Llama2);
  EXPECT_EQ(named.special_tokens.bos, "<s>");
  EXPECT_EQ(choose_chat_template("none", tokenizer).chat_template, std::nullopt);
  expect_error([&] { choose_chat_template("chatml", tokenizer); }, {"--chat-template 'chatml'"});

  nlohmann::json config = {{"bos_token", {{"content", "<B>"}, {"special", true}}},
                           {"eos_token", "<E>"},
                           {"chat_template", std::string(chat_template_source(ChatTemplate::Mistral))}};
  test::write_file(dir.file("tokenizer_config.json"), config.dump());
  for (const char* option : {"", "auto"}) {
    const ChatTemplateChoice choice = choose_chat_template(option, dir.file(""));
    EXPECT_EQ(choice.chat_template, ChatTemplate::Mistral);
    EXPECT_EQ(choice.special_tokens.bos, "<B>");
    EXPECT_EQ(choice.special_tokens.eos, "<E>");
  }
  config["chat_template"] = nlohmann::json::array(
      {{{"name", "tool_use"}, {"template", "x"}},
       {{"name", "default"}, {"template", std::string(chat_template_source(ChatTemplate::Llama3))}}});
  test::write_file(dir.file("tokenizer_config.json"), config.dump());
  EXPECT_EQ(choose_chat_template("", tokenizer).chat_template, ChatTemplate::Llama3);
  config["chat_template"] = "{% for m in messages %}{{ '<|im_start|>' + m['content'] }}{% endfor %}";
  test::write_file(dir.file("tokenizer_config.json"), config.dump());
  expect_error([&] { choose_chat_template("", tokenizer); },
               {dir.file("tokenizer_config.json"), "none of the templates", "--chat-template none"});
  EXPECT_EQ(choose_chat_template("llama3", tokenizer).chat_template, ChatTemplate::Llama3);
  config["chat_template"] = 5;
  test::write_file(dir.file("tokenizer_config.json"), config.dump());
  expect_error([&] { choose_chat_template("auto", tokenizer); }, {"\"chat_template\" is 5"});
}

}  // namespace
}  // namespace forge
