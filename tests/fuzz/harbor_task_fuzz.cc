// libFuzzer target for the Harbor task.toml reader (egressd::parse_harbor_task,
// src/policy/harbor_task.cc over toml++, compiled in header-only with the same
// instrumentation), and for the compiler the policy it yields feeds. A task.toml comes
// from a task author, possibly from a public benchmark: a malformed or hostile one must be
// an error naming the file, never a crash or a hang of `egressd check|run`.
// Properties checked for every input: no crash, no hang, no UB, and those of
// policy_checks.h (errors start "fuzz.toml:"; an accepted policy has valid unique phase
// names, environment first and initial, entries only in allowlist phases and each a
// normalized fixed point of parse_entry, one origin per phase, every phase compiles).
// Also: the document reader picks this reader for a ".toml" name, with the same result.
#include <cstdint>
#include <string>
#include <string_view>

#include "egressd/policy_input.h"
#include "fuzz_check.h"
#include "policy_checks.h"

using namespace egressd;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  constexpr std::string_view kFile = "fuzz.toml";
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Result<PolicyDocument> r = parse_harbor_task(text, kFile);
  fuzz_policy::check_document(r, kFile);
  if (r.ok()) {
    FUZZ_CHECK(r->format == PolicyFormat::harbor_task);
    FUZZ_CHECK(r->policy.phases.size() >= 3 && r->policy.phases.front().name == "environment");
    FUZZ_CHECK(r->policy.initial_phase == "environment");
  }
  const Result<PolicyDocument> again = parse_policy_document(text, kFile);
  FUZZ_CHECK(again.ok() == r.ok());
  if (r.ok()) FUZZ_CHECK(again->policy.phases.size() == r->policy.phases.size());
  return 0;
}
