"""`edgefed launch` and what a lost board costs: a device rank killed, the coordinator killed, a rank stopped,
each under `-n 3`, ending in the log an uninterrupted simulator run writes; restarts recorded; Ctrl-C, bad
input and --restarts 0 not retried; a run killed during start-up resumed; the board list and the mpiexec
command of both MPI flavours."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from edgefed import config as config_mod
from edgefed.analysis.logs import Run
from edgefed.analysis.summary import summary_lines
from edgefed.errors import EdgefedError
from edgefed.orchestration import run as runs
from edgefed.orchestration.resume import Launch, resolve_config
from edgefed.orchestration.launcher import Board, Launcher, read_boards, world_command
from edgefed.runlog import last_completed_round, read_run

from helpers import compared
from test_mpi import MPIEXEC
from edgefed.runtime.mpi.comm import outside_world_env

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
TIMEOUT = 240
FULL = ["rounds=80", "data.clients=8", "train.clients_per_round=4", "train.local_steps=40", "log.every=10"]
TRACE = FULL + ['participation.mode="trace"', 'participation.trace="builtin:5"', 'participation.scheme="C"']


def clean_env(tag: str) -> dict:
    env = outside_world_env()
    env["EDGEFED_TEST_LAUNCH"] = tag  # every rank inherits it: how the test finds the ranks of its world
    return env


def start(tmp_path, args, tag):
    cmd = [sys.executable, "-m", "edgefed", "launch", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(tag), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def ranks_of(tag: str) -> dict[int, int]:
    """{MPI rank: pid} of the world carrying the tag."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        if env.get("EDGEFED_TEST_LAUNCH") == tag and "PMI_RANK" in env:
            out[int(env["PMI_RANK"])] = int(proc.name)
    return out


def wait_for(condition, timeout=TIMEOUT, what="it"):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def simulator_log(tmp_path, overrides):
    path = tmp_path / "sim.h5"
    runs.run(config_mod.load_config(None, overrides), path)
    return read_run(path)


def same_as(a: dict, b: dict) -> None:
    ours = {k: v for k, v in compared(a).items() if not k.startswith("launch/")}
    theirs = {k: v for k, v in compared(b).items() if not k.startswith("launch/")}
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.tobytes() == theirs[name].tobytes(), name


def launch_and(tmp_path, overrides, act, extra=()):
    """Launch under -n 3, do act(tag, log) once the run is under way, and return (exit code, out, err, log)."""
    tag, log = uuid.uuid4().hex, tmp_path / "run.h5"
    sets = [a for o in overrides for a in ("--set", o)]
    proc = start(tmp_path, ["-n", "3", "--out", str(log), "--quiet", *sets, *extra], tag)
    try:
        wait_for(lambda: last_completed_round(log) >= 20 or proc.poll() is not None, what="round 20")
        assert proc.poll() is None, proc.communicate()
        act(tag, log, proc)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err, log


def kill_rank(rank, sig):
    def act(tag, log, proc):
        pids = ranks_of(tag)
        assert rank in pids, pids
        os.kill(pids[rank], sig)
    return act


@needs_mpi
def test_a_killed_coordinator_costs_a_restart_not_the_run(tmp_path):
    """(A device rank lost, in trace mode: test_a_board_that_answers_again_is_taken_back_at_a_round_boundary.)"""
    overrides = FULL
    code, out, err, log = launch_and(tmp_path, overrides, kill_rank(0, signal.SIGKILL))
    assert code == 0, err
    restarts = [line for line in out.splitlines() if line.startswith("launch: restart")]
    assert len(restarts) == 1 and "ranks 3 -> 3" in restarts[0], out
    data = read_run(log)
    (record,) = data["launch/restarts"]
    assert record["ranks_before"] == record["ranks_after"] == 3 and record["round"] >= 20
    assert b"exit code" in record["cause"] or b"signal" in record["cause"]
    same_as(data, simulator_log(tmp_path, overrides))


