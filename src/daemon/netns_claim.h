// One egressd per network namespace. Two would take the table from each other
// for as long as both run (each one's tamper guard puts its own phase back,
// hundreds of times a second), so a switch made through one would be undone by
// the other: a policy weakened behind the orchestrator's back. A second one
// comes from a rolling update that starts the new agent before the old one
// stops, a harness that retries a sidecar's start, an agent attached to a
// namespace a sidecar already serves.
//
// Before it changes anything in a namespace, egressd binds nfnetlink_queue
// kClaimQueueNum there. The kernel lets one socket per namespace bind a queue
// number, only with CAP_NET_ADMIN (a sandbox process cannot take it first),
// and frees it when that socket closes, also when its process dies: a restart
// after a crash claims it again. No rule sends a packet to this queue.
#pragma once

#include <cstdint>
#include <memory>

#include "egressd/result.h"

namespace egressd::nft {
class Transport;
}

namespace egressd::daemon {

// Next to the pinning queues (nft::kPinQueueNum and the two after it).
inline constexpr std::uint16_t kClaimQueueNum = 19;

class NetnsClaim {
 public:
  // Claims the network namespace of the calling thread. Runtime error, naming
  // the holder as far as this process can see it, when another process holds
  // the claim. A claim that cannot be made for another reason is not an
  // error: `held()` is false, and `unheld_reason()` says why (a kernel without
  // nfnetlink_queue), or is empty when this process lacks CAP_NET_ADMIN in the
  // namespace (it can change nothing there either; the caller says so).
  static Result<std::unique_ptr<NetnsClaim>> acquire();
  ~NetnsClaim();
  NetnsClaim(const NetnsClaim&) = delete;
  NetnsClaim& operator=(const NetnsClaim&) = delete;

  bool held() const { return transport_ != nullptr; }
  const std::string& unheld_reason() const { return unheld_reason_; }
  // Gives the namespace up at once (closes the socket).
  void release();

 private:
  NetnsClaim() = default;
  std::unique_ptr<nft::Transport> transport_;
  std::string unheld_reason_;
};

}  // namespace egressd::daemon
