"""examples/torch_train.py, shortened, against the session's server: it trains, its loss curve
agrees with the in-process twin (its own check and exit status), and it writes the PNG."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_train.py"


def test_torch_train_example_agrees_with_the_in_process_model(server, tmp_path):
    png = tmp_path / "loss.png"
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--server", server.target, "--steps", "40",
         "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "within the tolerance" in run.stdout, run.stdout
    assert "tokens/s" in run.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no loss-curve PNG" in run.stdout
    else:
        assert png.stat().st_size > 0
