"""LocalServer: a moe-server process on loopback, for tests, examples and notebooks.

Starts the binary with --port=0 and --metrics_port=0 (the kernel picks free ports), reads the
gRPC port from the line the server prints once it listens, and stops it with SIGTERM (SIGKILL
after a grace period) when the context exits.

    with LocalServer() as srv:
        layer = RemoteMoE(server=srv.target, ...)
"""

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

_LISTENING = re.compile(r"gRPC on 127\.0\.0\.1:(\d+),")


def default_binary() -> str:
    """$MOE_SERVER_BIN, else build/server/moe-server of the repository this file lives in
    (an in-tree or editable install), else moe-server on PATH."""
    env = os.environ.get("MOE_SERVER_BIN")
    if env:
        return env
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "build" / "server" / "moe-server"
        if candidate.is_file():
            return str(candidate)
    return "moe-server"


class LocalServer:
    def __init__(self, binary: Optional[str] = None, checkpoint_dir: Optional[str] = None,
                 device: str = "cpu", cpu_threads: int = 0, extra_flags: Sequence[str] = (),
                 start_timeout: float = 30.0):
        self.binary = binary or default_binary()
        self._tmp = None
        if checkpoint_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="moe-checkpoints-")
            checkpoint_dir = self._tmp.name
        self.checkpoint_dir = checkpoint_dir
        self._log = tempfile.NamedTemporaryFile(prefix="moe-server-", suffix=".log", delete=False)
        flags = ["--host=127.0.0.1", "--port=0", "--metrics_host=127.0.0.1",
                 "--metrics_port=0", f"--device={device}", f"--checkpoint_dir={checkpoint_dir}"]
        if cpu_threads:
            flags.append(f"--cpu_threads={cpu_threads}")
        try:
            self.process = subprocess.Popen([self.binary, *flags, *extra_flags],
                                            stdout=self._log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            self._cleanup()
            raise FileNotFoundError(
                f"moe-server binary {self.binary!r} not found: build it (cmake --build build "
                "--target moe-server) or set MOE_SERVER_BIN") from None
        self.port = self._wait_for_port(start_timeout)
        self.target = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log())
            if m:
                return int(m.group(1))
            if self.process.poll() is not None:
                log = self.log()
                self._cleanup()
                raise RuntimeError(f"moe-server exited with {self.process.returncode}:\n{log}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moe-server did not report its port within {timeout} s")

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
