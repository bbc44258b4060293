// The reply of the `status` command (docs/protocol.md "status") and the
// traffic counters status and metrics share, as pure functions over what a
// sandbox holds: no kernel, no clock, no proxy. The Sandbox gathers its
// state into a StatusInput and calls status_json; the agent and the sidecar
// reply with the same text for the same state.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/learned.h"
#include "dns/proxy.h"
#include "egressd/policy.h"
#include "nft/netlink.h"

namespace egressd::daemon {

// Packets and bytes chain output decided, from the kernel's counters.
struct Traffic {
  std::uint64_t allowed_packets = 0, allowed_bytes = 0, denied_packets = 0, denied_bytes = 0;
  // The same split by family: [0] IPv4, [1] IPv6.
  struct Counts {
    std::uint64_t allowed_packets = 0, allowed_bytes = 0, denied_packets = 0, denied_bytes = 0;
  };
  Counts family[2];
};

// The traffic the rules of chains `output` and `deny` of table inet egressd
// counted (their RuleInfo as read back). nullptr: that chain could not be
// read, and counts nothing. Never wraps: a chain read after the other may be
// ahead of it, and a difference that would be negative is 0.
Traffic traffic_from(const std::vector<nft::RuleInfo>* output, const std::vector<nft::RuleInfo>* deny);

// What status says of one entry of the phase in force.
enum class EntryState {
  active,      // in the kernel (IP entries), or matched at query time (wildcards)
  pending,     // a name, and no DNS proxy runs to learn it
  resolved,    // a hostname with an unexpired learned address
  unresolved,  // a hostname without one
};
std::string_view to_string(EntryState s);
// The state of an entry of `kind`; `dns_running`: a DNS proxy is attached;
// `learned`: an address learned for the entry is unexpired (read for
// hostnames only).
EntryState entry_state(EntryKind kind, bool dns_running, bool learned);

// One entry as status lists it. `text` borrows the phase's entry.
struct StatusEntry {
  std::string_view text;
  EntryKind kind = EntryKind::hostname;
  EntryState state = EntryState::active;
};

// Everything status_json reads. Borrows `entries`' texts and `learned`: both
// must outlive the call.
struct StatusInput {
  std::string phase;
  Mode mode = Mode::no_network;
  std::uint64_t generation = 0;
  std::vector<StatusEntry> entries;
  // An adopted inline policy whose entries were not saved: `entries` is
  // empty and the reply says so.
  bool entries_unknown = false;
  std::array<std::size_t, 6> entry_counts{};  // by EntryKind
  // The learned store's pairs (expired ones too: left out of the reply) and
  // the time they are judged at. nullptr: none.
  const std::map<std::string, std::vector<LearnedStore::Addr>>* learned = nullptr;
  LearnedStore::TimePoint now{};
  Traffic traffic;
  std::vector<std::string> phases;  // the named phases, in policy order
  std::string netns, socket;
  std::optional<dns::ProxyCounters> dns;  // nullopt: no DNS proxy (reply null)
  nlohmann::json audit;                   // the "audit" object, as given
  // Pinning's flows: inspected, admitted, reset; nullopt when the queue
  // reader does not run (reply null).
  std::optional<std::array<std::uint64_t, 3>> pin;
};

// {"hostname": n, "wildcard": n, ...}: `counts` by EntryKind, every kind present.
nlohmann::json entry_counts_json(const std::array<std::size_t, 6>& counts);

// The status reply's fields (without "ok"): the same JSON for the same input.
nlohmann::json status_json(const StatusInput& in);

}  // namespace egressd::daemon
