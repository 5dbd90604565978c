// forge prep: loads the tokenizer, runs prepare_dataset with a progress display, and
// prints a summary. The options themselves are declared in main.cpp with the other
// subcommands' arguments.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "cli/commands.h"
#include "cli/prep_progress.h"
#include "core/log.h"

namespace forge {

int run_prep(const PrepOptions& options, const std::string& tokenizer_path) {
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(tokenizer_path);
  log_info("prep: {} input file{} -> {}.bin / .idx, tokenizer {} (vocab {}), EOS {}", options.inputs.size(),
           options.inputs.size() == 1 ? "" : "s", options.output_prefix, tokenizer_path, tokenizer->vocab_size(),
           options.append_eod ? fmt::format("{} appended to every document", tokenizer->eos_id().value_or(-1))
                              : std::string("not appended"));
  PrepProgressPrinter printer(::isatty(STDERR_FILENO) != 0);
  PrepSummary summary;
  try {
    summary = prepare_dataset(options, *tokenizer, [&](const PrepProgress& progress) { printer.update(progress); });
  } catch (...) {
    printer.finish();
    throw;
  }
  printer.finish();
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
