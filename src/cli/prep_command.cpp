// forge prep: loads the tokenizer, runs prepare_dataset with a progress display, and
// prints a summary. The options themselves are declared in main.cpp with the other
// subcommands' arguments.
//
// Progress (core/progress.h) counts input bytes read out of the inputs' total size, with
// documents per second and MB/s of input as the line's own figures.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "data/chat_template_choice.h"
#include "data/sft_dataset_writer.h"

namespace forge {
namespace {

std::string describe(const PrepProgress& p) {
  const double seconds = std::max(p.seconds, 1e-9);
  return fmt::format("{} / {} | {} docs ({:.0f} docs/s) | {}/s", format_bytes(static_cast<double>(p.input_bytes_read)),
                     format_bytes(static_cast<double>(p.input_bytes_total)), p.documents, p.documents / seconds,
                     format_bytes(static_cast<double>(p.input_bytes_read) / seconds));
}

void log_sft_plan(const PrepOptions& options, const ChatTemplateChoice& choice) {
  log_info("prep: --format sft, chat template {} ({}), trained on {} assistant turn, {}, writes {}.bin/.idx "
           "and {}.mask.bin/.idx",
           choice.chat_template ? chat_template_name(*choice.chat_template) : std::string_view("none"), choice.origin,
           options.sft.train_on == TrainOn::LastAssistantTurn ? "the last" : "every",
           options.seq_len > 0 ? fmt::format("--seq-len {} ({} overlong examples)", options.seq_len,
                                             options.overlong == Overlong::Drop ? "dropping" : "truncating")
                               : std::string("no length limit"),
           options.output_prefix, options.output_prefix);
}

void log_sft_summary(const PrepSummary& summary) {
  log_info("prep: {} examples read, {} written, {} truncated, {} dropped as overlong, {} dropped with no response "
           "token left, {} lines skipped; {} tokens ({}), {} of them response tokens",
           summary.examples_read, summary.documents, summary.truncated, summary.dropped_overlong,
           summary.dropped_no_response, summary.skipped_lines, summary.tokens, indexed_dtype_name(summary.dtype),
           summary.response_tokens);
}

}  // namespace

int run_prep(PrepOptions options, const std::string& tokenizer_path, const std::string& chat_template) {
  if (options.format == PrepFormat::Text && !chat_template.empty())
    FORGE_FAIL("--chat-template applies to --format sft");
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(tokenizer_path);
  log_info("prep: {} input file{} -> {}.bin / .idx, tokenizer {} (vocab {}), EOS {}, BOS {}", options.inputs.size(),
           options.inputs.size() == 1 ? "" : "s", options.output_prefix, tokenizer_path, tokenizer->vocab_size(),
           options.format == PrepFormat::Sft ? std::string("as the format says")
           : options.append_eod ? fmt::format("{} appended to every document", tokenizer->eos_id().value_or(-1))
                                : std::string("not appended"),
           options.prepend_bos ? fmt::format("{} prepended where missing", tokenizer->bos_id().value_or(-1))
                               : std::string("not prepended"));
  if (options.format == PrepFormat::Sft) {
    const ChatTemplateChoice choice = choose_chat_template(chat_template, tokenizer_path);
    options.sft.chat_template = choice.chat_template;
    options.sft.special_tokens = choice.special_tokens;
    log_sft_plan(options, choice);
  }
  ProgressReporter progress(::isatty(STDERR_FILENO) != 0);
  progress.start(static_cast<double>(prep_input_bytes(options.inputs)), "prep");
  const PrepSummary summary = prepare_dataset(options, *tokenizer, [&](const PrepProgress& p) {
    progress.update(static_cast<double>(p.input_bytes_read), describe(p));
  });
  progress.finish();
  const double seconds = std::max(summary.seconds, 1e-9);
  if (options.format == PrepFormat::Sft) log_sft_summary(summary);
  else log_info("prep: {} documents ({} without tokens), {} tokens ({}), {} lines skipped", summary.documents,
           summary.empty_documents, summary.tokens, indexed_dtype_name(summary.dtype), summary.skipped_lines);
  log_info("prep: input {} ({} of text), output {}, {:.2f} s: {:.0f} docs/s, {}/s of input, {:.0f} tokens/s",
           format_bytes(static_cast<double>(summary.input_bytes)), format_bytes(static_cast<double>(summary.text_bytes)),
           format_bytes(static_cast<double>(summary.output_bytes)), summary.seconds, summary.documents / seconds,
           format_bytes(static_cast<double>(summary.input_bytes) / seconds), summary.tokens / seconds);
  if (options.format == PrepFormat::Sft)
    log_info("prep: wrote {}.bin, {}.idx, {}.bin and {}.idx", options.output_prefix, options.output_prefix,
             mask_prefix(options.output_prefix), mask_prefix(options.output_prefix));
  else
    log_info("prep: wrote {}.bin and {}.idx", options.output_prefix, options.output_prefix);
  return 0;
}

}  // namespace forge
