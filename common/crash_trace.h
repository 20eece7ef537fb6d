// A symbolized backtrace on stderr when a process dies of a fatal signal (SIGSEGV, SIGBUS,
// SIGFPE, SIGILL, SIGABRT), for the executables (moe-server, moe-service-bench) whose crashes
// otherwise say nothing but "Segmentation fault", typically on a machine where no debugger can
// be attached in time. SIGQUIT prints every thread's stack and the process goes on: what a
// stuck process is waiting for, where no debugger may attach (a container without ptrace).
//
// Why not absl's InstallFailureSignalHandler: its x86-64 unwinder follows frame pointers, which
// Release builds omit and the CUDA driver's library does not keep, so a crash inside a CUDA call
// would name the faulting driver frame and lose its callers. glibc's backtrace() unwinds by the
// .eh_frame tables every frame has; each frame is then named by absl's symbolizer (which reads
// the binary's and the libraries' symbol tables, so names of non-static functions appear without
// debug info), and a frame it cannot name is printed as backtrace_symbols_fd does
// (library(+offset)), which addr2line resolves.
#ifndef MOE_COMMON_CRASH_TRACE_H_
#define MOE_COMMON_CRASH_TRACE_H_

namespace moe {

// Installs the handlers for the rest of the process (SIGQUIT's, and SIGRTMIN + 2's, which it
// uses to reach each thread, included); call it at the top of main() with argv[0]
// (the symbolizer needs the binary's path). A fork()ed child keeps them. After printing, each
// handler restores the default action and raises the signal again, so the exit status and any
// core dump are what they would have been.
void InstallCrashBacktrace(const char* argv0);

}  // namespace moe

#endif  // MOE_COMMON_CRASH_TRACE_H_
