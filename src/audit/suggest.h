// `egressctl hosts --suggest`: turns the names the sandbox resolved into a
// ready-to-paste `allowed_hosts` list. Pure functions (no I/O).
#pragma once

#include <string>
#include <vector>

namespace egressd::audit {

struct Suggestion {
  std::vector<std::string> entries;  // normalized allowlist entries, sorted, unique
  std::vector<std::string> skipped;  // names that are not valid allowlist entries (e.g. "_srv._tcp.x")
  std::vector<std::string> notes;    // why a wildcard was withheld, one line each (no "# ")
};

// What the Public Suffix List (ICANN and PRIVATE sections) says about a
// name. The real one is audit/psl.h (libpsl); tests pass a fake.
class PublicSuffixes {
 public:
  virtual ~PublicSuffixes() = default;
  // True if `name` (lowercase, no trailing dot) is a registrable domain or
  // a name below one: "example.com", "a.github.io". False for a public
  // suffix ("com", "co.uk", "github.io", "s3.amazonaws.com") and for
  // anything the list cannot place.
  virtual bool registrable(const std::string& name) const = 0;
};

// Every name normalized (DESIGN §1) and validated as a hostname entry.
// With `wildcards`, siblings are collapsed: two or more names that are
// exactly one label below the same parent P become `*.P`, and names at any
// depth below P are then dropped (the wildcard covers them). P itself stays
// listed if it was resolved (a wildcard never matches its apex).
// The sandbox chooses which names it resolves, so `*.P` is withheld (the
// names stay listed one by one, with a note saying why) when P is not
// registrable by `psl` (a public suffix: `*.com`, `*.co.uk`, `*.github.io`
// would allow every owner below it), when P is or is below a service that
// answers any address named in the name (nip.io), or when a sibling label
// looks like an address (`1-2-3-4`, `c0a80001`). With no `psl` (no list
// could be loaded) no wildcard is made at all: fail closed, with a note.
Suggestion suggest_allowed_hosts(const std::vector<std::string>& names, bool wildcards,
                                 const PublicSuffixes* psl = nullptr);

// True for a DNS label that reads as an IP address in one of the forms
// any-IP name services decode: dashed or plain decimal ("1-2-3-4",
// "ip-192-0-2-1", "10"), 8 hex digits ("c0a80001"), dashed IPv6
// ("2001-db8--1").
bool address_like_label(const std::string& label);

// The name one label up: "a.b.example" -> "b.example"; empty for one label.
std::string parent_of(const std::string& name);

// `name` safe to print on one line: bytes outside printable ASCII, and
// backslashes, become \xNN. Query names come from the untrusted sandbox; a
// newline in one must not forge a line of the suggested YAML.
std::string printable(const std::string& name);

// The YAML block: "allowed_hosts:\n  - a.example\n  - \"*.b.example\"\n",
// with a "# not valid allowlist entries, left out: ..." comment line first
// when names were skipped, then one "# ..." line per note.
std::string suggestion_yaml(const Suggestion& s);

}  // namespace egressd::audit
