// Sandbox: the `metrics` request, the counters of this sandbox in the
// Prometheus text exposition format (version 0.0.4), which node_exporter's
// textfile collector and every Prometheus-compatible scraper read. Nothing
// here listens anywhere: the text goes over the control socket, or into the
// file `egressd run --metrics-file` rewrites (daemon.cc).
#include <cstdio>

#include "daemon/sandbox.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>

#include "nft/read_async.h"

namespace egressd::daemon {

namespace {

using nlohmann::json;

// A label value as the exposition format quotes it.
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

struct Writer {
  std::string out;
  void family(const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, std::uint64_t v, const std::string& labels = "") {
    out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + std::to_string(v) + "\n";
  }
  void sample(const std::string& name, double v, const std::string& labels = "") {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6f", v);
    out += name + (labels.empty() ? "" : "{" + labels + "}") + " " + buf + "\n";
  }
};

std::string seconds_text(std::uint64_t us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(us) / 1e6);
  return buf;
}

}  // namespace

std::string Sandbox::request_label(const std::string& cmd) {
  // Bounded label values: a client cannot grow the metrics by inventing commands.
  for (const char* known : {"ping", "status", "capabilities", "apply", "explain", "denied", "hosts", "rules", "metrics"}) {
    if (cmd == known) return cmd;
  }
  return "unknown";
}

void Sandbox::count_request(const std::string& command, const json& reply) {
  std::string result = "ok";
  if (!reply.value("ok", false)) {
    result = "error";
    if (reply.contains("error") && reply["error"].is_object()) {
      const json& code = reply["error"].value("code", json());
      if (code.is_string()) result = code.get<std::string>();
    }
  }
  ++requests_[{command, result}];
}

std::string Sandbox::metrics_text() { return metrics_text_from(traffic()); }

void Sandbox::metrics_text(std::function<void(std::string)> done) {
  if (!opts_.executor) return done(metrics_text());
  // The two counted chains are read as status reads them: retries pause on
  // the loop's timers (the sandbox outlives the loop's pending work).
  boost::asio::co_spawn(
      opts_.executor,
      [this, busy = in_flight(), done = std::move(done)]() -> boost::asio::awaitable<void> {
        auto output = co_await nft::read_chain_async(*kernel_, nft::kTableName, nft::Family::inet, "output");
        auto deny = co_await nft::read_chain_async(*kernel_, nft::kTableName, nft::Family::inet, "deny");
        done(metrics_text_from(traffic_from(output ? &*output : nullptr, deny ? &*deny : nullptr)));
      },
      boost::asio::detached);
}

