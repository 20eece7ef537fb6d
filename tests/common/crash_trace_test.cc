// The fatal-signal backtrace (common/crash_trace.h): a child process installs it and dies of a
// segmentation fault or an abort; its stderr must name the signal and the function that faulted
// (a non-static function of this binary, found by the symbolizer without debug info), and it must
// still die of that signal.
#include "common/crash_trace.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace moe {

// Non-static and never inlined, so that the backtrace has a frame of this name.
__attribute__((noinline)) void CrashTraceTestFault(volatile int* p) { *p = 1; }
__attribute__((noinline)) void CrashTraceTestAbort() { std::abort(); }

namespace {

struct Death {
  int signal = 0;  // 0: it did not die of a signal
  std::string stderr_text;
};

// Runs `body` in a child process whose stderr comes back.
Death RunChild(void (*body)()) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDERR_FILENO);
    InstallCrashBacktrace("/proc/self/exe");
    body();
    _exit(0);
  }
  close(fds[1]);
  Death d;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) != 0;) {
    if (n < 0) break;
    d.stderr_text.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  if (WIFSIGNALED(status)) d.signal = WTERMSIG(status);
  return d;
}

TEST(CrashTraceTest, SegfaultNamesTheFaultingFunction) {
  const Death d = RunChild([] { CrashTraceTestFault(nullptr); });
  EXPECT_EQ(d.signal, SIGSEGV) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("*** SIGSEGV (signal 11)"), std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("fault address 0x0"), std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("CrashTraceTestFault"), std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("*** end of backtrace"), std::string::npos) << d.stderr_text;
}

TEST(CrashTraceTest, AbortNamesItsCaller) {
  const Death d = RunChild([] { CrashTraceTestAbort(); });
  EXPECT_EQ(d.signal, SIGABRT) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("*** SIGABRT"), std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("CrashTraceTestAbort"), std::string::npos) << d.stderr_text;
}

TEST(CrashTraceTest, NoSignalNoOutput) {
  const Death d = RunChild([] {});
  EXPECT_EQ(d.signal, 0);
  EXPECT_EQ(d.stderr_text, "");
}

}  // namespace
}  // namespace moe
