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
#include "core/log.h"
#include "core/progress.h"

namespace forge {
namespace {

std::string describe(const PrepProgress& p) {
  const double seconds = std::max(p.seconds, 1e-9);
  return fmt::format("{} / {} | {} docs ({:.0f} docs/s) | {}/s", format_bytes(static_cast<double>(p.input_bytes_read)),
                     format_bytes(static_cast<double>(p.input_bytes_total)), p.documents, p.documents / seconds,
                     format_bytes(static_cast<double>(p.input_bytes_read) / seconds));
}

}  // namespace

int run_prep(const PrepOptions& options, const std::string& tokenizer_path) {
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(tokenizer_path);
  log_info("prep: {} input file{} -> {}.bin / .idx, tokenizer {} (vocab {}), EOS {}", options.inputs.size(),
           options.inputs.size() == 1 ? "" : "s", options.output_prefix, tokenizer_path, tokenizer->vocab_size(),
           options.append_eod ? fmt::format("{} appended to every document", tokenizer->eos_id().value_or(-1))
                              : std::string("not appended"));
  ProgressReporter progress(::isatty(STDERR_FILENO) != 0);
  progress.start(static_cast<double>(prep_input_bytes(options.inputs)), "prep");
  const PrepSummary summary = prepare_dataset(options, *tokenizer, [&](const PrepProgress& p) {
    progress.update(static_cast<double>(p.input_bytes_read), describe(p));
  });
  progress.finish();
  const double seconds = std::max(summary.seconds, 1e-9);
  log_info("prep: {} documents ({} without tokens), {} tokens ({}), {} lines skipped", summary.documents,
           summary.empty_documents, summary.tokens, indexed_dtype_name(summary.dtype), summary.skipped_lines);
  log_info("prep: input {} ({} of text), output {}, {:.2f} s: {:.0f} docs/s, {}/s of input, {:.0f} tokens/s",
           format_bytes(static_cast<double>(summary.input_bytes)), format_bytes(static_cast<double>(summary.text_bytes)),
           format_bytes(static_cast<double>(summary.output_bytes)), summary.seconds, summary.documents / seconds,
           format_bytes(static_cast<double>(summary.input_bytes) / seconds), summary.tokens / seconds);
  log_info("prep: wrote {}.bin and {}.idx", options.output_prefix, options.output_prefix);
  return 0;
}

}  // namespace forge
