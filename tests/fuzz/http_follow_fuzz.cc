// libFuzzer target for the requests after the first on a followed HTTP
// connection (src/pin/http_follow.cc): every byte a sandbox sends on a
// cleartext HTTP connection to a pinned address goes through it. The first
// input byte picks where the rest is cut into pieces (as segments arrive).
// Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - what is held for an incomplete head or line never exceeds kMaxInspect;
//  - the pieces give exactly what the whole stream gives: the same heads (the
//    same names, in order) and the same refusal, so where segments are cut
//    never lets a request through unjudged;
//  - a refusal ends the stream: nothing after it is read;
//  - the framing (what is not body data: the bytes hostname pinning keeps for
//    retransmissions) is the same bytes however the stream is cut, in order,
//    within what was fed.
#include <cstdint>
#include <string>
#include <vector>

#include "pin/http_follow.h"
#include "pin_fuzz_common.h"

using namespace egressd::pin;

namespace {

struct Result {
  std::vector<std::optional<std::string>> heads;
  std::optional<std::string> invalid;
  std::vector<bool> framing;  // per input byte, up to a refusal
};

Result run(Bytes in, std::size_t piece) {
  HttpRequestStream s;
  Result r;
  for (std::size_t off = 0; off < in.size() && !r.invalid; off += piece) {
    const std::size_t n = std::min(piece, in.size() - off);
    const auto step = s.feed(in.subspan(off, n));
    r.heads.insert(r.heads.end(), step.heads.begin(), step.heads.end());
    r.invalid = step.invalid;
    if (r.framing.size() < in.size()) r.framing.resize(in.size());
    std::size_t last = 0;
    for (const auto& [from, to] : step.framing) {
      FUZZ_CHECK(from >= last && from < to && to <= n);
      last = to;
      for (std::size_t i = from; i < to; ++i) r.framing[off + i] = true;
    }
    FUZZ_CHECK(s.held() <= kMaxInspect);
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::size_t piece = 1 + data[0] % 64;
  const Bytes in(data + 1, size - 1);
  const Result whole = run(in, in.size() + 1);
  const Result cut = run(in, piece);
  FUZZ_CHECK(whole.heads == cut.heads);
  FUZZ_CHECK(whole.invalid == cut.invalid);
  if (!whole.invalid) FUZZ_CHECK(whole.framing == cut.framing);
  for (const auto& h : whole.heads) {
    if (h) FUZZ_CHECK(normalize_name(*h).has_value() || h->find(':') != std::string::npos);
  }
  return 0;
}
