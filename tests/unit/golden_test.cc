// rules/*.nft are the goldens of `egressd render` for the reference policies
// in rules/policies/. A change to the compiler shows up here as a diff; when
// intended, regenerate with scripts/update-goldens and review the diff.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "daemon/sandbox.h"
#include "dns/proxy.h"
#include "nft/compile.h"

using namespace egressd;

namespace {

std::string root() {
  const char* r = std::getenv("EGRESSD_SOURCE_ROOT");
  return r != nullptr ? r : ".";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("every reference policy renders exactly its golden") {
  for (const char* name : {"public", "no-network", "allowlist", "empty-allowlist", "phases"}) {
    CAPTURE(name);
    auto policy = load_policy_file(root() + "/rules/policies/" + name + ".yaml");
    REQUIRE_MESSAGE(policy.ok(), (policy.ok() ? "" : policy.error().message));
    const Phase* ph = policy->find(policy->initial_phase);
    REQUIRE(ph != nullptr);
    // As `egressd render` does (the reference policies name their upstream,
    // so the host's resolv.conf does not matter).
    // One egress chain, for eth0, as scripts/update-goldens renders them.
    auto opts = daemon::compile_options(dns::expand_upstreams(policy->dns, ""), 53);
    opts.interfaces = {"eth0"};
    const auto st = nft::make_state(*policy, *ph, 1, false);
    REQUIRE(nft::build_netdev_table(st, opts).has_value());
    const std::string golden = slurp(root() + "/rules/" + name + ".nft");
    REQUIRE_MESSAGE(!golden.empty(), "missing rules/" << name << ".nft: run scripts/update-goldens");
    CHECK(daemon::render_script(*policy, st, opts) == golden);
  }
}

TEST_CASE("rendering is deterministic") {
  auto policy = load_policy_file(root() + "/rules/policies/allowlist.yaml");
  REQUIRE(policy.ok());
  const auto st = nft::make_state(*policy, policy->phases[0], 1, false);
  CHECK(nft::render_table(nft::build_table(*policy, nullptr, st, {})) ==
        nft::render_table(nft::build_table(*policy, nullptr, st, {})));
}
