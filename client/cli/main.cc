// moe-cli: operator commands against a moe-server.
//
//   moe-cli [--server=HOST:PORT] health [SERVICE] | list | stats
//   moe-cli create NAME --experts=E --top_k=K --d_model=D --d_hidden=H [--routing=client|server]
//           [--activation=swiglu|silu|gelu|relu] [--dtype=float32|bfloat16] [--seed=S] ...
//   moe-cli delete NAME | save NAME PATH | load NAME PATH
//
// A server with authentication on needs the caller's bearer token: --token_file (a file holding
// the token; surrounding whitespace ignored), --token, or the environment variable MOE_TOKEN,
// first given first used. --token shows in `ps`; prefer the file or the variable. `health`
// needs none.
//
// Flags live here only. Exit status: 0 on success, 2 on a usage error, 1 when the server
// answers with an error (printed as CODE: message).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "wire/wire.h"

ABSL_FLAG(std::string, server, "localhost:50051", "moe-server address");
ABSL_FLAG(double, timeout_seconds, 10, "Deadline of each call");
ABSL_FLAG(bool, tls, false, "Connect over TLS (implied by any other --tls_ flag)");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA certificate(s) that signed the server's certificate (default: system roots)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate, for a mutual-TLS server");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name the server's certificate must carry, if not --server's host");
ABSL_FLAG(std::string, token, "",
          "Bearer token for a server with --tokens_file (visible in ps: prefer --token_file or "
          "MOE_TOKEN)");
ABSL_FLAG(std::string, token_file, "", "File holding the bearer token");
ABSL_FLAG(std::string, shared_with, "",
          "create, load: comma-separated principals that may also read and train the layer");
ABSL_FLAG(int64_t, experts, 8, "create: number of experts E");
ABSL_FLAG(int64_t, top_k, 2, "create: experts per token K");
ABSL_FLAG(int64_t, d_model, 64, "create: model width d");
ABSL_FLAG(int64_t, d_hidden, 128, "create: expert hidden width h");
ABSL_FLAG(std::string, activation, "swiglu", "create: swiglu | silu | gelu | relu");
ABSL_FLAG(std::string, dtype, "float32", "create: float32 | bfloat16");
ABSL_FLAG(std::string, routing, "client", "create: client | server");
ABSL_FLAG(int64_t, expert_first, 0, "create: first expert of this shard");
ABSL_FLAG(int64_t, expert_count, 0, "create: experts in this shard (0 = all)");
ABSL_FLAG(uint64_t, seed, 0, "create: initialisation seed");
ABSL_FLAG(double, init_scale, 1.0, "create: initialisation scale");
ABSL_FLAG(std::string, optimizer, "adamw", "create: adamw | sgd");
ABSL_FLAG(double, lr, 1e-3, "create: learning rate");
ABSL_FLAG(double, weight_decay, 0, "create: weight decay");
ABSL_FLAG(double, momentum, 0, "create: SGD momentum");
ABSL_FLAG(double, max_grad_norm, 0, "create: clip gradients to this global norm (0 = off)");
ABSL_FLAG(bool, recompute_h, false,
          "create: keep only x per training forward and recompute H in the backward "
          "(less memory for long batches, same results)");

namespace {

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "moe-cli: %s: %s\n", absl::StatusCodeToString(st.code()).c_str(),
               std::string(st.message()).c_str());
  return 1;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "moe-cli: %s\n%s\n", why.c_str(), absl::ProgramUsageMessage().data());
  return 2;
}

std::string Describe(const moe::v1::LayerInfo& l) {
  const auto& c = l.config();
  return absl::StrCat(
      l.name(), "  E=", c.num_experts(), " K=", c.top_k(), " d=", c.d_model(), " h=", c.d_hidden(),
      " ", moe::v1::Activation_Name(c.activation()), " ", moe::v1::DType_Name(c.dtype()), " ",
      moe::v1::RoutingMode_Name(c.routing()), " experts [", c.expert_first(), ", ",
      c.expert_first() + c.expert_count(), ")  step=", l.step(),
      " resident_bytes=", l.resident_bytes(), " contexts=", l.saved_contexts(), " (",
      l.saved_context_bytes(), " bytes) device=", l.device(), " owner=", l.owner(),
      l.shared_with().empty() ? "" : " shared_with=", absl::StrJoin(l.shared_with(), ","));
}

