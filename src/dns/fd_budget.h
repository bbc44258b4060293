// The agent's descriptors for upstream DNS sockets, shared by its sandboxes
// (attack review: one sandbox's burst of random names held 288 of 288
// descriptors, and the agent could no longer accept on its control socket,
// answer another sandbox, or add one).
//
// The process has `limit` descriptors (RLIMIT_NOFILE). `reserve` of them are
// never given to upstream sockets: the control socket's connections, a
// `sandbox add` in progress, the agent's own. Each account (one per attached
// sandbox) is charged `fixed` for what it holds outside the budget (netlink,
// proxy listeners, queue, timers). What is left is the pool upstream sockets
// of every account share; an account may hold its share of it: the pool
// divided by the accounts, never less than `floor` (while the pool lasts).
// A descriptor refused is a query answered SERVFAIL (fail closed), counted,
// and logged once per burst naming the sandbox.
//
// Single-threaded: every call runs on the thread that runs the agent's loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace egressd::dns {

struct FdSizing {
  std::size_t reserve = 64;  // never for upstream sockets
  // Per account, held outside the budget: an agent's sandbox holds 15 to 17
  // (netlink sockets, the proxy's four listeners, its queue, timers; measured
  // with tests/integration/test_agent.py), more with its own control socket
  // and while a request is answered there.
  std::size_t fixed = 20;
  std::size_t floor = 8;     // an account's share never goes below this
};

class FdAccount;

class FdBudget : public std::enable_shared_from_this<FdBudget> {
 public:
  // `limit`: the process's descriptor limit (the soft RLIMIT_NOFILE).
  static std::shared_ptr<FdBudget> create(std::size_t limit, FdSizing sizing = {});

  // A new account named `name` (the sandbox, in logs); it gives back what it
  // still holds when destroyed. Holds the budget alive.
  std::shared_ptr<FdAccount> open(std::string name);

  // Descriptors upstream sockets of all accounts may hold together:
  // limit - reserve - fixed * accounts, at least 0.
  std::size_t pool() const;
  // What one account may hold: pool() / accounts, at least floor.
  std::size_t share() const;
  std::size_t used() const { return used_; }
  std::size_t accounts() const { return accounts_; }
  std::size_t limit() const { return limit_; }

 private:
  friend class FdAccount;
  FdBudget(std::size_t limit, FdSizing sizing) : limit_(limit), sizing_(sizing) {}
  std::size_t limit_;
  FdSizing sizing_;
  std::size_t accounts_ = 0;
  std::size_t used_ = 0;
};

class FdAccount {
 public:
  ~FdAccount();
  FdAccount(const FdAccount&) = delete;
  FdAccount& operator=(const FdAccount&) = delete;

  // One descriptor more, before it is opened: true when the account stays
  // within its share and the budget within its pool. False counts a denial;
  // the first of a burst is logged (warn, naming the account).
  [[nodiscard]] bool take();
  // One descriptor taken has been closed. The burst ends (logged, info, with
  // how many were denied) when the account is back to half its share.
  void give();

  std::size_t held() const { return held_; }
  std::uint64_t denied() const { return denied_; }
  const std::string& name() const { return name_; }

 private:
  friend class FdBudget;
  FdAccount(std::shared_ptr<FdBudget> budget, std::string name) : budget_(std::move(budget)), name_(std::move(name)) {}
  std::shared_ptr<FdBudget> budget_;
  std::string name_;
  std::size_t held_ = 0;
  std::uint64_t denied_ = 0;
  std::uint64_t burst_denied_ = 0;  // denials since the burst's first; 0: no burst
};

}  // namespace egressd::dns
