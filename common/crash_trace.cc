// Fatal-signal backtraces (see crash_trace.h). Everything the handler does is async-signal-safe
// except backtrace() itself, whose one unsafe step (loading libgcc_s on first use) is done at
// install time: write(2), absl::Symbolize (documented safe in signal handlers) and
// backtrace_symbols_fd (no malloc).
#include "common/crash_trace.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "absl/debugging/symbolize.h"

namespace moe {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kMaxFrames = 64;
constexpr size_t kAltStackBytes = 64 << 10;  // room for the handler after a stack overflow

std::atomic<bool> reporting{false};

void Write(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// `v` in `base` (10 or 16) into `buf`, which must hold 24 characters.
const char* Number(uint64_t v, int base, char* buf) {
  char* p = buf + 23;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v % base];
    v /= base;
  } while (v != 0);
  if (base == 16) {
    *--p = 'x';
    *--p = '0';
  }
  return p;
}

const char* SignalName(int sig) {
  switch (sig) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    case SIGABRT:
      return "SIGABRT";
  }
  return "signal";
}

// One frame: its address and name, or backtrace_symbols_fd's "library(+offset) [address]".
// `pc` is a return address except for the faulting frame, so the symbol is looked up one byte
// before it (the call instruction), which also names a call that was a function's last act.
void WriteFrame(const char* label, void* pc, bool return_address) {
  char num[24], name[1024];
  Write(label);
  Write(Number(reinterpret_cast<uintptr_t>(pc), 16, num));
  Write(" ");
  void* lookup = return_address ? static_cast<char*>(pc) - 1 : pc;
  if (absl::Symbolize(lookup, name, sizeof(name))) {
    Write(name);
    Write("\n");
  } else {
    backtrace_symbols_fd(&pc, 1, STDERR_FILENO);  // ends its line itself
  }
}

void OnFatalSignal(int sig, siginfo_t* info, void* context) {
  if (reporting.exchange(true)) {
    // Another thread is printing; it re-raises its own signal when done, which ends the process.
    for (;;) pause();
  }
  char num[24];
  Write("\n*** ");
  Write(SignalName(sig));
  Write(" (signal ");
  Write(Number(static_cast<uint64_t>(sig), 10, num));
  Write(") in pid ");
  Write(Number(static_cast<uint64_t>(getpid()), 10, num));
  Write(", thread ");
  Write(Number(static_cast<uint64_t>(syscall(SYS_gettid)), 10, num));
  if (sig != SIGABRT) {
    Write(", fault address ");
    Write(Number(reinterpret_cast<uintptr_t>(info->si_addr), 16, num));
  }
  Write("; backtrace, innermost first:\n");
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  WriteFrame("  pc ", reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]), false);
#else
  (void)context;
#endif
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  // Frame 0 is this handler, frame 1 the signal trampoline, frame 2 the faulting instruction
  // (not a return address); the callers follow.
  for (int i = 1; i < n; ++i) WriteFrame("  at ", frames[i], i > 2);
  Write("*** end of backtrace\n");
  // SA_RESETHAND restored the default action: the signal now does what it would have done.
  raise(sig);
}

// SIGQUIT: the thread that takes it asks every other thread, one at a time, to print its own
// stack (a real-time signal whose handler does what a fatal one does, and says when done), then
// prints its own; the process goes on. A thread that does not answer within a second (it blocks
// the signal) is named and skipped.
std::atomic<bool> dumping{false};
std::atomic<bool> thread_done{false};
int dump_one_signal = 0;

__attribute__((noinline)) void WriteOwnStack(int skip) {
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  // Frame 0 is this function, then the handler and the signal trampoline.
  for (int i = skip; i < n; ++i) WriteFrame("  at ", frames[i], true);
}

void WriteThreadHeader(long tid) {
  char num[24];
  Write("--- thread ");
  Write(Number(static_cast<uint64_t>(tid), 10, num));
  Write("\n");
}

void OnDumpOne(int, siginfo_t*, void*) {
  WriteThreadHeader(syscall(SYS_gettid));
  WriteOwnStack(3);
  thread_done.store(true, std::memory_order_release);
}

// The kernel's struct linux_dirent64, which getdents64 fills (glibc has no wrapper in Debian 12).
struct Dirent64 {
  uint64_t ino;
  int64_t off;
  unsigned short reclen;
  unsigned char type;
  char name[];
};

void OnQuit(int, siginfo_t*, void*) {
  if (dumping.exchange(true)) return;
  const int saved_errno = errno;
  char num[24];
  const long self = syscall(SYS_gettid);
  Write("\n*** SIGQUIT: the stack of every thread of pid ");
  Write(Number(static_cast<uint64_t>(getpid()), 10, num));
  Write(", innermost frame first\n");
  const int dir = open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  char buf[4096];
  while (dir >= 0) {
    const long got = syscall(SYS_getdents64, dir, buf, sizeof(buf));
    if (got <= 0) break;
    for (long at = 0; at < got;) {
      const auto* d = reinterpret_cast<const Dirent64*>(buf + at);
      at += d->reclen;
      long tid = 0;
      for (const char* c = d->name; *c >= '0' && *c <= '9'; ++c) tid = tid * 10 + (*c - '0');
      if (tid == 0 || tid == self) continue;
      thread_done.store(false, std::memory_order_release);
      if (syscall(SYS_tgkill, getpid(), tid, dump_one_signal) != 0) continue;
      const timespec tick{0, 1000000};
      int waited = 0;
      while (!thread_done.load(std::memory_order_acquire) && waited++ < 1000) {
        nanosleep(&tick, nullptr);
      }
      if (!thread_done.load(std::memory_order_acquire)) {
        WriteThreadHeader(tid);
        Write("  (did not answer: it blocks the signal)\n");
      }
    }
  }
  if (dir >= 0) close(dir);
  WriteThreadHeader(self);
  WriteOwnStack(3);
  Write("*** end of stacks\n");
  errno = saved_errno;
  dumping.store(false);
}

}  // namespace

void InstallCrashBacktrace(const char* argv0) {
  absl::InitializeSymbolizer(argv0);
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not inside a signal handler
  static char* alt_stack = new char[kAltStackBytes];  // for this thread: the one that overflows
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = kAltStackBytes;
  sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = OnFatalSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  for (int sig : kSignals) sigaction(sig, &sa, nullptr);

  dump_one_signal = SIGRTMIN + 2;  // glibc keeps SIGRTMIN and SIGRTMIN + 1 for itself
  struct sigaction one {};
  one.sa_sigaction = OnDumpOne;
  one.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&one.sa_mask);
  sigaction(dump_one_signal, &one, nullptr);
  struct sigaction quit {};
  quit.sa_sigaction = OnQuit;
  quit.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&quit.sa_mask);
  sigaction(SIGQUIT, &quit, nullptr);
}

}  // namespace moe
