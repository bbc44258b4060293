// Hosts files (issue 16 point 7): names a sandbox resolves without DNS, such
// as Harbor's `host.docker.internal` from compose's extra_hosts. Parsed into
// name -> addresses so those names can be learned and pinned like resolved
// ones. Pure: the caller reads the file.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "egressd/policy.h"

namespace egressd::pin {

struct HostsFile {
  // Normalized name (pin::normalize_name) -> its addresses, in file order,
  // each once. A name on several lines collects every line's address.
  std::map<std::string, std::vector<IpPrefix>> names;
  // One message per skipped line or name: "<filename>:<line>: <reason>".
  std::vector<std::string> problems;
};

// What one parse takes at most. The file may be the sandbox's to write
// (/proc/PID/root/etc/hosts; docs/pinning.md "Hosts files") and is parsed on
// the event loop every sandbox of an agent shares: a megabyte of pairs must
// cost milliseconds, not seconds, and a real hosts file has a few dozen.
struct HostsLimits {
  std::size_t max_bytes = std::size_t{1} << 20;  // a longer text: one problem, no names
  std::size_t max_pairs = 4096;                   // distinct (name, address) pairs; more: one problem, no names
  std::size_t max_problems = 64;                  // problems kept; after them one "and more" and the parse stops
};

// Lines as glibc reads /etc/hosts: `#` starts a comment; fields are
// separated by spaces and tabs; the first field is an IPv4 or IPv6 address,
// the others are names (canonical name and aliases alike). A line whose
// address does not parse (zone ids such as fe80::1%eth0 included), or that
// has no name, is reported and skipped; a name that is not a valid host
// name is reported and skipped, the line's other names kept. CRLF endings
// are accepted. `filename` only appears in messages. Time linear in the text
// (duplicates are found through a set per name). Over a limit of `limits`:
// no names and a problem naming the file and the limit (problems stop at
// max_problems, the last saying more were not read).
HostsFile parse_hosts(std::string_view text, std::string_view filename, const HostsLimits& limits = {});

}  // namespace egressd::pin