std::string Sandbox::metrics_text_from(const Traffic& t) {
  Writer w;
  w.family("egressd_switches_total", "counter", "Phase switches the kernel acknowledged since egressd started.");
  w.sample("egressd_switches_total", switches_);
  w.family("egressd_switch_failures_total", "counter", "Phase switches the kernel refused (nothing changed).");
  w.sample("egressd_switch_failures_total", switch_failures_);
  w.family("egressd_generation", "gauge", "Generation of the policy in force (kept across restarts).");
  w.sample("egressd_generation", state_.generation);
  w.family("egressd_phase_info", "gauge", "The phase in force (1), with its mode; phase=\"inline\" for an inline policy.");
  w.sample("egressd_phase_info", std::uint64_t{1},
           "phase=\"" + label(state_.phase) + "\",mode=\"" + label(std::string(to_string(state_.mode))) + "\"");

  w.family("egressd_packets_total", "counter",
           "Packets the policy decided in chain output, by verdict and family; kept in the kernel across switches "
           "and restarts.");
  for (int f : {0, 1}) {
    const std::string fam = f == 0 ? ",family=\"ipv4\"" : ",family=\"ipv6\"";
    w.sample("egressd_packets_total", t.family[f].allowed_packets, "verdict=\"allowed\"" + fam);
    w.sample("egressd_packets_total", t.family[f].denied_packets, "verdict=\"denied\"" + fam);
  }
  w.family("egressd_bytes_total", "counter", "Bytes of those packets, by verdict and family.");
  for (int f : {0, 1}) {
    const std::string fam = f == 0 ? ",family=\"ipv4\"" : ",family=\"ipv6\"";
    w.sample("egressd_bytes_total", t.family[f].allowed_bytes, "verdict=\"allowed\"" + fam);
    w.sample("egressd_bytes_total", t.family[f].denied_bytes, "verdict=\"denied\"" + fam);
  }

  if (proxy_ != nullptr) {
    const auto c = proxy_->counters();
    w.family("egressd_dns_queries_total", "counter",
             "Sandbox queries the DNS proxy handled, by result: forwarded upstream, refused by policy (REFUSED or "
             "NXDOMAIN), failed (SERVFAIL), malformed, relayed (Docker's forwarder).");
    w.sample("egressd_dns_queries_total", c.forwarded, "result=\"forwarded\"");
    w.sample("egressd_dns_queries_total", c.refused, "result=\"refused\"");
    w.sample("egressd_dns_queries_total", c.failed, "result=\"failed\"");
    w.sample("egressd_dns_queries_total", c.malformed, "result=\"malformed\"");
    w.sample("egressd_dns_queries_total", c.relayed, "result=\"relayed\"");
    w.family("egressd_dns_inflight", "gauge", "Forwarded queries waiting for their answer.");
    w.sample("egressd_dns_inflight", c.inflight);
    w.family("egressd_dns_upstream_sockets", "gauge",
             "Upstream sockets the DNS proxy holds, in use or kept for reuse (closed after a second or two unused).");
    w.sample("egressd_dns_upstream_sockets", c.upstream_sockets);
    w.family("egressd_dns_descriptor_denied_total", "counter",
             "Upstream sockets and DNS-over-TCP clients refused because the sandbox held its share of the agent's "
             "descriptors (each refused query got SERVFAIL).");
    w.sample("egressd_dns_descriptor_denied_total", c.fd_denied);
    w.family("egressd_dns_answer_duration_seconds", "histogram",
             "From a forwarded query's arrival to its answer's release (learned addresses in the kernel) or SERVFAIL.");
    std::uint64_t cumulative = 0;
    for (std::size_t i = 0; i < dns::kAnswerBucketsUs.size(); ++i) {
      cumulative += c.answer_buckets[i];
      w.sample("egressd_dns_answer_duration_seconds_bucket", cumulative,
               "le=\"" + seconds_text(dns::kAnswerBucketsUs[i]) + "\"");
    }
    w.sample("egressd_dns_answer_duration_seconds_bucket", c.answer_count, "le=\"+Inf\"");
    w.sample("egressd_dns_answer_duration_seconds_sum", static_cast<double>(c.answer_sum_us) / 1e6);
    w.sample("egressd_dns_answer_duration_seconds_count", c.answer_count);
  }

  const std::uint64_t live = learned_.live_count();
  w.family("egressd_learned_addresses", "gauge",
           "Addresses learned from DNS answers whose set timeout has not run out (at most max_learned are tracked).");
  w.sample("egressd_learned_addresses", live);

  if (tamper_counts_) {
    const auto [tampers, restores] = tamper_counts_();
    w.family("egressd_tamper_detected_total", "counter",
             "Changes to egressd's tables by anyone else (or found by the periodic check).");
    w.sample("egressd_tamper_detected_total", tampers);
    w.family("egressd_tamper_restores_total", "counter", "Times egressd put its tables back after such a change.");
    w.sample("egressd_tamper_restores_total", restores);
  }

  if (pin_counts_) {
    const auto [inspected, admitted, reset] = pin_counts_();
    w.family("egressd_pin_flows_total", "counter",
             "Flows hostname pinning judged, by result (admitted, reset); inspected = admitted + reset + held.");
    w.sample("egressd_pin_flows_total", inspected, "result=\"inspected\"");
    w.sample("egressd_pin_flows_total", admitted, "result=\"admitted\"");
    w.sample("egressd_pin_flows_total", reset, "result=\"reset\"");
  }

  w.family("egressd_control_requests_total", "counter",
           "Control requests answered, by command and result (ok, or the error code).");
  for (const auto& [key, n] : requests_) {
    w.sample("egressd_control_requests_total", n,
             "command=\"" + label(key.first) + "\",result=\"" + label(key.second) + "\"");
  }
  return std::move(w.out);
}

}  // namespace egressd::daemon
