"""cancelfl-supernode: the warm ClientApp process (zygote + shim) and the short polls, driven for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.clientapp_zygote import write_shim
from server.supernode import _PollClock

REAL = shutil.which("flwr-clientapp") or str(Path(sys.executable).parent / "flwr-clientapp")


@pytest.fixture
def zygote(tmp_path):
    sock = tmp_path / "z.sock"
    proc = subprocess.Popen([sys.executable, "-m", "server.clientapp_zygote", str(sock), "--parent-pid", str(os.getpid())])
    deadline = time.time() + 120
    while not sock.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert sock.exists(), "the zygote did not start serving"
    yield sock
    proc.terminate()
    proc.wait(timeout=30)


def _shim_env(tmp_path: Path, sock: Path) -> tuple[Path, dict]:
    shim = write_shim(tmp_path / "bin")
    return shim, {**os.environ, "CANCELFL_ZYGOTE": str(sock), "CANCELFL_REAL_CLIENTAPP": REAL}


def test_the_shim_runs_flwr_clientapp_in_a_forked_child_with_its_streams_and_exit_code(tmp_path, zygote):
    shim, env = _shim_env(tmp_path, zygote)
    ok = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "--token" in ok.stdout  # Flower's own flwr-clientapp parser answered
    bad = subprocess.run([str(shim), "--no-such-flag"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "flwr-clientapp: error:" in bad.stderr  # the child's exit code and stderr


def test_without_a_zygote_the_shim_runs_the_real_flwr_clientapp(tmp_path):
    shim, env = _shim_env(tmp_path, tmp_path / "absent.sock")
    out = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--token" in out.stdout


def test_forked_children_do_not_share_numpy_draws():
    """Each message's child reseeds numpy's generator: two forks of one process draw differently."""
    from server import clientapp_zygote

    draws = []
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            import numpy

            clientapp_zygote._child_setup()
            os.write(w, str(numpy.random.randint(1 << 30)).encode())
            os._exit(0)
        os.close(w)
        draws.append(os.read(r, 64))
        os.waitpid(pid, 0)
    assert draws[0] != draws[1]


def test_the_poll_clock_shortens_flowers_waits_only():
    clock = _PollClock(0.01)
    t = time.perf_counter()
    clock.sleep(3)  # Flower's idle poll
    clock.sleep(0.5)  # Flower's reply wait
    assert time.perf_counter() - t < 0.5
    slow_poll = _PollClock(0.3, local=0.01)  # the idle poll (a request to the SuperLink) and the local waits apart
    t = time.perf_counter()
    slow_poll.sleep(0.5)
    assert time.perf_counter() - t < 0.2
    t = time.perf_counter()
    slow_poll.sleep(3)
    assert 0.3 <= time.perf_counter() - t < 1.0
    slow_poll.replied()  # a reply just left: the round's next message comes soon, the poll is quicker
    t = time.perf_counter()
    slow_poll.sleep(3)
    assert time.perf_counter() - t < 0.25
    slow_poll.last_reply -= slow_poll.window  # long after the reply: the idle poll again
    t = time.perf_counter()
    slow_poll.sleep(3)
    assert time.perf_counter() - t >= 0.3
    t = time.perf_counter()
    clock.sleep(0.05)  # shorter waits are kept
    assert time.perf_counter() - t >= 0.05
    assert clock.monotonic is time.monotonic  # everything else is the time module's


def test_the_round_loop_pulls_deployment_replies_without_flowers_3_s_wait(monkeypatch):
    """MeteredGrid polls Flower's HttpGrid itself (50-250 ms) and still honours the timeout."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.run.loop import MeteredGrid

    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, key, value)

    class HttpGrid(Grid):  # noqa: D101 - the name is what the loop recognises as Flower's deployment grid
        def __init__(self, ready_after: float) -> None:
            self.ready_after, self.pushed = ready_after, {}

        def push_messages(self, messages):  # noqa: D102
            self.t0 = time.monotonic()
            for i, m in enumerate(messages):
                self.pushed[str(i)] = m
            return list(self.pushed)

        def pull_messages(self, message_ids):  # noqa: D102
            if time.monotonic() - self.t0 < self.ready_after:
                return []
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid, src_node_id=int(mid) + 1),
                                    has_error=lambda: False,
                                    content=RecordDict({"c": ConfigRecord({"ok": 1})})) for mid in message_ids]

        def send_and_receive(self, messages, *, timeout=None):  # noqa: D102
            raise AssertionError("Flower's 3 s polling loop must not be used")

        create_message = get_node_ids = set_run = run = None

    msgs = [Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="train") for n in (1, 2)]
    t = time.perf_counter()
    replies = MeteredGrid(HttpGrid(ready_after=0.3)).send_and_receive(msgs, timeout=10)
    assert len(replies) == 2 and time.perf_counter() - t < 1.5
    t = time.perf_counter()
    assert MeteredGrid(HttpGrid(ready_after=60)).send_and_receive(msgs, timeout=0.5) == []
    assert time.perf_counter() - t < 2.0


