"""A launcher killed by SIGKILL leaves no process of its launch running (:mod:`server.reaper`).

The launcher's own children die with it (parent-death signal); a descendant in another session (as the
SuperLink's ``flwr-serverapp``) is stopped by the reaper.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from server.processes import LAUNCH_MARK
from tests.conftest import ROOT

_LAUNCHER = """
import os, subprocess, sys, time, uuid
from pathlib import Path
from server.processes import LAUNCH_MARK, Processes
work = Path(sys.argv[1])
env = dict(os.environ, {mark}=sys.argv[2])
procs = Processes(work, env)
# a child that starts a grandchild in its own session, as the SuperLink starts flower-superexec
child = procs.start("child", [sys.executable, "-c", "import subprocess, sys, time; "
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
                              "start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(300)",
                              str(work / "grandchild.pid")])
while not (work / "grandchild.pid").exists() or not (work / "grandchild.pid").read_text():
    time.sleep(0.05)
print(child.pid, flush=True)
time.sleep(300)
""".replace("{mark}", LAUNCH_MARK)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_sigkilled_launcher_leaves_no_process_of_its_launch(tmp_path):
    mark = f"test-reaper-{os.getpid()}-{time.time_ns()}"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path), mark], cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert _alive(child) and _alive(grandchild)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 20
    while (_alive(child) or _alive(grandchild)) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert not _alive(child), "the launcher's child outlived it"
        assert not _alive(grandchild), "a descendant in another session outlived the launcher"
    finally:
        for pid in (child, grandchild):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
