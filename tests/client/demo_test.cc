// moe-demo end to end against a loopback server (a shorter run than scripts/demo): the loss
// falls, the progress lines are there, and the checkpoint restores identical outputs. moe-demo
// itself exits non-zero when the loss does not halve or the outputs differ.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <thread>
#include <vector>

#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::StartServer;
using testing_util::Target;

TEST(DemoTest, TrainsThroughTheServerAndRestoresIdenticalOutputs) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  const std::string cmd =
      std::string(MOE_DEMO_PATH) + " --server=" + Target(*s) + " --steps=30 --micro_batches=2 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) out += buf;
  const int rc = ::pclose(p);
  ASSERT_TRUE(WIFEXITED(rc)) << out;
  EXPECT_EQ(WEXITSTATUS(rc), 0) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(step +30/30  loss [0-9.]+  tokens/s +[0-9]+)")))
      << out;
  EXPECT_NE(out.find("IDENTICAL (bit for bit)"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(loss ([0-9.]+) -> ([0-9.]+))"))) << out;
  EXPECT_LT(std::stod(m[2]), 0.6 * std::stod(m[1])) << out;
}

}  // namespace
}  // namespace moe

namespace moe {
namespace {

using testing_util::StartServer;
using testing_util::Target;

// A trainer process killed with SIGKILL never cancels anything: the server learns of it only
// from the broken connection. Its session must end and its saved contexts must be freed.
TEST(DemoTest, KilledTrainerProcessLosesItsSessionAndContexts) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  auto watcher = client::Connection::Connect(Target(*s));
  ASSERT_TRUE(watcher.ok());
  const std::string server = "--server=" + Target(*s);
  std::vector<std::string> args = {MOE_DEMO_PATH, server, "--steps=1000000", "--micro_batches=8"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::freopen("/dev/null", "w", stdout);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  // Wait until it trains, then kill it in the middle of a step.
  int64_t step = 0;
  for (int i = 0; i < 500 && step < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto info = (*watcher)->GetLayer("demo-student");
    step = info.ok() ? info->step() : 0;
  }
  ASSERT_GE(step, 3);
  EXPECT_EQ((*watcher)->GetStats()->sessions(), 2);
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  int64_t sessions = -1, contexts = -1;
  for (int i = 0; i < 250 && (sessions != 1 || contexts != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto stats = (*watcher)->GetStats();
    ASSERT_TRUE(stats.ok());
    sessions = stats->sessions();
    contexts = stats->saved_contexts();
  }
  EXPECT_EQ(sessions, 1);  // only the watcher's
  EXPECT_EQ(contexts, 0);
}

}  // namespace
}  // namespace moe
