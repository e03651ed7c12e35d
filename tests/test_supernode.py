"""cancelfl-supernode: the warm ClientApp process (zygote + shim) and the short polls, driven for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.clientapp_zygote import write_shim
from server.flower_tuning import PollClock

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



class _InFlight:
    """A request that waits ``delay`` seconds; :attr:`most` counts the most calls in flight at once."""

    def __init__(self, delay: float) -> None:
        self.delay, self.inside, self.most, self.lock = delay, 0, 0, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(self.delay)
        with self.lock:
            self.inside -= 1

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
    clock = PollClock(0.01)
    t = time.perf_counter()
    clock.sleep(3)  # Flower's idle poll
    clock.sleep(0.5)  # Flower's reply wait
    assert time.perf_counter() - t < 0.5
    slow_poll = PollClock(0.3, local=0.01)  # the idle poll (a request to the SuperLink) and the local waits apart
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


def test_object_transfers_retry_quickly_and_run_several_requests_at_once():
    """Every process (ServerApp, SuperNode, ClientApp) shortens Flower's 1 s object-pull wait and widens its 2 workers."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    from server import flower_tuning

    fns = (iu.pull_objects, iu.pull_and_inflate_object_from_tree, iu.push_objects, iu.push_object_contents_from_iterable)
    saved, workers = [dict(fn.__kwdefaults__) for fn in fns], iu.get_num_workers
    try:
        assert flower_tuning.tune_object_transfers()
        for fn in fns[:2]:
            assert (fn.__kwdefaults__["initial_backoff"], fn.__kwdefaults__["backoff_cap"]) == flower_tuning.OBJECT_PULL_BACKOFF
        calls = []

        def pull(obj_id):  # the object is there at the third ask
            calls.append(time.perf_counter())
            if len(calls) < 3:
                raise iu.ObjectUnavailableError(obj_id)
            return b"content"
        t = time.perf_counter()
        assert iu.pull_objects(["a"], pull) == {"a": b"content"}
        assert time.perf_counter() - t < 0.5  # Flower's default waits 1 s + 2 s
        probe = _InFlight(0.2)  # a push that waits (on the SuperLink), not computes
        iu.push_object_contents_from_iterable(((str(i), b"x") for i in range(16)), lambda _i, _c: probe())
        assert probe.most == flower_tuning.OBJECT_CONCURRENCY > 2  # Flower's own: 2, capped at the core count
    finally:
        for fn, kw in zip(fns, saved, strict=True):
            fn.__kwdefaults__.clear()
            fn.__kwdefaults__.update(kw)
        iu.get_num_workers = workers


def test_an_object_push_answered_with_a_server_error_is_asked_again():
    import httpx

    from server.flower_tuning import PUSH_TRIES, retrying_push

    def failing(codes):
        calls = []

        def push(obj_id, content):
            calls.append(obj_id)
            if len(calls) <= len(codes):
                raise httpx.HTTPStatusError("x", request=None, response=SimpleNamespace(status_code=codes[len(calls) - 1]))
            return "stored"
        return push, calls

    push, calls = failing([500, 503])  # a locked SuperLink state, twice: the third try stores it
    assert retrying_push(push, first_wait=0.001)("a", b"x") == "stored" and calls == ["a"] * 3
    push, calls = failing([404])  # not a server error: no second try
    with pytest.raises(httpx.HTTPStatusError):
        retrying_push(push, first_wait=0.001)("a", b"x")
    assert len(calls) == 1
    push, calls = failing([500] * 10)  # a lasting server error propagates after PUSH_TRIES tries
    with pytest.raises(httpx.HTTPStatusError):
        retrying_push(push, first_wait=0.001)("a", b"x")
    assert len(calls) == PUSH_TRIES


def test_an_unsupported_flower_is_left_as_it_is(monkeypatch):
    from flwr.supercore.inflatable import inflatable_utils as iu

    from server import flower_tuning

    monkeypatch.setattr(flower_tuning, "version", lambda _name: "9.9.0")
    before = dict(iu.pull_objects.__kwdefaults__)
    with pytest.warns(UserWarning, match="9.9.0"):
        assert not flower_tuning.tune_object_transfers()
    assert flower_tuning.tune_supernode(0.2) is None and not flower_tuning.tune_clientapp()
    assert iu.pull_objects.__kwdefaults__ == before


