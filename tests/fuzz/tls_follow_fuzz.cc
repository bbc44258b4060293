// libFuzzer target for a pinned TLS flow's client records after its first
// ClientHello (src/pin/tls_follow.cc): every byte a sandbox sends on a TLS
// flow to a pinned address goes through it until the handshake is over. The
// first input byte picks where the rest is cut into pieces (as segments
// arrive) and from which piece on the server has answered.
// Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - the pieces give exactly what the whole stream gives: the same hellos
//    (byte for byte, in order), the same refusal, the same end, so where
//    segments are cut never lets a hello through unjudged;
//  - every hello reported is one handshake message of type 1 whose length
//    field matches, at most kMaxInspect bytes;
//  - nothing is reported after the end or a refusal.
#include <cstdint>
#include <string>
#include <vector>

#include "pin/tls_follow.h"
#include "pin_fuzz_common.h"

using namespace egressd::pin;

namespace {

struct Result {
  std::vector<std::vector<std::uint8_t>> hellos;
  std::optional<std::string> invalid;
  bool done = false;
};

// `answered_from`: the offset from which bytes come in segments sent after
// the server answered (the whole stream: one piece, answered if any byte is).
Result run(Bytes in, std::size_t piece, std::size_t answered_from) {
  TlsClientStream s;
  Result r;
  for (std::size_t off = 0; off < in.size(); off += piece) {
    const std::size_t n = std::min(piece, in.size() - off);
    const bool ended = r.done || r.invalid.has_value();
    const auto step = s.feed(in.subspan(off, n), off + n > answered_from);
    if (ended) FUZZ_CHECK(step.hellos.empty() && !step.invalid);
    for (const auto& h : step.hellos) {
      FUZZ_CHECK(h.size() >= 4 && h.size() <= kMaxInspect && h[0] == 1);
      FUZZ_CHECK((static_cast<std::size_t>(h[1]) << 16 | static_cast<std::size_t>(h[2]) << 8 | h[3]) == h.size() - 4);
    }
    r.hellos.insert(r.hellos.end(), step.hellos.begin(), step.hellos.end());
    if (step.invalid && !r.invalid) r.invalid = step.invalid;
    r.done = s.done();
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const Bytes in(data + 1, size - 1);
  // Cut into pieces of 1-16 bytes; every piece is answered, or none.
  const std::size_t piece = 1 + (data[0] & 0x0f);
  const bool answered = (data[0] & 0x10) != 0;
  const std::size_t from = answered ? 0 : in.size();
  const Result whole = run(in, in.size() + 1, from);
  const Result cut = run(in, piece, from);
  FUZZ_CHECK(whole.hellos == cut.hellos);
  FUZZ_CHECK(whole.invalid == cut.invalid);
  FUZZ_CHECK(whole.done == cut.done);
  return 0;
}
