// libFuzzer target for hostname pinning's queue reader (src/daemon/pinq.cc):
// the IP packets a sandbox sends on undecided flows, as the kernel queues
// them (parse_packet), and the reader's reassembly, memory and verdicts
// (PinFlows). The input is a sequence of records: one control byte, a 2-byte
// big-endian length, the packet. Control byte: bits 0-2 the packet's
// conntrack id (as chain pin puts it in the mark), bit 3 a second of time
// passes first, bit 4 a switch cuts every admitted flow first.
// Properties checked for every input:
//  - no crash, no out-of-bounds read, no UB (ASan/UBSan);
//  - every queued packet gets exactly one verdict, and only packets that were
//    queued get one; once the hold time has passed, no packet is held (an HTTP
//    flow whose first head was let through incomplete still counts as held);
//  - the counters add up: admitted + reset <= inspected;
//  - a verdict that sends a retransmission with judged bytes (a patch) patches
//    only its own packet's payload, and apply_patch takes it; the judged
//    bytes kept stay within their bounds.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <vector>

#include "daemon/pinq.h"
#include "fuzz_check.h"

using namespace egressd;
using namespace egressd::daemon;

namespace {

struct Judge : PinJudge, pin::PinFacts {
  Entry entry;
  const pin::PinFacts& pin_facts() const override { return *this; }
  std::uint32_t pin_mark() const override { return 0x70696e21; }
  void pin_decided(const pin::Decision& d, const IpPrefix&, std::uint16_t) override {
    FUZZ_CHECK(d.kind != pin::Decision::Kind::need_more);
    FUZZ_CHECK(!d.reason.empty() && d.reason.size() < 1024);
  }
  std::vector<std::string> names_for(const IpPrefix&) const override { return {"allowed.test"}; }
  const Entry* allowed(std::string_view name) const override { return name == "allowed.test" ? &entry : nullptr; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Judge judge;
  PinFlows flows(judge);
  auto now = PinFlows::Clock::time_point{} + std::chrono::hours(1);
  std::set<PinPacketId> queued, answered;
  std::map<PinPacketId, std::vector<std::uint8_t>> packets;  // the queued packets, for their patches
  auto take = [&](const std::vector<PinVerdict>& vs) {
    for (const PinVerdict& v : vs) {
      FUZZ_CHECK(queued.contains(v.packet_id));
      FUZZ_CHECK(answered.insert(v.packet_id).second);
      if (v.patch.empty()) continue;
      FUZZ_CHECK(v.kind != PinVerdict::Kind::drop && v.kind != PinVerdict::Kind::reset);
      std::vector<std::uint8_t> p = packets.at(v.packet_id);
      FUZZ_CHECK(apply_patch(p, v));
    }
  };
  std::uint32_t next_id = 1;
  std::size_t off = 0;
  while (off + 3 <= size && next_id < 4096) {
    const std::uint8_t ctl = data[off];
    const std::size_t len = static_cast<std::size_t>(data[off + 1] << 8 | data[off + 2]);
    off += 3;
    const std::size_t n = std::min(len, size - off);
    const std::span<const std::uint8_t> pkt(data + off, n);
    off += n;
    if (ctl & 0x08) {
      now += std::chrono::seconds(1);
      take(flows.expire(now));
    }
    if (ctl & 0x10) flows.cut([](const AdmittedFlow&) { return false; }, now);
    std::optional<Segment> seg = parse_packet(pkt);
    if (!seg) continue;
    seg->ct_id = ctl & 0x07;
    seg->from_socket = (ctl & 0x20) == 0;
    seg->gso = (ctl & 0x40) != 0;
    seg->followed = (ctl & 0x80) != 0 && seg->proto == Segment::kTcp;
    // Conntrack id 7: a TCP packet of a flow another phase marked (queue 20), or a datagram of
    // a UDP flow the kernel passed before (chain pin's mark in place of the id).
    seg->foreign = seg->proto == Segment::kTcp && !seg->followed && seg->ct_id == 7;
    seg->passed = seg->proto == Segment::kUdp && seg->ct_id == 7;
    // As the reader names packets: the queue (by protocol, as chain pin sends them) and its id.
    const PinPacketId id = pin_packet_id(
        seg->proto == Segment::kUdp ? 17 : seg->followed ? 18 : seg->foreign ? 20 : 16, next_id++);
    queued.insert(id);
    packets.emplace(id, std::vector<std::uint8_t>(pkt.begin(), pkt.end()));
    take(flows.packet(id, *seg, now));
    FUZZ_CHECK(flows.kept_bytes() <= 2 * kMaxKeptBytes);
    const PinStats& st = flows.stats();
    FUZZ_CHECK(st.admitted + st.reset <= st.inspected);
    (void)flows.take_server_resets();
  }
  // Past the hold time no packet is held: every queued packet has had its verdict.
  take(flows.expire(now + kHoldTime + std::chrono::seconds(1)));
  FUZZ_CHECK(flows.stats().held == flows.pending_first());
  FUZZ_CHECK(flows.pending_first() <= flows.http_followed());
  FUZZ_CHECK(answered.size() == queued.size());
  return 0;
}
