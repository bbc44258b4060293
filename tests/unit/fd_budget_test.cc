// The agent's descriptor budget for upstream sockets (dns/fd_budget.h): the
// reserve is never handed out, a sandbox's share shrinks as others attach
// and never below the floor, and one account at its share leaves the others
// theirs.
#include <doctest/doctest.h>

#include <memory>
#include <vector>

#include "dns/fd_budget.h"

using namespace egressd::dns;

namespace {

// Takes until the account is refused (bounded); how many it got.
std::size_t take_all(FdAccount& a, std::size_t bound = 100000) {
  std::size_t n = 0;
  while (n < bound && a.take()) ++n;
  return n;
}

}  // namespace

TEST_CASE("the pool is the limit less the reserve and what each sandbox holds outside it") {
  auto b = FdBudget::create(288, FdSizing{64, 16, 8});
  CHECK(b->pool() == 224);
  auto a = b->open("A");
  CHECK(b->pool() == 208);
  CHECK(b->share() == 208);
  auto c = b->open("B");
  CHECK(b->pool() == 192);
  CHECK(b->share() == 96);
  c.reset();
  CHECK(b->accounts() == 1);
  CHECK(b->share() == 208);
}

TEST_CASE("one sandbox at its share leaves the others theirs, and the reserve untouched") {
  // The review's sizing: 288 descriptors, two sandboxes attached.
  auto b = FdBudget::create(288, FdSizing{64, 16, 8});
  auto a = b->open("A");
  auto other = b->open("B");
  CHECK(take_all(*a) == 96);
  CHECK(a->denied() == 1);
  CHECK_FALSE(a->take());
  CHECK(a->denied() == 2);
  CHECK(take_all(*other) == 96);
  CHECK(b->used() == 192);
  // Held descriptors of everyone together never pass limit - reserve.
  CHECK(b->used() + 16 * b->accounts() <= 288 - 64);
  // Given back, taken again.
  a->give();
  CHECK(a->take());
}

TEST_CASE("the floor holds while the pool lasts; past it nobody takes from the reserve") {
  // 10 sandboxes in 64 + 16 * 10 + 20: a pool of 20, a share of 2, floor 4.
  auto b = FdBudget::create(64 + 16 * 10 + 20, FdSizing{64, 16, 4});
  std::vector<std::shared_ptr<FdAccount>> accounts;
  for (int i = 0; i < 10; ++i) accounts.push_back(b->open("s" + std::to_string(i)));
  CHECK(b->pool() == 20);
  CHECK(b->share() == 4);
  std::size_t total = 0;
  for (auto& a : accounts) total += take_all(*a);
  CHECK(total == 20);  // five got their floor, the rest nothing: the reserve stays
  CHECK(b->used() == 20);
  SUBCASE("more sandboxes than the limit allows: none takes anything") {
    auto b2 = FdBudget::create(64 + 16 * 2, FdSizing{64, 16, 4});
    auto x = b2->open("x");
    auto y = b2->open("y");
    auto z = b2->open("z");
    CHECK(b2->pool() == 0);
    CHECK_FALSE(x->take());
  }
}

TEST_CASE("an account destroyed gives back what it held") {
  auto b = FdBudget::create(1000, FdSizing{64, 16, 8});
  auto a = b->open("A");
  CHECK(take_all(*a, 10) == 10);
  CHECK(b->used() == 10);
  a.reset();
  CHECK(b->used() == 0);
  CHECK(b->accounts() == 0);
}

TEST_CASE("give without take is ignored") {
  auto b = FdBudget::create(1000);
  auto a = b->open("A");
  a->give();
  CHECK(a->held() == 0);
  CHECK(b->used() == 0);
}
