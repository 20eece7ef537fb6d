// moe-demo end to end against a loopback server (a shorter run than scripts/demo): the loss
// falls, the progress lines are there, and the checkpoint restores identical outputs. moe-demo
// itself exits non-zero when the loss does not halve or the outputs differ.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <regex>

#include "tests/client/test_util.h"

namespace moe {
namespace {

using testing_util::StartServer;
using testing_util::Target;

TEST(DemoTest, TrainsThroughTheServerAndRestoresIdenticalOutputs) {
  auto s = StartServer();
  ASSERT_TRUE(s);
  const std::string cmd = std::string(MOE_DEMO_PATH) + " --server=" + Target(*s) +
                          " --steps=30 --micro_batches=2 2>&1";
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
