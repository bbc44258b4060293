#include "daemon/status_view.h"

#include <chrono>

#include "nft/compile.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

constexpr EntryKind kAllKinds[] = {EntryKind::hostname, EntryKind::wildcard, EntryKind::ipv4,
                                   EntryKind::ipv6, EntryKind::ipv4_cidr, EntryKind::ipv6_cidr};

}  // namespace

Traffic traffic_from(const std::vector<nft::RuleInfo>* output, const std::vector<nft::RuleInfo>* deny) {
  // Cumulative across switches: `counter jump active` in chain output and the
  // fast path's `counter goto active` ahead of it see every packet the policy
  // decides; what `deny` did not take was allowed
  // (the chains are dumped one after the other, hence the clamps). The early
  // denies in output count there and in deny. By family: the IPv4 share of
  // each is counted by count-only rules (nft/compile.h), IPv6 is the rest.
  struct Pb {
    std::uint64_t p = 0, b = 0;
    void add(const nft::RuleInfo& r) { p += r.packets, b += r.bytes; }
  };
  auto sub = [](std::uint64_t a, std::uint64_t b) { return a > b ? a - b : 0; };
  Pb decided, denied, lo4, at4, past4, jump4, denied4;
  if (deny != nullptr) {
    for (const auto& r : *deny) (r.comment == nft::kCountV4Denied ? denied4 : denied).add(r);
  }
  if (output != nullptr) {
    for (const auto& r : *output) {
      if (r.comment == nft::kCountV4AtSaddrCheck) {
        at4.add(r);
      } else if (r.comment == nft::kCountV4PastSaddrCheck) {
        past4.add(r);
      } else if (r.comment == nft::kCountV4Decided) {
        jump4.add(r);
      } else if (r.comment == nft::kCountV4Fast) {
        jump4.add(r);  // decided by the fast path: both totals
        decided.add(r);
      } else {
        decided.add(r);
        if (r.comment == nft::kLoUpstreamDeny4) lo4.add(r);
      }
    }
  }
  Traffic t{sub(decided.p, denied.p), sub(decided.b, denied.b), denied.p, denied.b, {}};
  const Pb decided4{lo4.p + sub(at4.p, past4.p) + jump4.p, lo4.b + sub(at4.b, past4.b) + jump4.b};
  t.family[0] = {sub(decided4.p, denied4.p), sub(decided4.b, denied4.b), denied4.p, denied4.b};
  const std::uint64_t d6p = sub(denied.p, denied4.p), d6b = sub(denied.b, denied4.b);
  t.family[1] = {sub(sub(decided.p, decided4.p), d6p), sub(sub(decided.b, decided4.b), d6b), d6p, d6b};
  return t;
}

std::string_view to_string(EntryState s) {
  switch (s) {
    case EntryState::active: return "active";
    case EntryState::pending: return "pending";
    case EntryState::resolved: return "resolved";
    case EntryState::unresolved: return "unresolved";
  }
  return "unknown";
}

EntryState entry_state(EntryKind kind, bool dns_running, bool learned) {
  // IP entries are in the kernel; names take effect through the DNS proxy:
  // a hostname is "resolved" once addresses were learned for it, a wildcard
  // is "active" (it matches at query time).
  const bool name = kind == EntryKind::hostname || kind == EntryKind::wildcard;
  if (name && !dns_running) return EntryState::pending;
  if (kind == EntryKind::hostname) return learned ? EntryState::resolved : EntryState::unresolved;
  return EntryState::active;
}

json entry_counts_json(const std::array<std::size_t, 6>& counts) {
  json j = json::object();
  for (EntryKind k : kAllKinds) j[std::string(to_string(k))] = counts[static_cast<std::size_t>(k)];
  return j;
}

json status_json(const StatusInput& in) {
  json entries = json::array();
  for (const auto& e : in.entries) {
    entries.push_back({{"entry", e.text}, {"kind", to_string(e.kind)}, {"state", to_string(e.state)}});
  }
  json learned = json::array();
  if (in.learned != nullptr) {
    for (const auto& [name, addrs] : *in.learned) {
      json list = json::array();
      for (const auto& a : addrs) {
        if (a.expires <= in.now) continue;
        if (a.hosts) {
          // From the hosts file: no expiry while it is there.
          list.push_back({{"address", a.addr.to_string()}, {"expires_in_s", nullptr}, {"source", "hosts"}});
          continue;
        }
        list.push_back({{"address", a.addr.to_string()},
                        {"expires_in_s", std::chrono::duration_cast<std::chrono::seconds>(a.expires - in.now).count()},
                        {"source", "dns"}});
      }
      if (!list.empty()) learned.push_back({{"name", name}, {"addresses", list}});
    }
  }
  const Traffic& t = in.traffic;
  json by_family = json::object();
  for (int f : {0, 1}) {
    const auto& c = t.family[f];
    by_family[f == 0 ? "ipv4" : "ipv6"] = {{"allowed_packets", c.allowed_packets},
                                           {"allowed_bytes", c.allowed_bytes},
                                           {"denied_packets", c.denied_packets},
                                           {"denied_bytes", c.denied_bytes}};
  }
  json j{{"phase", in.phase},
         {"mode", to_string(in.mode)},
         {"generation", in.generation},
         {"entries", entries},
         {"entry_counts", entry_counts_json(in.entry_counts)},
         {"counters",
          {{"allowed_packets", t.allowed_packets},
           {"allowed_bytes", t.allowed_bytes},
           {"denied_packets", t.denied_packets},
           {"denied_bytes", t.denied_bytes}}},
         {"counters_by_family", by_family},
         {"learned", learned},
         {"phases", in.phases},
         {"netns", in.netns},
         {"socket", in.socket}};
  if (in.dns) {
    const auto& c = *in.dns;
    j["dns"] = {{"forwarded", c.forwarded}, {"refused", c.refused}, {"failed", c.failed},
                {"malformed", c.malformed}, {"relayed", c.relayed}, {"inflight", c.inflight}};
  } else {
    j["dns"] = nullptr;
  }
  if (in.entries_unknown) j["entries_unknown"] = true;
  j["audit"] = in.audit;
  // Hostname pinning (docs/pinning.md): flows the queue reader judged.
  if (in.pin) {
    j["pin"] = {{"inspected", (*in.pin)[0]}, {"admitted", (*in.pin)[1]}, {"reset", (*in.pin)[2]}};
  } else {
    j["pin"] = nullptr;
  }
  return j;
}

}  // namespace egressd::daemon