absl::StatusOr<moe::v1::LayerConfig> ConfigFromFlags() {
  moe::v1::LayerConfig c;
  c.set_num_experts(absl::GetFlag(FLAGS_experts));
  c.set_top_k(absl::GetFlag(FLAGS_top_k));
  c.set_d_model(absl::GetFlag(FLAGS_d_model));
  c.set_d_hidden(absl::GetFlag(FLAGS_d_hidden));
  const std::string act = absl::GetFlag(FLAGS_activation);
  if (act == "swiglu")
    c.set_activation(moe::v1::ACTIVATION_SWIGLU);
  else if (act == "silu")
    c.set_activation(moe::v1::ACTIVATION_SILU);
  else if (act == "gelu")
    c.set_activation(moe::v1::ACTIVATION_GELU_TANH);
  else if (act == "relu")
    c.set_activation(moe::v1::ACTIVATION_RELU);
  else
    return absl::InvalidArgumentError(absl::StrCat("--activation: unknown value ", act));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "float32")
    c.set_dtype(moe::v1::DTYPE_FLOAT32);
  else if (dtype == "bfloat16")
    c.set_dtype(moe::v1::DTYPE_BFLOAT16);
  else
    return absl::InvalidArgumentError(absl::StrCat("--dtype: unknown value ", dtype));
  const std::string routing = absl::GetFlag(FLAGS_routing);
  if (routing == "client")
    c.set_routing(moe::v1::ROUTING_CLIENT);
  else if (routing == "server")
    c.set_routing(moe::v1::ROUTING_SERVER);
  else
    return absl::InvalidArgumentError(absl::StrCat("--routing: unknown value ", routing));
  c.set_expert_first(absl::GetFlag(FLAGS_expert_first));
  c.set_expert_count(absl::GetFlag(FLAGS_expert_count));
  c.set_seed(absl::GetFlag(FLAGS_seed));
  c.set_init_scale(absl::GetFlag(FLAGS_init_scale));
  c.set_recompute_h(absl::GetFlag(FLAGS_recompute_h));
  const std::string opt = absl::GetFlag(FLAGS_optimizer);
  auto* o = c.mutable_optimizer();
  if (opt == "adamw")
    o->set_kind(moe::v1::OPTIMIZER_ADAMW);
  else if (opt == "sgd")
    o->set_kind(moe::v1::OPTIMIZER_SGD);
  else
    return absl::InvalidArgumentError(absl::StrCat("--optimizer: unknown value ", opt));
  o->set_learning_rate(absl::GetFlag(FLAGS_lr));
  o->set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
  o->set_momentum(absl::GetFlag(FLAGS_momentum));
  o->set_max_grad_norm(absl::GetFlag(FLAGS_max_grad_norm));
  return c;
}