def test_the_zygote_exits_with_the_process_that_started_it(tmp_path):
    """A SuperNode that dies while its zygote is stuck importing leaves no zygote behind (parent-death signal)."""
    stuck = ("import time, server.clientapp_zygote as z; z._preload = lambda: time.sleep(3600); "
             f"z.main([{str(tmp_path / 'z.sock')!r}])")  # no --parent-pid: only the death signal can end it
    starter = ("import os, subprocess, sys, time; "
               f"p = subprocess.Popen([sys.executable, '-c', {stuck!r}]); print(p.pid, flush=True); time.sleep(2)")
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    zygote = int(parent.stdout.readline())
    parent.wait(timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline and Path(f"/proc/{zygote}").exists() and "Z" not in _state(zygote):
        time.sleep(0.1)
    assert not Path(f"/proc/{zygote}").exists() or "Z" in _state(zygote)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_object_pulls_retry_quickly_in_every_process_and_agree():
    """ServerApp (the round loop's grid) and SuperNode/ClientApp (the zygote) shorten Flower's 1 s object-pull wait."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    from server import clientapp_zygote
    from strategies.run import grid

    assert clientapp_zygote.OBJECT_PULL_BACKOFF == grid.OBJECT_PULL_BACKOFF
    fns = (iu.pull_objects, iu.pull_and_inflate_object_from_tree)
    saved = [dict(fn.__kwdefaults__) for fn in fns]
    try:
        for make_quick in (clientapp_zygote.quick_object_pulls, grid.quick_object_pulls):
            for fn, kw in zip(fns, saved, strict=True):  # Flower's own
                fn.__kwdefaults__.update(kw)
            make_quick()
            for fn in fns:
                assert (fn.__kwdefaults__["initial_backoff"], fn.__kwdefaults__["backoff_cap"]) == grid.OBJECT_PULL_BACKOFF
        calls = []

        def pull(obj_id):  # the object is there at the third ask
            calls.append(time.perf_counter())
            if len(calls) < 3:
                raise iu.ObjectUnavailableError(obj_id)
            return b"content"
        t = time.perf_counter()
        assert iu.pull_objects(["a"], pull) == {"a": b"content"}
        assert time.perf_counter() - t < 0.5  # Flower's default waits 1 s + 2 s
    finally:
        for fn, kw in zip(fns, saved, strict=True):
            fn.__kwdefaults__.clear()
            fn.__kwdefaults__.update(kw)


def test_a_child_reuses_the_install_of_a_fab_with_the_same_sha256(tmp_path, monkeypatch):
    import flwr.supernode.runtime.run_clientapp as rc

    from server import clientapp_zygote

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    installs = []

    def install(fab_file, install_dir=None, skip_prompt=False):  # Flower's: extract, check every hash, copy
        installs.append(fab_file)
        path = tmp_path / "apps" / f"app-{len(installs)}"
        path.mkdir(parents=True)
        (path / "pyproject.toml").write_text("")
        return path
    monkeypatch.setattr(rc, "install_from_fab", install)
    clientapp_zygote._cached_fab_install()
    first = rc.install_from_fab(b"fab one", skip_prompt=True)
    assert rc.install_from_fab(b"fab one", skip_prompt=True) == first and installs == [b"fab one"]
    other = rc.install_from_fab(b"fab two", skip_prompt=True)  # another FAB: Flower's install again
    assert other != first and installs == [b"fab one", b"fab two"]
    (first / "pyproject.toml").unlink()  # an install that is gone is not trusted
    assert rc.install_from_fab(b"fab one", skip_prompt=True) != first and len(installs) == 3


def test_loading_the_clientapp_writes_its_bytecode_even_where_python_is_told_not_to(monkeypatch):
    import flwr.supernode.runtime.run_clientapp as rc

    from server import clientapp_zygote

    seen = []
    monkeypatch.setattr(rc, "get_load_client_app_fn", lambda *a, **k: lambda *b: seen.append(sys.dont_write_bytecode))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    clientapp_zygote._cached_app_bytecode()
    rc.get_load_client_app_fn("", None, True)("fab-id", "1.0", "hash")
    assert seen == [False] and sys.dont_write_bytecode is True  # only while the app's modules load


def test_a_server_error_on_a_reply_pull_is_asked_again_and_others_propagate(monkeypatch):
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.run.grid import MeteredGrid

    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, key, value)

    class StatusError(Exception):
        def __init__(self, code: int) -> None:
            super().__init__(f"HTTP {code}")
            self.response = SimpleNamespace(status_code=code)

    class HttpGrid(Grid):  # noqa: D101 - the name is what the loop recognises as Flower's deployment grid
        def __init__(self, errors: list[int]) -> None:
            self.errors = list(errors)

        def push_messages(self, messages):  # noqa: D102
            return [str(i) for i, _ in enumerate(messages)]

        def pull_messages(self, message_ids):  # noqa: D102
            if self.errors:
                raise StatusError(self.errors.pop(0))
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=mid, src_node_id=int(mid) + 1),
                                    has_error=lambda: False,
                                    content=RecordDict({"c": ConfigRecord({"ok": 1})})) for mid in message_ids]

        create_message = get_node_ids = set_run = run = send_and_receive = None

    msgs = [Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="train") for n in (1, 2)]
    assert len(MeteredGrid(HttpGrid([500, 503])).send_and_receive(msgs, timeout=10)) == 2
    with pytest.raises(StatusError):
        MeteredGrid(HttpGrid([404])).send_and_receive(msgs, timeout=10)
