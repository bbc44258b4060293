// Sandbox: the `rules` request, the live ruleset as nft text (docs/protocol.md).
//
// Rendered by render_table, the renderer of `egressd render`, from the model
// of the state in force (what the kernel was given, as restore_table would
// give it again) after checking that the kernel's tables still have that
// shape (verify_table), with what changes in the kernel by itself read back:
// every rule's counter, and the elements of the learned (timeout) sets. The
// other sets' elements are egressd's own (policy entries, upstreams, on-link
// prefixes) and change only through egressd.
#include <algorithm>
#include <map>

#include "control/protocol.h"
#include "daemon/sandbox.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <optional>

#include "nft/read_async.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

bool elem_less(const nft::SetElem& a, const nft::SetElem& b) { return a.from.bytes < b.from.bytes; }

// Puts the kernel's counter values into `table`'s counters, rule by rule in
// each chain (same shape: verify_table found no difference), and orders sets
// and chains as the kernel lists them.
void fill_from_kernel(nft::Table& table, const nft::TableInfo& info) {
  std::map<std::string, std::vector<const nft::RuleInfo*>> rules;
  for (const auto& r : info.rules) rules[r.chain].push_back(&r);
  for (auto& chain : table.chains) {
    const auto& have = rules[chain.name];
    for (std::size_t i = 0; i < chain.rules.size() && i < have.size(); ++i) {
      bool first = true;  // RuleInfo sums a rule's counters; egressd's rules have one
      for (auto& st : chain.rules[i].stmts) {
        if (auto* c = std::get_if<nft::StmtCounter>(&st)) {
          *c = nft::StmtCounter{true, first ? have[i]->packets : 0, first ? have[i]->bytes : 0};
          first = false;
        }
      }
    }
  }
  auto rank = [](const std::vector<std::string>& order, const std::string& name) {
    return std::find(order.begin(), order.end(), name) - order.begin();
  };
  std::stable_sort(table.sets.begin(), table.sets.end(),
                   [&](const nft::Set& a, const nft::Set& b) { return rank(info.sets, a.name) < rank(info.sets, b.name); });
  std::stable_sort(table.chains.begin(), table.chains.end(), [&](const nft::Chain& a, const nft::Chain& b) {
    return rank(info.chains, a.name) < rank(info.chains, b.name);
  });
}

}  // namespace

// A coroutine: the table reads' retries pause on the loop's timers. Each
// read is followed by synchronous work only, so a switch between two reads
// is caught by the verification of the first (ask again).
boost::asio::awaitable<Result<std::string>> Sandbox::ruleset_text() {
  auto diffs = co_await verify_table_async();
  if (!diffs) co_return diffs.error().wrap("cannot read egressd's tables");
  if (!diffs->empty()) {
    std::string what;
    for (const auto& d : *diffs) what += (what.empty() ? "" : "; ") + d;
    co_return Error::runtime("the kernel's tables differ from the phase in force (" + what +
                             "); egressd restores them when it notices (tamper detection): ask again");
  }
  const std::uint64_t generation = state_.generation;
  auto info = co_await nft::read_table_async(*kernel_, nft::kTableName, nft::Family::inet);
  if (!info) co_return info.error();
  if (!info->has_value()) co_return Error::runtime("table inet egressd vanished while being read: ask again");
  if (state_.generation != generation) co_return Error::runtime("the phase switched while the table was read: ask again");
  const Phase& phase = active_phase();
  nft::Table inet = nft::build_table(opts_.policy, state_.is_inline ? &phase : nullptr, state_, opts_.compile);
  for (auto& set : inet.sets) {
    if (!set.timeout) continue;
    auto elems = kernel_->read_set_elems(nft::kTableName, set.name, set.type);
    if (!elems) co_return elems.error();
    std::sort(elems->begin(), elems->end(), elem_less);  // nft lists hash sets sorted too
    set.elems = std::move(*elems);
  }
  fill_from_kernel(inet, **info);
  std::string text = nft::render_table(inet);
  if (nft::build_netdev_table(state_, opts_.compile)) {
    auto nd = co_await nft::read_table_async(*kernel_, nft::kTableName, nft::Family::netdev);
    if (!nd) co_return nd.error();
    if (!nd->has_value()) co_return Error::runtime("table netdev egressd vanished while being read: ask again");
    auto netdev = nft::build_netdev_table(state_, opts_.compile);  // the interfaces may have changed meanwhile
    if (!netdev) co_return Error::runtime("table netdev egressd is no longer kept: ask again");
    fill_from_kernel(*netdev, **nd);
    text += nft::render_table(*netdev);
  }
  co_return text;
}

void Sandbox::rules(std::function<void(json)> reply) {
  // Without the daemon's loop (tests, one-shot tools) the reads run on a
  // private one, here and now.
  std::optional<boost::asio::io_context> own;
  if (!opts_.executor) own.emplace();
  boost::asio::co_spawn(
      own ? own->get_executor() : opts_.executor,
      [this, busy = in_flight(), reply = std::move(reply)]() -> boost::asio::awaitable<void> {
        auto text = co_await ruleset_text();
        if (!text) {
          reply(control::error_reply(text.error(), "kernel_error"));
        } else {
          reply(control::ok_reply({{"ruleset", *text}}));
        }
      },
      boost::asio::detached);
  if (own) own->run();
}

}  // namespace egressd::daemon