@needs_mpi
def test_a_board_that_answers_again_is_taken_back_at_a_round_boundary(tmp_path, monkeypatch):
    """A board's rank stops: the coordinator declares it lost, the world ends and the launch goes on without
    the board. Asked again every [mpi] rejoin_check_s, the board answers, so the next world ends after a
    round and the one after runs on every board again, resuming the log: two restarts (ranks 3 -> 2, then
    2 -> 3, "answered again"). The board's devices (the odd ones) were away meanwhile and come back with
    fast-reboot: in trace mode, the log a simulator run writes given those rounds away ([[mpi.away]])."""
    tag, log = uuid.uuid4().hex, tmp_path / "run.h5"
    env = clean_env(tag)
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    overrides = TRACE + ["mpi.rank_timeout_s=1.5", "dynamics.fast_reboot=true"]
    boards = [Board("localhost", None)] + [Board("localhost", "x86-64-laptop")] * 2  # (MPICH: local, no SSH)
    asked, lines = [], []

    def stop_rank_2():
        wait_for(lambda: last_completed_round(log) >= 20, what="round 20")
        os.kill(ranks_of(tag)[2], signal.SIGSTOP)

    stopper = threading.Thread(target=stop_rank_2, daemon=True)
    stopper.start()
    launcher = Launcher(log, None, overrides, boards=boards, mpiexec=MPIEXEC, quiet=True, on_line=lines.append,
                        answers=lambda host: True, oom_kills=lambda host: None, rejoin_check_s=0.5,
                        ready=lambda host: asked.append(host) or True)
    assert launcher.run() == 0, lines
    stopper.join()
    assert asked == ["localhost"] and "launch: taking back localhost: it answers again" in lines
    data = read_run(log)
    first, second = data["launch/restarts"]
    assert (first["ranks_before"], first["ranks_after"]) == (3, 2) and b"stopped answering" in first["cause"]
    assert (second["ranks_before"], second["ranks_after"]) == (2, 3) and second["cause"] == b"localhost answered again"
    assert 20 <= first["round"] < second["round"] < 80
    said = [line for line in summary_lines(Run.read(log)) if line.startswith("launch restart")]
    assert len(said) == 2 and re.fullmatch(r"launch restart 1: the world died after round \d+ \(\S+\): rank 2 on "
                                           r"\S+ stopped answering for [\d.]+ s; ranks 3 -> 2", said[0]), said
    assert re.fullmatch(r"launch restart 2: the world ended after round \d+ \(\S+\): localhost answered again; "
                        r"ranks 2 -> 3", said[1]), said
    away, back = first["round"] + 1, second["round"] + 1
    assert f"launch: the 4 devices of localhost are away from round {away} until it is back" in lines
    steps = data["participation/steps"]
    assert (steps[away - 1:back - 1, 1::2] == 0).all() and (steps[back - 1:, 1::2] > 0).any()
    assert (data["participation/active"]).all()  # in the objective all along
    same_as(data, simulator_log(tmp_path, overrides + [f"mpi.away=[{{devices = [1, 3, 5, 7], round = {away}, "
                                                       f"back = {back}}}]"]))


@needs_mpi
def test_no_restart_left_gives_the_failures_exit_code(tmp_path):
    code, out, err, log = launch_and(tmp_path, FULL, kill_rank(1, signal.SIGKILL), extra=("--restarts", "0"))
    assert code not in (0, 2) and "no restart is left" in out
    assert last_completed_round(log) >= 20  # the log keeps its rounds for a --resume


@needs_mpi
def test_ctrl_c_ends_everything_at_once_with_no_restart(tmp_path):
    def interrupt(tag, log, proc):
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert time.monotonic() - sent < STOP_BOUND_S
        wait_for(lambda: not ranks_of(tag), timeout=10, what="the ranks to end")

    code, out, _, log = launch_and(tmp_path, FULL + ["rounds=5000"], interrupt)
    assert code == 130 and "restart" not in out.replace("launch: stopped", "")
    assert "launch: stopped" in out and last_completed_round(log) >= 20


STOP_BOUND_S = 10.0  # SIGINT to a 3-rank world; the launcher's own grace before SIGKILL is 5 s


@needs_mpi
def test_bad_input_inside_the_world_is_not_retried(tmp_path):
    tag = uuid.uuid4().hex
    proc = start(tmp_path, ["-n", "3", "--out", "r.h5", "--set", 'data.kind="quadratic"',
                            "--set", f'data.path="{tmp_path / "missing.npz"}"'], tag)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2 and "missing.npz" in err and "restart" not in out
    assert not (tmp_path / "r.h5").exists()  # bad input leaves nothing behind