def test_a_child_reuses_the_install_of_a_fab_with_the_same_sha256(tmp_path, monkeypatch):
    import flwr.supernode.runtime.run_clientapp as rc

    from server import flower_tuning

    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    installs = []

    def install(fab_file, install_dir=None, skip_prompt=False):  # Flower's: extract, check every hash, copy
        installs.append(fab_file)
        path = tmp_path / "apps" / f"app-{len(installs)}"
        path.mkdir(parents=True)
        (path / "pyproject.toml").write_text("")
        return path
    monkeypatch.setattr(rc, "install_from_fab", install)
    flower_tuning.cached_fab_install()
    first = rc.install_from_fab(b"fab one", skip_prompt=True)
    assert rc.install_from_fab(b"fab one", skip_prompt=True) == first and installs == [b"fab one"]
    other = rc.install_from_fab(b"fab two", skip_prompt=True)  # another FAB: Flower's install again
    assert other != first and installs == [b"fab one", b"fab two"]
    (first / "pyproject.toml").unlink()  # an install that is gone is not trusted
    assert rc.install_from_fab(b"fab one", skip_prompt=True) != first and len(installs) == 3


def test_loading_the_clientapp_writes_its_bytecode_even_where_python_is_told_not_to(monkeypatch):
    import flwr.supernode.runtime.run_clientapp as rc

    from server import flower_tuning

    seen = []
    monkeypatch.setattr(rc, "get_load_client_app_fn", lambda *a, **k: lambda *b: seen.append(sys.dont_write_bytecode))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    flower_tuning.cached_app_bytecode()
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


def test_the_serverapp_pulls_the_listed_replies_at_once_and_intact(monkeypatch):
    """Flower's reply pull, tuned: every listed reply's objects are pulled in parallel, each reply arrives whole."""
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.message_pb2 import PullObjectResponse
    from flwr.proto.node_pb2 import Node
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
    from flwr.supercore.task_identity import TaskIdentity

    from server import flower_tuning

    for key, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, key, value)
    sent = [Message(RecordDict({"arrays": ArrayRecord([np.full(3, float(n))]), "config": ConfigRecord({"n": n})}),
                    dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    store, protos, trees = {}, [], []
    for m in sent:
        m.metadata.__dict__["_message_id"] = m.object_id
        store.update({k: o.deflate() for k, o in get_all_nested_objects(m).items()})
        protos.append(message_to_proto(remove_content_from_message(m)))
        trees.append(get_object_tree(m))
    probe, confirmed = _InFlight(0.05), []

    def pull_object(req):  # a request that waits on the SuperLink
        probe()
        return PullObjectResponse(object_found=True, object_available=True, object_content=store[req.object_id])

    client = SimpleNamespace(PullMessages=lambda req: SimpleNamespace(messages_list=protos, message_object_trees=trees),
                             PullObject=pull_object, ConfirmMessageReceived=lambda req: confirmed.append(req.message_object_id))
    grid = SimpleNamespace(_run=SimpleNamespace(run_id=1), node=Node(node_id=0), _runtime_client=client)
    got = flower_tuning._pull_messages(grid, [m.object_id for m in sent])
    assert [g.metadata.message_id for g in got] == [m.object_id for m in sent]  # the SuperLink's order
    assert sorted(confirmed) == sorted(m.object_id for m in sent)
    for g, m in zip(got, sent, strict=True):
        assert g.content["config"]["n"] == m.content["config"]["n"]
        assert np.array_equal(g.content["arrays"].to_numpy_ndarrays()[0], m.content["arrays"].to_numpy_ndarrays()[0])
    from flwr.supercore.inflatable import inflatable_utils as iu

    one_reply = iu.get_num_workers(iu.pull_objects.__kwdefaults__["max_concurrent_pulls"])
    assert probe.most > one_reply  # several replies' objects in flight at once


def test_the_superexec_sleep_ends_at_each_wake_and_otherwise_waits(tmp_path):
    """WakeClock: a datagram ends a long wait; two wakes make two waits end at once; none left, it waits its time."""
    from server.superexec_wake import WakeClock, bind, waker

    clock, wake = WakeClock(bind(tmp_path / "w")), waker(tmp_path / "w")
    threading.Timer(0.2, wake).start()
    t = time.monotonic()
    clock.sleep(300)
    assert time.monotonic() - t < 60  # woken, not timed out
    wake()
    wake()
    t = time.monotonic()
    clock.sleep(300)
    clock.sleep(300)
    assert time.monotonic() - t < 60
    t = time.monotonic()
    clock.sleep(0.3)
    assert time.monotonic() - t >= 0.25  # nothing pending: the loop's own interval
    waker(tmp_path / "gone")()  # nobody bound there: no error (the SuperExec's poll is the fallback)
