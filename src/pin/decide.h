// Hostname pinning's decision (DESIGN §1 "Hostname pinning", issue 16): which
// parser a TCP flow's first bytes go to, and whether the name they present
// may reach the destination. Pure: what egressd learned and what the phase
// allows come through PinFacts, which the datapath supplies.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "egressd/policy.h"
#include "pin/verdict.h"

namespace egressd::pin {

enum class TcpKind { tls, http, other, need_more };

// "tls", "http", "other", "need-more".
std::string_view to_string(TcpKind kind);

// What the first client bytes of a TCP flow are:
//   tls: a TLS handshake record (first byte 22) or an SSLv2-format hello;
//   http: after any leading CR/LF/SP/HTAB, a request line: a token then
//     whitespace, and either a known HTTP method or "HTTP/" (any case) later
//     on the line (the h2c preface is http);
//   other: anything else (SSH's banner, database protocols): the address
//     decides, as without pinning;
//   need_more: too few bytes to tell (a line that may still turn out to be
//     a request line is waited for until its LF, up to kMaxInspect bytes,
//     after which it counts as http and is refused as too large).
// Classifying by a whole line rather than the first word keeps a request
// split across segments ("FOO " then "/ HTTP/1.1") from passing as other.
TcpKind classify_tcp(Bytes stream);

// Whether `first` (an "other" flow's first client bytes) is a request to
// upgrade the connection to TLS, which the client's next write answers with
// a ClientHello once the server agreed: PostgreSQL's SSLRequest or
// GSSENCRequest, MySQL's SSL request packet, LDAP's StartTLS extended
// request, or a text command line STARTTLS (SMTP, IMAP with its tag, NNTP),
// STLS (POP3) or AUTH TLS / AUTH SSL (FTP). The request's length in bytes,
// or nullopt. A front that routes by SNI (a database proxy serving many
// tenants on one address) would be reached under any name if that hello
// went unread (attack review 8).
std::optional<std::size_t> tls_upgrade_request(Bytes first);

enum class PinProto { tls, http, quic };

// What the datapath knows, for one sandbox, at the moment of the decision.
class PinFacts {
 public:
  virtual ~PinFacts() = default;
  // The names (lower-case, no trailing dot) that resolved to `addr` (a
  // single address) through egressd and are still remembered; empty if none.
  virtual std::vector<std::string> names_for(const IpPrefix& addr) const = 0;
  // The hostname/wildcard entry of the phase in force that allows `name`,
  // or nullptr (a dns::NameMatcher over the phase's entries).
  virtual const Entry* allowed(std::string_view name) const = 0;
};

struct Decision {
  enum class Kind { admit, reset, need_more };
  Kind kind = Kind::need_more;
  // admit/reset: one line for logs and `denied`, e.g.
  //   "tls sni same-ip.test to 203.0.113.10:443; address learned for allowed.test"
  //   "http host allowed.test to 203.0.113.10:80; allowed by allowed.test"
  std::string reason;
  // The name presented (empty if none) and, on admit, the entry allowing it.
  std::string name;
  std::string entry;
};

// The strict pinning rule for a flow to `dst`:`port`, which the datapath
// inspects only when `dst` is allowed solely because names resolved to it
// through egressd (never for IP/CIDR entries, public or no-network phases).
// Admit iff `parse` is complete with a name that the phase allows AND that
// is one of the names learned for `dst`. need_more passes through; a parse
// that is invalid, or complete without a name, or with any other name is a
// reset, whatever the port.
Decision decide(PinProto proto, const Parse& parse, const IpPrefix& dst, std::uint16_t port, const PinFacts& facts);

}  // namespace egressd::pin
