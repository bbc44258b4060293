// libFuzzer target for the policy file loader (egressd::parse_policy_document over
// yaml-cpp, src/policy/policy_file.cc: egressd's YAML/JSON policy, and AgentCompass
// env-params when the top-level keys say so), and for the compiler a valid policy feeds
// (src/nft/compile.cc, render.cc). Policy files come from the orchestrator, which is
// trusted, but they are hand-written and often generated from task metadata: a
// malformed one must be an error naming the file, never a crash or a hang of the daemon
// or of `egressd check`.
// Properties checked for every input: no crash, no hang (libFuzzer -timeout), no UB;
// and those of policy_checks.h (errors name the file; an accepted policy is internally
// consistent and every phase compiles). Inputs are also read with parse_policy (egressd
// format only), which must agree with the document reader on egressd policies.
// The same bytes are also read as the state comment a restarted egressd
// adopts from the kernel (ActiveState::parse_comment, digest_from_table_
// comment): whoever can write the table can write those, so they must parse
// as values, and what parses must print and parse back the same.
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "egressd/policy.h"
#include "egressd/policy_input.h"
#include "fuzz_check.h"
#include "nft/compile.h"
#include "nft/model.h"
#include "policy_checks.h"

using namespace egressd;

namespace {

constexpr std::string_view kFile = "fuzz.yaml";

}  // namespace

void check_state_comment(const std::string& text) {
  (void)nft::digest_from_table_comment(text);
  const auto st = nft::ActiveState::parse_comment(text);
  if (!st.ok()) {
    FUZZ_CHECK(st.error().kind == ErrorKind::invalid);
    return;
  }
  const auto again = nft::ActiveState::parse_comment(st->to_comment());
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->generation == st->generation && again->phase == st->phase && again->mode == st->mode &&
             again->mark == st->mark && again->is_inline == st->is_inline);
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_state_comment(std::string(text));
  const Result<PolicyDocument> doc = parse_policy_document(text, kFile);
  fuzz_policy::check_document(doc, kFile);
  const Result<Policy> r = parse_policy(text, kFile);
  if (!r.ok()) {
    FUZZ_CHECK(r.error().kind == ErrorKind::invalid);
    FUZZ_CHECK(r.error().message.rfind(std::string(kFile) + ":", 0) == 0);
    // Only env-params are read by the document reader and not by parse_policy.
    FUZZ_CHECK(!doc.ok() || doc->format == PolicyFormat::env_params);
    return 0;
  }
  FUZZ_CHECK(doc.ok() && doc->format == PolicyFormat::egressd && doc->policy.phases.size() == r->phases.size());
  return 0;
}
