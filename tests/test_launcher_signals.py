"""`fastpo train --nproc 2` stopped by Ctrl-C ends as one process does (issue 25 item 8):
the run's own lines, exit status 130, the checkpoint saved, and no torchrun exception
report (SignalException / ChildFailedError) printed over them. A real 2-process CPU run."""
import os
import signal
import subprocess
import sys
import time

from fastpo.checkpoint import latest_checkpoint
from run_helpers import records


def test_ctrl_c_under_nproc_2_ends_like_one_process(tmp_path):
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "fastpo", "train", "--nproc", "2", "--device", "cpu", "--env", "bandit",
           "--preset", "tiny", "--model", "random:tiny-llama", "--out", out, "--iterations", "200",
           "rollout.env_groups=2", "trainer.save_every=1000", "trainer.eval_every=0", "trainer.plots=false",
           "rollout.think=false", "rollout.max_new_tokens=8"]
    # a session of its own, so that the signal below reaches it as a terminal's Ctrl-C would:
    # the launcher and both processes (its process group)
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         encoding="utf-8", errors="replace", start_new_session=True)
    lines = []
    try:
        end = time.monotonic() + 180
        for line in p.stdout:
            lines.append(line)
            if line.startswith("iteration 1/200") or time.monotonic() > end:
                break
        assert any(line.startswith("iteration 1/200") for line in lines), "".join(lines)[-4000:]
        os.killpg(p.pid, signal.SIGINT)
        rest, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    said = "".join(lines) + rest
    assert p.returncode == 130, said[-4000:]
    for noise in ("Traceback", "SignalException", "ChildFailedError", "torch.distributed.elastic"):
        assert noise not in said, said[-4000:]
    flat = " ".join(said.split())  # (rich wraps long lines)
    assert "stopped after iteration" in flat and "resume with `fastpo train --resume" in flat, said[-4000:]
    done = [r["iteration"] for r in records(out)]
    assert done and latest_checkpoint(out).endswith(f"iter_{done[-1]:06d}")
