// The fatal-signal backtrace (common/crash_trace.h): a child process installs it and dies of a
// segmentation fault or an abort; its stderr must name the signal and the function that faulted
// (a non-static function of this binary, found by the symbolizer without debug info), and it must
// still die of that signal. SIGQUIT makes a child print every thread's stack, a thread blocked in
// a function of this binary named among them, and the child goes on to exit normally.
#include "common/crash_trace.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

namespace moe {

// Non-static and never inlined, so that the backtrace has a frame of this name.
__attribute__((noinline)) void CrashTraceTestFault(volatile int* p) { *p = 1; }
__attribute__((noinline)) void CrashTraceTestAbort() { std::abort(); }
// Says it is here on stderr, then waits for stdin to close.
__attribute__((noinline)) void CrashTraceTestBlocked() {
  const char ready[] = "blocked\n";
  if (write(STDERR_FILENO, ready, sizeof(ready) - 1) < 0) return;
  char c;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
}

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

TEST(CrashTraceTest, SigquitPrintsEveryThreadAndTheProcessGoesOn) {
  int in[2], err[2];
  ASSERT_EQ(pipe(in), 0);
  ASSERT_EQ(pipe(err), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(in[1]);
    close(err[0]);
    dup2(in[0], STDIN_FILENO);
    dup2(err[1], STDERR_FILENO);
    InstallCrashBacktrace("/proc/self/exe");
    std::thread blocked(CrashTraceTestBlocked);
    blocked.join();
    _exit(0);
  }
  close(in[0]);
  close(err[1]);
  std::string text;
  bool quit_sent = false;
  char buf[4096];
  for (ssize_t n; (n = read(err[0], buf, sizeof(buf))) > 0;) {
    text.append(buf, static_cast<size_t>(n));
    if (!quit_sent && text.find("blocked\n") != std::string::npos) {
      kill(pid, SIGQUIT);
      quit_sent = true;
    }
    if (in[1] >= 0 && text.find("*** end of stacks") != std::string::npos) {
      close(in[1]);  // lets the blocked thread, and so the child, finish
      in[1] = -1;
    }
  }
  if (in[1] >= 0) close(in[1]);
  close(err[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << text;
  EXPECT_NE(text.find("*** SIGQUIT: the stack of every thread"), std::string::npos) << text;
  EXPECT_NE(text.find("CrashTraceTestBlocked"), std::string::npos) << text;
  size_t threads = 0;
  for (size_t at = text.find("--- thread "); at != std::string::npos;
       at = text.find("--- thread ", at + 1)) {
    ++threads;
  }
  EXPECT_EQ(threads, 2u) << text;
}

TEST(CrashTraceTest, NoSignalNoOutput) {
  const Death d = RunChild([] {});
  EXPECT_EQ(d.signal, 0);
  EXPECT_EQ(d.stderr_text, "");
}

}  // namespace
}  // namespace moe
