// libFuzzer target for the HTTP/1.x request head parser
// (src/pin/http_head.cc) and the TCP classifier: the first bytes a sandbox
// sends on a TCP flow to a pinned address. Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - verdicts are well-formed (pin_fuzz_common.h);
//  - bytes after a complete head (a body, a pipelined request) change
//    nothing: the stream plus more bytes gives the same name;
//  - a head the parser completes is classified http (or tls/other only when
//    the classifier saw a TLS first byte), so no request with a Host slips
//    through as "other" — unless its first line names no HTTP version, which
//    the parser refuses anyway;
//  - a request to upgrade to TLS (tls_upgrade_request) is measured within the input.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "pin/http_head.h"
#include "pin_fuzz_common.h"

using namespace egressd::pin;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Bytes in(data, size);
  const TcpKind kind = classify_tcp(in);
  const Parse p = parse_http_head(in);
  pinfuzz::check_parse(p, PinProto::http, size);
  // A request to upgrade to TLS is never longer than what it was read from.
  if (const auto up = tls_upgrade_request(in)) FUZZ_CHECK(*up > 0 && *up <= size);
  if (p.verdict == Verdict::complete) {
    // A complete head has a request line with an HTTP/1.x version, so the
    // classifier must not wave it through as another protocol.
    FUZZ_CHECK(kind == TcpKind::http);
    std::string more(reinterpret_cast<const char*>(data), size);
    more += "\r\nHost: other.test\r\n\r\n";
    const Parse q = parse_http_head(as_bytes(more));
    if (more.size() < kMaxInspect) FUZZ_CHECK(q.verdict == Verdict::complete && q.name == p.name);
  }
  return 0;
}
