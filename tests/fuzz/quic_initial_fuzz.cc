// libFuzzer target for the QUIC Initial parser (src/pin/quic_initial.cc):
// the datagrams a sandbox sends to UDP 443 of a pinned address. The first
// byte picks how the rest is read:
//   even: raw datagrams, each a 2-byte big-endian length then its bytes
//     (header parsing, header protection and authentication failures);
//   odd: packets the harness seals with the real Initial keys (so they
//     authenticate and the fuzzer reaches frames, CRYPTO reassembly and the
//     ClientHello parser): per packet one byte (bit 0: v2, bit 1: start a
//     new datagram, bits 2-6: packet number, bit 7: sealed as the client's
//     answer to a Retry, under another connection ID with a token), a 2-byte
//     length, the frames.
// Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - verdicts are well-formed (pin_fuzz_common.h);
//  - complete and invalid are final: every later datagram gets the same;
//  - after complete, follow() (an admitted flow's later datagrams) answers
//    same / other / hello / invalid, with a reason exactly when invalid.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "support/pin_support.h"
#include "pin/quic_initial.h"
#include "pin_fuzz_common.h"

using namespace egressd::pin;

namespace {

const pintest::Buf kDcid = {0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08};
const pintest::Buf kRetryDcid = {0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9};
const pintest::Buf kToken = {0x01, 0x02, 0x03, 0x04};

void feed_all(const std::vector<pintest::Buf>& datagrams) {
  QuicInitialAssembler a;
  std::optional<Parse> final_verdict;
  for (const auto& d : datagrams) {
    const Parse p = a.feed(Bytes(d.data(), d.size()));
    // The decision line is built once, for the verdict that ends the flow.
    pinfuzz::check_parse(p, PinProto::quic, 0, p.verdict != Verdict::need_more || &d == &datagrams.back());
    if (final_verdict) {
      FUZZ_CHECK(p.verdict == final_verdict->verdict && p.name == final_verdict->name &&
                 p.reason == final_verdict->reason);
      // An admitted flow's later datagrams (what the reader does with them).
      const QuicFollow f = a.follow(Bytes(d.data(), d.size()));
      if (final_verdict->verdict != Verdict::complete) {
        FUZZ_CHECK(f.kind == QuicFollow::Kind::invalid);
      } else {
        FUZZ_CHECK((f.kind == QuicFollow::Kind::invalid) == !f.reason.empty());
        FUZZ_CHECK(f.reason.size() < 200);
      }
    } else if (p.verdict != Verdict::need_more) {
      final_verdict = p;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const QuicInitialKeys k1 = quic_client_initial_keys(QuicVersion::v1, kDcid);
  static const QuicInitialKeys k2 = quic_client_initial_keys(QuicVersion::v2, kDcid);
  static const QuicInitialKeys r1 = quic_client_initial_keys(QuicVersion::v1, kRetryDcid);
  static const QuicInitialKeys r2 = quic_client_initial_keys(QuicVersion::v2, kRetryDcid);
  const std::uint8_t* in = data + 1;
  const std::size_t n = size - 1;
  std::vector<pintest::Buf> datagrams;
  std::size_t pos = 0;
  if ((data[0] & 1) == 0) {
    while (pos + 2 <= n && datagrams.size() < 24) {
      const std::size_t len = std::min<std::size_t>(in[pos] << 8 | in[pos + 1], n - pos - 2);
      datagrams.emplace_back(in + pos + 2, in + pos + 2 + len);
      pos += 2 + len;
    }
  } else {
    while (pos + 3 <= n && datagrams.size() < 24) {
      const std::uint8_t flags = in[pos];
      const std::size_t len = std::min<std::size_t>(in[pos + 1] << 8 | in[pos + 2], n - pos - 3);
      const QuicVersion v = (flags & 1) ? QuicVersion::v2 : QuicVersion::v1;
      if (datagrams.empty() || (flags & 2)) datagrams.emplace_back().reserve(1400);
      // Short packets are padded (as clients pad Initials) so the sample fits.
      const bool retried = (flags & 0x80) != 0;
      const QuicInitialKeys* keys = retried ? (v == QuicVersion::v2 ? &r2 : &r1) : (v == QuicVersion::v2 ? &k2 : &k1);
      pintest::seal_initial_into(datagrams.back(), v, retried ? kRetryDcid : kDcid, {},
                                 static_cast<std::uint32_t>((flags >> 2) & 0x1f), in + pos + 3, len, 64,
                                 retried ? kToken : pintest::Buf{}, 0, keys);
      pos += 3 + len;
    }
  }
  feed_all(datagrams);
  return 0;
}