// The token from --token_file, --token or MOE_TOKEN (in that order); "" when none is given.
absl::StatusOr<std::string> Token() {
  const std::string file = absl::GetFlag(FLAGS_token_file);
  if (!file.empty()) return moe::client::ReadTokenFile(file, "--token_file");
  if (!absl::GetFlag(FLAGS_token).empty()) return absl::GetFlag(FLAGS_token);
  const char* env = std::getenv("MOE_TOKEN");
  return std::string(env == nullptr ? "" : absl::StripAsciiWhitespace(env));
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists this file's flags: absl's default lists only those of a file named after the
  // binary (it compares with its name normalized, which drops the leading '/').
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(__FILE__, file);
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "usage: moe-cli [--server=HOST:PORT] COMMAND\n"
      "  health [SERVICE]     grpc.health.v1 check of the server, or of SERVICE\n"
      "                       (moe.v1.ExpertService: what readiness probes ask)\n"
      "  list                 layers on the server\n"
      "  stats                device memory, saved contexts, sessions, memory budget, layers\n"
      "  create NAME [--experts --top_k --d_model --d_hidden --activation --dtype --routing\n"
      "               --expert_first --expert_count --seed --init_scale --recompute_h --optimizer "
      "--lr ... --shared_with]\n"
      "  delete NAME\n"
      "  save NAME PATH       checkpoint to PATH under the server's --checkpoint_dir (with\n"
      "                       authentication: under this principal's directory there)\n"
      "  load NAME PATH       load a checkpoint into NAME (created if absent, --shared_with)\n"
      "Authentication: --token_file, --token or MOE_TOKEN (bearer token); --tls_cert_file and\n"
      "--tls_key_file (client certificate)");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) return Usage("missing command");
  const std::string cmd = args[1];
  auto need = [&](size_t n) { return args.size() == n + 2; };

  moe::client::ClientOptions options;
  options.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_seconds) * 1000));
  options.open_session = false;  // the CLI keeps no training contexts
  options.connections = 1;       // and makes one call at a time
  options.tls.enabled = absl::GetFlag(FLAGS_tls);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  absl::StatusOr<std::string> token = Token();
  if (!token.ok()) return Usage(std::string(token.status().message()));
  options.token = *token;
  const std::vector<std::string> shared_with =
      absl::StrSplit(absl::GetFlag(FLAGS_shared_with), ',', absl::SkipWhitespace());
  auto conn = moe::client::Connection::Connect(absl::GetFlag(FLAGS_server), options);
  if (!conn.ok()) return Fail(conn.status());
  auto& c = **conn;

  if (cmd == "health" && (need(0) || need(1))) {
    const std::string service = need(1) ? args[2] : "";
    absl::Status st = c.Health(service);
    if (!st.ok()) return Fail(st);
    std::printf("%s%s%s: SERVING\n", c.target().c_str(), service.empty() ? "" : " ",
                service.c_str());
  } else if (cmd == "list" && need(0)) {
    auto layers = c.ListLayers();
    if (!layers.ok()) return Fail(layers.status());
    if (layers->empty()) std::printf("(no layers)\n");
    for (const auto& l : *layers) std::printf("%s\n", Describe(l).c_str());
  } else if (cmd == "stats" && need(0)) {
    auto s = c.GetStats();
    if (!s.ok()) return Fail(s.status());
    std::printf("device %s  memory %lld / %lld bytes  uptime %.1f s\n", s->device().c_str(),
                static_cast<long long>(s->device_memory_used_bytes()),
                static_cast<long long>(s->device_memory_total_bytes()), s->uptime_seconds());
    std::printf("saved contexts %lld (%lld of %lld budget bytes)  sessions %lld\n",
                static_cast<long long>(s->saved_contexts()),
                static_cast<long long>(s->saved_context_bytes()),
                static_cast<long long>(s->saved_context_budget_bytes()),
                static_cast<long long>(s->sessions()));
    std::printf("memory admitted %lld of %lld budget bytes\n",
                static_cast<long long>(s->memory_admitted_bytes()),
                static_cast<long long>(s->memory_budget_bytes()));
    for (const auto& l : s->layers()) std::printf("  %s\n", Describe(l).c_str());
  } else if (cmd == "create" && need(1)) {
    auto proto = ConfigFromFlags();
    if (!proto.ok()) return Usage(std::string(proto.status().message()));
    auto config = moe::wire::LayerConfigFromProto(*proto);
    if (!config.ok()) return Fail(config.status());
    auto info = c.CreateLayer(args[2], *config, /*attach_if_exists=*/false, shared_with);
    if (!info.ok()) return Fail(info.status());
    std::printf("created %s\n", Describe(*info).c_str());
  } else if (cmd == "delete" && need(1)) {
    absl::Status st = c.DeleteLayer(args[2]);
    if (!st.ok()) return Fail(st);
    std::printf("deleted %s\n", args[2]);
  } else if (cmd == "save" && need(2)) {
    auto r = c.SaveCheckpoint(args[2], args[3]);
    if (!r.ok()) return Fail(r.status());
    std::printf("saved %s step %lld to %s (%lld bytes)\n", args[2],
                static_cast<long long>(r->step()), r->path().c_str(),
                static_cast<long long>(r->bytes()));
  } else if (cmd == "load" && need(2)) {
    auto r = c.LoadCheckpoint(args[2], args[3], shared_with);
    if (!r.ok()) return Fail(r.status());
    std::printf("loaded %s\n", Describe(*r).c_str());
  } else {
    return Usage(absl::StrCat("unknown command or wrong arguments: ",
                              absl::StrJoin(args.begin() + 1, args.end(), " ")));
  }
  return 0;
}
