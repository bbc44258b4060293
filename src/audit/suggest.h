// `egressctl hosts --suggest`: turns the names the sandbox resolved into a
// ready-to-paste `allowed_hosts` list. Pure functions (no I/O).
#pragma once

#include <string>
#include <vector>

namespace egressd::audit {

struct Suggestion {
  std::vector<std::string> entries;  // normalized allowlist entries, sorted, unique
  std::vector<std::string> skipped;  // names that are not valid allowlist entries (e.g. "_srv._tcp.x")
};

// Every name normalized (DESIGN §1) and validated as a hostname entry.
// With `wildcards`, siblings are collapsed: two or more names that are
// exactly one label below the same parent P become `*.P`, and names at any
// depth below P are then dropped (the wildcard covers them). P itself stays
// listed if it was resolved (a wildcard never matches its apex). P must have
// at least two labels and must not look like a public suffix (`co.uk`,
// `com.au`: a 2-3 letter generic second-level label under a 2-letter
// country TLD), so nothing collapses to `*.com` or `*.co.uk`.
Suggestion suggest_allowed_hosts(const std::vector<std::string>& names, bool wildcards);

// The name one label up: "a.b.example" -> "b.example"; empty for one label.
std::string parent_of(const std::string& name);

// `name` safe to print on one line: bytes outside printable ASCII, and
// backslashes, become \xNN. Query names come from the untrusted sandbox; a
// newline in one must not forge a line of the suggested YAML.
std::string printable(const std::string& name);

// The YAML block: "allowed_hosts:\n  - a.example\n  - \"*.b.example\"\n",
// with a "# not valid allowlist entries, left out: ..." comment line first
// when names were skipped.
std::string suggestion_yaml(const Suggestion& s);

}  // namespace egressd::audit