def test_a_run_killed_during_start_up_resumes_from_its_stub(tmp_path):
    overrides = ["rounds=3", "data.clients=700"]  # building 700 devices' data takes a while
    log = tmp_path / "r.h5"
    sets = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen([sys.executable, "-m", "edgefed", "run", "--out", str(log), "--quiet", *sets],
                            env=clean_env("startup"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(log.exists, timeout=60, what="the stub")
    proc.kill()
    proc.wait()
    assert last_completed_round(log) == -1  # killed before round 0: only the stub
    from edgefed.cli import main

    assert main(["run", "--resume", str(log), "--quiet"]) == 0
    same_as(read_run(log), simulator_log(tmp_path, overrides))


# -- without MPI: the board list, the commands, the choices ----------------------------------------------------
def test_board_list_parses_and_names_bad_lines(tmp_path):
    path = tmp_path / "boards.txt"
    path.write_text("# head first\nhead coordinator\npi-a pi4b 0.5\n\npi-b pi3b-plus  # no load\n")
    assert read_boards(path) == [Board("head", None), Board("pi-a", "pi4b", 0.5), Board("pi-b", "pi3b-plus")]
    for text, message in (("head\n", "lists no board after the head node"),
                          ("head\npi-a\n", "line 2: board pi-a needs a hardware profile"),
                          ("head\npi-a pi4b lots\n", "line 2: the load 'lots' must be a number in [0, 1)")):
        path.write_text(text)
        with pytest.raises(EdgefedError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            read_boards(path)


def test_world_commands_of_both_mpi_flavours(tmp_path):
    run = ["--out", "r.h5"]
    tail = [sys.executable, "-m", "edgefed", "run", *run]
    assert world_command("mpiexec", "mpich", 3, None, tmp_path / "h", run) == ["mpiexec", "-n", "3", *tail]
    assert world_command("mpirun", "openmpi", 3, None, tmp_path / "h", run)[:4] == ["mpirun", "--oversubscribe",
                                                                                     "-n", "3"]
    cmd = world_command("mpiexec", "mpich", 2, ["head", "pi-a"], tmp_path / "h", run)
    assert cmd[:5] == ["mpiexec", "-f", str(tmp_path / "h"), "-n", "2"] and (tmp_path / "h").read_text() == "head:1\npi-a:1\n"
    cmd = world_command("mpirun", "openmpi", 2, ["head", "pi-a"], tmp_path / "h", run)
    assert cmd[:7] == ["mpirun", "--hostfile", str(tmp_path / "h"), "--map-by", "slot", "-np", "2"]
    assert (tmp_path / "h").read_text() == "head slots=1\npi-a slots=1\n"


@needs_mpi
def test_a_board_that_does_not_answer_or_went_silent_is_left_out(tmp_path):
    boards = [Board("head", None), Board("pi-a", "pi4b"), Board("pi-b", "pi4b", 0.5), Board("pi-c", "pi5")]
    lines = []
    launcher = Launcher(tmp_path / "r.h5", boards=boards, mpiexec=MPIEXEC, on_line=lines.append,
                        answers=lambda host: host != "pi-c")
    launcher._leave_out({"rank": 1, "host": "pi-a", "silent_s": 3.0})
    assert [b.host for b in launcher.boards] == ["head", "pi-b"] and launcher.ranks == 2
    assert lines == ["launch: leaving out pi-a (rank 1): it stopped answering",
                     "launch: leaving out pi-c (rank 3): it does not answer over SSH"]
    args = launcher._args(tmp_path / "status.json")
    assert args[args.index("--set") + 1] == 'device.boards=["pi4b"]' and "device.contention=[0.5]" in args
    # the two are asked whether they are back; one that is comes back in its place in the list
    assert launcher.away == [1, 3]
    launcher.back = [3]
    launcher._take_back()
    assert [b.host for b in launcher.boards] == ["head", "pi-b", "pi-c"] and launcher.away == [1]
    args = launcher._args(tmp_path / "status.json")
    assert 'device.boards=["pi4b", "pi5"]' in args and "device.contention=[0.5, 0.0]" in args
    # lost again once taken back, a board stays out: a cause that persists must not cost a restart a round
    launcher._leave_out({"rank": 2, "host": "pi-c", "silent_s": 3.0})
    assert [b.host for b in launcher.boards] == ["head", "pi-b"] and launcher.away == [1]
    # a board whose kernel killed a rank for memory during the world is named, and left out
    kills = {"pi-a": 0, "pi-b": 0, "pi-c": 4}
    lines.clear()
    launcher = Launcher(tmp_path / "r.h5", boards=boards, mpiexec=MPIEXEC, on_line=lines.append,
                        answers=lambda host: True, oom_kills=kills.get)
    launcher._oom = launcher._count_oom()
    kills["pi-b"] = 1
    starved = launcher._ran_out()
    said = "4096 MB, of which its system takes 220 MB"
    assert starved == {2: f"pi-b ran out of memory ({said})"}
    assert launcher._cause(137, None, starved) == f"board pi-b ran out of memory ({said})"
    launcher._leave_out(None, starved)
    assert [b.host for b in launcher.boards] == ["head", "pi-a", "pi-c"] and launcher.away == []  # (it would again)
    assert lines == [f"launch: leaving out pi-b (rank 2): it ran out of memory ({said})"]


def test_placement_keys_may_change_on_resume(tmp_path):
    cfg = config_mod.load_config(None, ["rounds=4", "mpi.rank_timeout_s=30"])
    from helpers import run_until

    run_until(cfg, tmp_path / "r.h5", 2)
    resumed, point = resolve_config(None, ["mpi.rank_timeout_s=5", "mpi.threads_per_rank=2"], str(tmp_path / "r.h5"))
    assert (resumed.mpi.rank_timeout_s, resumed.mpi.threads_per_rank, point.rounds_done) == (5, 2, 2)
    with pytest.raises(EdgefedError, match="differs in train.lr_local"):
        resolve_config(None, ["train.lr_local=0.5"], str(tmp_path / "r.h5"))


def test_restart_records_survive_resumes_and_are_not_repeated(tmp_path):
    cfg = config_mod.load_config(None, ["rounds=4"])
    from helpers import run_until

    path = tmp_path / "r.h5"
    first = {"launch": "L1", "round": 2, "time": "t", "cause": "exit code 9", "ranks_before": 3, "ranks_after": 3}
    point = run_until(cfg, path, 2)
    second = dict(first, round=3, cause="rank 2 on pi-b stopped answering", ranks_after=2)
    runs.run(cfg, path, resume_point=point, launch=Launch(None, (first, second)))
    rows = read_run(path)["launch/restarts"]
    assert [(r["launch"], r["round"], r["ranks_after"]) for r in rows] == [(b"L1", 2, 3), (b"L1", 3, 2)]


@needs_mpi
def test_per_rank_lists_follow_a_rank_left_out_and_overrides_reach_every_world(tmp_path):
    log = tmp_path / "r.h5"
    launcher = Launcher(log, None, ["train.lr_local=0.1"], ranks=3, mpiexec=MPIEXEC, on_line=lambda line: None,
                        placement={"device.boards": ("pi4b", "pi5"), "device.contention": (0.0, 0.5),
                                   "mpi.device_ranks": (1, 2, 1, 2)})
    first = launcher._args(tmp_path / "s.json")
    assert first[:2] == ["--out", str(log)] and first[first.index("--set") + 1] == "train.lr_local=0.1"
    log.write_bytes(b"")  # the world made the log
    launcher._leave_out({"rank": 1, "host": "h", "silent_s": 3.0})
    again = launcher._args(tmp_path / "s.json")
    sets = [again[i + 1] for i, a in enumerate(again) if a == "--set"]
    assert again[:2] == ["--resume", str(log)] and launcher.ranks == 2
    assert sets == ["train.lr_local=0.1", 'device.boards=["pi5"]', "device.contention=[0.5]", "mpi.device_ranks=[]"]


@needs_mpi
def test_a_device_stalled_at_the_end_is_slow_not_lost(tmp_path):
    """A stall in the last round outlasts the rank timeout while its rank says goodbye: the heartbeat goes on,
    so the run ends normally rather than as a lost rank."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('rounds = 3\n[data]\nclients = 4\n[train]\nclients_per_round = "all"\nlocal_steps = 5\n'
                   '[participation]\nmode = "deadline"\ndeadline_s = 0.05\ngrace_s = 0.2\n'
                   '[mpi]\nrank_timeout_s = 1.0\n[[fault]]\ndevice = 1\nround = 3\nkind = "stall"\nseconds = 3.0\n')
    done = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "edgefed", "run", str(cfg), "--out",
                           str(tmp_path / "r.h5"), "--quiet"], env=clean_env("stall"), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "stopped answering" not in done.stderr
    assert read_run(tmp_path / "r.h5")["participation/late"][2, 1]


@needs_mpi
def test_a_rank_that_hangs_while_building_its_devices_is_found_too(tmp_path):
    overrides = ["rounds=3", "data.clients=1200", "mpi.rank_timeout_s=1.5"]  # its data takes seconds to build
    tag, log = uuid.uuid4().hex, tmp_path / "run.h5"
    proc = start(tmp_path, ["-n", "3", "--out", str(log), "--quiet", *[a for o in overrides for a in ("--set", o)]],
                 tag)
    try:
        wait_for(lambda: log.exists() and 1 in ranks_of(tag), what="the stub and rank 1")
        os.kill(ranks_of(tag)[1], signal.SIGSTOP)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "rank 1 on " in err and "building its devices" in err and "ranks 3 -> 2" in out
    same_as(read_run(log), simulator_log(tmp_path, overrides))
