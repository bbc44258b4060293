// libFuzzer target for the ClientHello parser (src/pin/tls_hello.cc) and the
// TCP classifier (src/pin/decide.cc): the first bytes a sandbox sends on a
// TCP flow to a pinned address. Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - verdicts are well-formed (pin_fuzz_common.h): a complete name is
//    normalized, need_more reports the bytes held and never at the 16 KiB
//    cap, an invalid reason is short printable text (never sandbox bytes);
//  - segments only add bytes: a prefix of a stream whose hello is complete
//    is need_more or the same verdict with the same name, never invalid;
//  - the record layer adds nothing: the same bytes read as handshake
//    messages (QUIC's CRYPTO stream) give well-formed verdicts too.
#include <cstdint>
#include <cstdlib>

#include "pin/tls_hello.h"
#include "pin_fuzz_common.h"

using namespace egressd::pin;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Bytes in(data, size);
  (void)classify_tcp(in);
  const Parse p = parse_tls_client_hello(in);
  pinfuzz::check_parse(p, PinProto::tls, size);
  if (p.verdict == Verdict::complete) {
    for (std::size_t k : {std::size_t{0}, size / 3, size / 2, size - 1}) {
      const Parse q = parse_tls_client_hello(in.first(k));
      FUZZ_CHECK(q.verdict != Verdict::invalid);
      if (q.verdict == Verdict::complete) FUZZ_CHECK(q.name == p.name && q.ech == p.ech);
    }
  }
  pinfuzz::check_parse(parse_client_hello_message(in), PinProto::quic, size);
  return 0;
}
