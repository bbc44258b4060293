// The one fake dns::Proxy of the unit tests and fuzz targets: pre-resolution
// (resolve) without sockets. It answers from `answers` (TTL 5; a name not in
// it fails with NXDOMAIN) or, when set, from `answer`; at once, or, with
// `deferred`, only when the test calls complete_all(). Every name asked is
// recorded in `asked`. counters() reports `stats`.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dns/proxy.h"

namespace egressd::testing {

class FakeProxy : public dns::Proxy {
 public:
  using Answer = Result<std::vector<dns::Learned>>;
  using Done = std::function<void(Answer)>;

  std::map<std::string, std::vector<std::string>> answers;  // name -> addresses (ttl 5)
  std::function<Answer(const std::string& name)> answer;    // when set, instead of `answers`
  bool deferred = false;                                    // answers wait for complete_all()
  std::vector<std::string> asked;
  std::deque<std::pair<std::string, Done>> pending;  // deferred resolutions, oldest first
  dns::ProxyCounters stats{};

  void set_forwarder(dns::ForwarderOptions) override {}
  void serve(std::uint32_t, std::uint32_t) override {}
  std::uint16_t port() const override { return 53; }
  bool port_fell_back() const override { return false; }
  dns::ProxyCounters counters() const override { return stats; }
  std::vector<dns::ListenerSocket> listeners() const override { return {}; }
  void resolve(const std::string& name, Done done) override {
    asked.push_back(name);
    if (deferred) {
      pending.emplace_back(name, std::move(done));
      return;
    }
    done(answer_for(name));
  }
  void close() override {}

  // Answers every deferred resolution, oldest first (also those asked while
  // answering).
  void complete_all() {
    while (!pending.empty()) {
      auto [name, done] = std::move(pending.front());
      pending.pop_front();
      done(answer_for(name));
    }
  }

  // An `answer` for any name, for fuzzing: names containing "fail" fail;
  // others get one documentation address of each family derived from the
  // name (loopback instead for names starting with "lo", which the
  // rebinding guard must keep out), with a TTL from the name for IPv4 and
  // 2^31 s for IPv6.
  static Answer synthesised(const std::string& name) {
    if (name.find("fail") != std::string::npos) return Error::runtime("dns: SERVFAIL (fake)");
    std::vector<dns::Learned> out;
    const auto h = static_cast<std::uint8_t>(std::hash<std::string>{}(name));
    IpPrefix a4{4, {198, 51, 100, h}, 32};
    if (name.rfind("lo", 0) == 0) a4.bytes = {127, 0, 0, 1};
    out.push_back({name, a4, static_cast<std::uint32_t>(h)});
    IpPrefix a6{6, {0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, h}, 128};
    out.push_back({name, a6, 0x80000000u});
    return out;
  }

 private:
  Answer answer_for(const std::string& name) const {
    if (answer) return answer(name);
    auto it = answers.find(name);
    if (it == answers.end()) return Error::runtime("resolve " + name + ": NXDOMAIN");
    std::vector<dns::Learned> out;
    for (const auto& a : it->second) out.push_back({name, *parse_ip(a), 5});
    return out;
  }
};

}  // namespace egressd::testing
