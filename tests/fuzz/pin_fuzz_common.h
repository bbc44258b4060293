// Shared checks of the src/pin fuzz targets (tls_hello, http_head,
// quic_initial): every verdict is well-formed, and the decision built from
// it is a bounded, printable line.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.h"
#include "pin/decide.h"

namespace pinfuzz {

using namespace egressd;
using namespace egressd::pin;

inline bool printable(std::string_view s) {
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c >= 0x7f) return false;
  }
  return true;
}

class Facts : public PinFacts {
 public:
  std::vector<std::string> names_for(const IpPrefix&) const override { return {"allowed.test"}; }
  const Entry* allowed(std::string_view name) const override { return name == "allowed.test" ? &entry_ : nullptr; }

 private:
  Entry entry_{EntryKind::hostname, "allowed.test", {}};
};

// `size`: the bytes the parser was given (0 when not meaningful);
// `with_decision`: also check the decision built from `p`.
inline void check_parse(const Parse& p, PinProto proto, std::size_t size, bool with_decision = true) {
  switch (p.verdict) {
    case Verdict::complete:
      FUZZ_CHECK(p.reason.empty());
      if (p.name) {
        // Names come out normalized (IPv6 literals from an HTTP Host apart).
        const bool v6 = p.name->find(':') != std::string::npos;
        FUZZ_CHECK(v6 ? parse_ip(*p.name).has_value() : normalize_name(*p.name) == *p.name);
      }
      break;
    case Verdict::need_more:
      FUZZ_CHECK(!p.name && p.reason.empty());
      if (size) FUZZ_CHECK(p.buffered == size && size < kMaxInspect);
      break;
    case Verdict::invalid:
      FUZZ_CHECK(!p.reason.empty() && printable(p.reason) && p.reason.size() < 100);
      break;
  }
  if (!with_decision) return;
  static const Facts facts;
  static const IpPrefix dst = *parse_ip("2001:db8::1");
  const Decision d = decide(proto, p, dst, 443, facts);
  FUZZ_CHECK(printable(d.reason) && d.reason.size() < 512);
  FUZZ_CHECK((d.kind == Decision::Kind::need_more) == (p.verdict == Verdict::need_more));
  if (d.kind == Decision::Kind::admit) FUZZ_CHECK(p.name == "allowed.test");
}

}  // namespace pinfuzz
