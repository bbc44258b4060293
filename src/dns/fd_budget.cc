#include "dns/fd_budget.h"

#include <algorithm>

#include "dns/log.h"

namespace egressd::dns {

std::shared_ptr<FdBudget> FdBudget::create(std::size_t limit, FdSizing sizing) {
  return std::shared_ptr<FdBudget>(new FdBudget(limit, sizing));
}

std::shared_ptr<FdAccount> FdBudget::open(std::string name) {
  ++accounts_;
  return std::shared_ptr<FdAccount>(new FdAccount(shared_from_this(), std::move(name)));
}

std::size_t FdBudget::pool() const {
  const std::size_t held_elsewhere = sizing_.reserve + sizing_.fixed * accounts_;
  return limit_ > held_elsewhere ? limit_ - held_elsewhere : 0;
}

std::size_t FdBudget::share() const {
  return std::max(sizing_.floor, pool() / std::max<std::size_t>(accounts_, 1));
}

FdAccount::~FdAccount() {
  budget_->used_ -= held_;
  --budget_->accounts_;
}

bool FdAccount::take() {
  FdBudget& b = *budget_;
  if (held_ < b.share() && b.used_ < b.pool()) {
    ++held_;
    ++b.used_;
    return true;
  }
  ++denied_;
  if (burst_denied_++ == 0) {
    dns_logger()->warn("event=descriptor_share_exhausted sandbox={} held={} share={} used={} pool={} limit={} "
                       "action=\"its upstream queries get SERVFAIL until it holds fewer\"",
                       name_, held_, b.share(), b.used_, b.pool(), b.limit_);
  }
  return false;
}

void FdAccount::give() {
  if (held_ == 0) return;
  --held_;
  --budget_->used_;
  if (burst_denied_ != 0 && held_ <= budget_->share() / 2) {
    dns_logger()->info("event=descriptor_share_recovered sandbox={} held={} denied={}", name_, held_, burst_denied_);
    burst_denied_ = 0;
  }
}

}  // namespace egressd::dns
