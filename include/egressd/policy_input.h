// Policy inputs (DESIGN §3): egressd's own policy file, and the harnesses' formats read
// as they are — Harbor's task.toml network sections and AgentCompass's env-params object —
// each into one validated Policy. Pure: no I/O except load_policy_document, which reads
// one file.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "egressd/policy.h"
#include "egressd/result.h"

namespace egressd {

enum class PolicyFormat { egressd, harbor_task, env_params };

// "egressd policy", "Harbor task.toml", "AgentCompass env-params".
std::string_view to_string(PolicyFormat format);

// A policy and where each of its phases came from.
struct PolicyDocument {
  PolicyFormat format = PolicyFormat::egressd;
  Policy policy;
  // One per phase, in the order of policy.phases: the part of the input that decided it,
  // for people (`egressd check`), e.g. "[agent]", "inherits environment ([environment])",
  // "run_network_policy". Empty strings for egressd policy files, which say it themselves.
  std::vector<std::string> origins;
};

// Reads `text` as the format `filename` and the text say (the one rule, also in README
// "Policy file"): a name ending in ".toml" (any case) is a Harbor task.toml; anything else
// is YAML/JSON, read as AgentCompass env-params when its top level is a map with
// network_policy, run_network_policy or verifier_network_policy and no phases, else as an
// egressd policy. Errors are invalid-kind and read "<filename>:<line>:<col>: <reason>".
Result<PolicyDocument> parse_policy_document(std::string_view text, std::string_view filename);

// Reads the file at `path` (at most 4 MiB) and parses it as above. A missing or
// unreadable file is an invalid-kind error naming the path.
Result<PolicyDocument> load_policy_document(const std::string& path);

// Harbor task.toml: the network keys of [environment], [agent], [verifier],
// [verifier.environment] and of each [[steps]] entry's agent and verifier, resolved as
// Harbor resolves them (README "Harbor task.toml"). Phases: environment, agent, verifier,
// verifier-env (separate verifier only), then per step step-NAME-agent, step-NAME-verifier
// (and step-NAME-verifier-env). Unknown network keys are errors; other keys are ignored.
Result<PolicyDocument> parse_harbor_task(std::string_view text, std::string_view filename);

// AgentCompass env-params: a JSON object whose network_policy, run_network_policy and
// verifier_network_policy are each a mode string or {network_mode, allowed_hosts}; phases
// setup, run, verifier; an omitted (or null) run or verifier policy inherits setup.
Result<PolicyDocument> parse_env_params(std::string_view text, std::string_view filename);

}  // namespace egressd
