"""Edge deployment: hardware profiles, profile-derived deadlines, `edgefed profile` and `edgefed warmup`."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefed import hwprofile
from edgefed.config import load_config
from edgefed.errors import ConfigError
from edgefed.orchestration.ranks import check_device_ranks
from edgefed.runlog import read_run
from helpers import run_until
from test_mpi import MPIEXEC, edgefed, write
from edgefed.runtime.mpi.comm import outside_world_env

BOARDS = {"pi-zero-2w", "pi3b-plus", "pi4b", "pi5", "x86-64-laptop"}


def profile_text(speeds, name="test board", measured=True):
    return hwprofile.profile_toml({"format": 1, "name": name, "measured": measured,
                              "machine": {"arch": "aarch64", "cores": 4, "memory_mb": 1024},
                              "speed": [{"model": m, "params": p, "batch": b, "steps_per_s": s} for m, p, b, s in speeds]})


def test_shipped_profiles_load_and_describe_their_boards():
    assert BOARDS <= set(hwprofile.shipped_names())
    for name in BOARDS:
        prof = hwprofile.load_profile(name)
        assert prof.machine["arch"] == ("x86_64" if name.startswith("x86") else "aarch64")
        assert prof.machine["cores"] >= 2 and prof.machine["memory_mb"] >= 512
        assert prof.recommend["dtype"] == "float32" and prof.recommend["threads"] == 1
        timed = {"logreg", "mlp", "cnn"} | ({"charlstm"} if name.startswith("pi") else set())  # (estimated on Pis)
        assert {s.model for s in prof.speeds} == timed
        for model in timed:  # every model the runtime can derive a deadline for
            assert prof.step_seconds(model, 10, 1000) > 0
    # slower boards are slower: the ordering the estimates must keep
    per_step = [hwprofile.load_profile(b).step_seconds("mlp", 10, 199210)
                for b in ("pi-zero-2w", "pi3b-plus", "pi4b", "pi5")]
    assert per_step == sorted(per_step, reverse=True)


def test_step_seconds_scales_by_parameters_and_is_linear_in_the_batch(tmp_path):
    path = tmp_path / "b.toml"
    # 2NN: 1000 steps/s at batch 10, 200 at batch 60 -> per step 1 ms + (b - 10) * 0.08 ms
    path.write_text(profile_text([("mlp", 1000, 10, 1000.0), ("mlp", 1000, 60, 200.0), ("logreg", 610, 20, 1e4)]))
    prof = hwprofile.load_profile(str(path))
    assert prof.step_seconds("mlp", 10, 1000) == pytest.approx(1e-3)
    assert prof.step_seconds("mlp", 10, 3000) == pytest.approx(3e-3)  # three times the parameters
    assert prof.step_seconds("mlp", 35, 1000) == pytest.approx(1e-3 + 25 * 0.08e-3)  # between
    assert prof.step_seconds("mlp", 110, 1000) == pytest.approx(1e-3 + 100 * 0.08e-3)  # beyond
    assert prof.step_seconds("logreg", 40, 610) == pytest.approx(2e-4)  # one entry: proportional
    with pytest.raises(ConfigError, match=r"has no speed for the model 'cnn' \(it times: logreg, mlp\); measure it "
                                          r"on that board with `edgefed profile --config CONFIG --out FILE`"):
        prof.step_seconds("cnn", 10, 5)


@pytest.mark.parametrize("body,message", [
    ('format = 2\nname = "x"', "format must be 1"),
    ('format = 1\nname = "x"\n[machine]\narch = "a"\ncores = 1', "machine.memory_mb is missing"),
    (profile_text([("mlp", 10, 10, -1.0)]), r"speed\[0\].steps_per_s must be a positive number"),
    (profile_text([("rnn", 10, 10, 1.0)]), r"speed\[0\].model must be one of logreg, mlp, cnn"),
    (profile_text([("mlp", 10, 10, 1.0), ("mlp", 10, 10, 2.0)]), r"speed\[1\] repeats model 'mlp' at batch 10"),
    ("format = ", "cannot be read"),
    (profile_text([("mlp", 10, 10, 1.0)]) + "[rank]\nlost_share = 1.0\n", r"rank.lost_share must be a share"),
    (profile_text([("mlp", 10, 10, 1.0)]) + '[rank]\nround_s = {mlp = 0.1}\n', r"rank.round_params.mlp must be"),
    (profile_text([("mlp", 10, 10, 1.0)]) + '[rank]\nround_s = {mlp = nan}\nround_params = {mlp = 10}\n',
     r"rank.round_s.mlp must be a finite number of seconds"),
])
def test_a_bad_profile_is_named_with_its_key(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message) as info:
        hwprofile.load_profile(str(path))
    assert str(path) in str(info.value)


def test_profile_deadlines_need_a_profile_and_a_readable_factor():
    with pytest.raises(ConfigError, match=r'set \[device\] profile = "NAME" \(shipped: .*pi4b'):
        load_config(None, ['participation.mode="deadline"', 'participation.deadline_s="auto"'])
    with pytest.raises(ConfigError, match='a multiple of the profiled time like "1.5x"'):
        load_config(None, ['participation.mode="deadline"', 'participation.deadline_s="fast"',
                           'device.profile="pi4b"'])
    with pytest.raises(ConfigError, match="not found"):
        hwprofile.load_profile("pi9")
    assert hwprofile.parse_deadline("auto") == hwprofile.AUTO_FACTOR and hwprofile.parse_deadline("1.5x") == 1.5
    assert hwprofile.parse_deadline(0.05) is None


def test_auto_deadline_is_the_factor_times_k_steps_at_the_boards_speed(tmp_path, run_experiment):
    path = tmp_path / "slow.toml"
    path.write_text(profile_text([("logreg", 610, 20, 2000.0)], measured=False))  # 0.5 ms per step
    log = run_experiment({"rounds": 2, "data.clients": 4, "train.clients_per_round": "all", "train.local_steps": 30,
                          "participation.mode": "deadline", "participation.deadline_s": "2x",
                          "device.profile": str(path)})
    np.testing.assert_allclose(log["attrs"]["deadline_s"], [2 * 30 * 0.5e-3] * 4)
    assert (log["participation/steps"] <= 30).all() and log["participation/steps"].sum() > 0
    assert not log["participation/compiled"].any()  # the kernels were warmed before round 1


def test_cli_profile_of_a_config_times_its_layer_list_and_drives_an_auto_deadline_run(tmp_path):
    """`edgefed profile --config` measures the config's own model, keyed by its layer list: the run of that
    config takes its deadlines and simulated clock from the entry."""
    cfg = write(tmp_path, "auto.toml", 'rounds = 3\n[data]\nclients = 4\n[train]\nclients_per_round = "all"\n'
                                       'local_steps = 400\n[model]\nkind = "sequential"\nlayers = [{type = "dense", '
                                       'out = 16}, {type = "tanh"}, {type = "dense", out = 10}]\n'
                                       f'[participation]\nmode = "deadline"\ndeadline_s = "auto"\n'
                                       f'[device]\nprofile = "{tmp_path / "here.toml"}"\n')
    out = tmp_path / "here.toml"
    done = edgefed(["profile", "--config", cfg, "--no-cold", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    prof = hwprofile.load_profile(str(out))
    assert prof.measured and prof.machine["cores"] == __import__("psutil").cpu_count(logical=False)
    (speed,) = prof.speeds
    assert (speed.model, speed.params, speed.batch) == ("sequential", 1146, 20) and speed.steps_per_s > 100
    assert speed.key == "sequential: 60: dense(out=16) tanh dense(out=10)"
    assert prof.extra["startup"]["warm_s"]["auto.toml"] > 0 and prof.extra["memory"]["rank_rss_mb"]["auto.toml"] > 30
    again = edgefed(["profile", "--config", cfg, "--no-cold", "--out", str(out)])
    assert again.returncode == 2 and "already exists; use --force to replace it" in again.stderr
    run = edgefed(["run", cfg, "--out", str(tmp_path / "r.h5"), "--quiet"])
    assert run.returncode == 0, run.stderr
    assert "deadlines 1.1x the profiled time" in run.stdout
    log = read_run(tmp_path / "r.h5")
    # a step as a device rank takes it: the share it loses as one, and a round's own work ([rank], measured)
    assert 0 <= prof.rank.lost_share < 0.5 and 0 < prof.rank.round_s[speed.key] < 0.01
    step_s = 1 / speed.steps_per_s / (1 - prof.rank.lost_share)
    np.testing.assert_allclose(log["attrs"]["deadline_s"], 1.1 * 400 * step_s)
    # with a profile the simulator's clock is the profile's: 1.1x the profiled time fits the whole budget
    assert log["attrs"]["clock"] == "simulated" and (log["participation/steps"] == 400).all()
    np.testing.assert_allclose(np.diff(log["metrics/clock_s"]), 400 * step_s + prof.rank.round_s[speed.key], rtol=1e-9)


def test_warmup_fills_the_cache_so_a_run_compiles_nothing(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "edgefed", *args], capture_output=True, text=True, env=env,
                              timeout=600)

    # the quadratic model: the fewest kernels, so the cold compile stays short
    first = cli("warmup", "--models", "quadratic", "--dtypes", "float32")
    assert first.returncode == 0, first.stderr
    assert "warmup quadratic float32: compiled" in first.stdout
    second = cli("warmup", "--models", "quadratic", "--dtypes", "float32")
    assert "every kernel was cached" in second.stdout
    run = cli("run", "--set", 'data.kind="quadratic"', "--set", "rounds=1", "--out", str(tmp_path / "r.h5"), "--quiet")
    assert run.returncode == 0, run.stderr
    assert "compiled" not in run.stdout
    assert read_run(tmp_path / "r.h5")["attrs"]["warmup_compiled"].tolist() == [0]
    bad = cli("warmup", "--models", "rnn")
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "edgefed: error: --models 'rnn': choose from logreg, mlp, cnn, quadratic"


_KERNELS_USED = """
import sys, numpy as np
from numba.core.registry import CPUDispatcher
from edgefed.cli import main
import edgefed.kernels.network, edgefed.kernels.quadratic
code = main(["run", "--quiet", "--force", "--out", sys.argv[1], "--set", "rounds=1", *sys.argv[2:]])
if code:
    sys.exit(code)
for name, mod in sorted(sys.modules.items()):
    if name.startswith("edgefed.kernels."):
        for attr, f in vars(mod).items():
            if isinstance(f, CPUDispatcher) and f.signatures:
                params = sorted({sig[5].dtype.name for sig in f.signatures} if attr == "network" else ())
                print("kernel", name.rsplit(".", 1)[1] + "." + attr, len(f.signatures), *params)
"""


def test_a_run_loads_only_the_kernels_of_its_model_dtype(tmp_path):
    """A run loads (or compiles) the one network entry for its dtype, whatever its model and algorithm: the
    layer library's kernels are shared by every model made of them."""
    def used(*sets):
        out = subprocess.run([sys.executable, "-c", _KERNELS_USED, str(tmp_path / "r.h5"), *sets],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        return {line.split()[1]: line.split()[2:] for line in out.stdout.splitlines() if line.startswith("kernel ")}

    fedavg = used()  # the default: logistic regression, float32, FedAvg
    assert fedavg["network.network"] == ["1", "float32"], fedavg  # one entry, the run's dtype only
    assert "quadratic._sgd_steps" not in fedavg
    scaffold = used("--set", 'train.algorithm="scaffold"', "--set", 'scaffold.option="I"')
    assert scaffold == fedavg  # its control gradients: the same entry, no kernel of their own


def test_a_round_that_compiled_is_noted(monkeypatch, tmp_path):
    """The bookkeeping: a device whose work included a compilation is flagged, the others not."""
    from edgefed.algorithms.base import ServerState
    from edgefed.orchestration import run as runs
    from edgefed.runtime import local
    from edgefed.transport import RoundPlan

    cfg = load_config(None, ["data.clients=3", "train.local_steps=2", "train.clients_per_round=2"])
    setup = runs.prepare(cfg, tmp_path / "never-written.h5")
    transport = runs.local_transport(setup.cfg, setup.algorithm, setup.problem, setup.model)
    counts = iter([0, 3, 3, 3, 3, 3, 3, 4])  # before/after each device: device 0 compiles, then device 2
    monkeypatch.setattr(local, "jit_compilations", lambda: next(counts))
    x = setup.model.initial_params()
    plan = RoundPlan(1, np.array([0, 2]), np.array([2, 2], np.int32), 0.1)
    assert transport.work(plan, ServerState(x)).compiled.tolist() == [True, False]
    plan = RoundPlan(2, np.array([1, 2]), np.array([2, 2], np.int32), 0.1)
    assert transport.work(plan, ServerState(x)).compiled.tolist() == [False, True]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_boards_give_each_rank_its_own_deadline_under_mpi(tmp_path):
    slow, absurd = tmp_path / "slow.toml", tmp_path / "absurd.toml"
    slow.write_text(profile_text([("logreg", 610, 20, 5000.0)], "slow"))
    absurd.write_text(profile_text([("logreg", 610, 20, 1e9)], "absurd"))  # 1e9 steps/s: ~30 ns, nothing fits
    base = ('rounds = 2\n[data]\nclients = 4\n[train]\nclients_per_round = "all"\nlocal_steps = 20\n'
            '[participation]\nmode = "deadline"\ndeadline_s = "1.5x"\n')
    cfg = write(tmp_path, "a.toml", base + f'[device]\nboards = ["{slow}", "{absurd}"]\n')
    done = edgefed(["run", cfg, "--out", str(tmp_path / "a.h5"), "--quiet"], 3)
    assert done.returncode == 0, done.stderr
    log = read_run(tmp_path / "a.h5")
    # devices round-robin over ranks 1, 2: 0 and 2 on the slow board, 1 and 3 on the absurd one ...
    np.testing.assert_allclose(log["attrs"]["deadline_s"], 1.5 * 20 * np.array([1 / 5000, 1 / 1e9] * 2))
    # ... and the device ranks work to them
    steps = log["participation/steps"]
    assert (steps[:, [0, 2]] == 20).all() and (steps[:, [1, 3]] == 0).all()
    wrong = load_config(write(tmp_path, "w.toml", base + f'[device]\nboards = ["{slow}"]\n'))
    with pytest.raises(ConfigError) as refused:  # (what rank 0 says, exit 2, under mpiexec: tests/test_mpi.py)
        check_device_ranks(wrong, 2)
    assert str(refused.value) == ("config: device.boards names 1 boards, but this run has 2 device ranks; give one "
                                  "per device rank (entry i is rank i + 1)")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_profile_under_mpi_measures_the_collectives(tmp_path):
    out = tmp_path / "cluster.toml"
    done = edgefed(["profile", "--models", "logreg,mlp", "--no-cold", "--out", str(out)], 2)
    assert done.returncode == 0, done.stderr
    prof = hwprofile.load_profile(str(out))
    mpi = prof.extra["mpi"]
    assert mpi["ranks"] == 2 and mpi["hosts"] == 1
    assert [c["model"] for c in mpi["collective"]] == ["logreg", "mlp"]
    assert [c["bytes"] for c in mpi["collective"]] == [610 * 4, 199210 * 4]
    assert all(c["bcast_ms"] > 0 and c["gather_ms"] > 0 for c in mpi["collective"])


LAUNCHER = Path(__file__).resolve().parents[1] / "launch" / "pi-cluster.sh"


def launcher(tmp_path, boards, *args, **env):
    path = tmp_path / "boards.txt"
    path.write_text(boards)
    env = {**outside_world_env(),
           "VENV": str(Path(sys.executable).parent.parent), **env}
    return subprocess.run(["bash", str(LAUNCHER), *args[:1], str(path), *args[1:]], capture_output=True, text=True,
                          env=env, timeout=300)


def test_pi_cluster_run_goes_through_edgefed_launch_with_the_board_list(tmp_path):
    boards = "# head first\nhead coordinator\npi-a pi4b 0.0\n\npi-b pi-zero-2w 0.9"  # no newline at the end
    done = launcher(tmp_path, boards, "run", "c.toml", "--out", "r.h5", DRY_RUN="1", MPIRUN="mpirun",
                    MPI_ARGS="-iface eth0")
    assert done.returncode == 0, done.stderr
    cmd = shlex.split(done.stdout)  # printf %q quoting, as a shell would read it
    assert cmd[0].endswith("/python") and cmd[1:5] == ["-m", "edgefed", "launch", "--boards"]
    assert cmd[6:] == ["--mpiexec", "mpirun", "--mpiexec-args", "-iface eth0", "c.toml", "--out", "r.h5"]
    from edgefed.orchestration.launcher import board_overrides, read_boards

    (tmp_path / "b.txt").write_text(boards.replace("\n", "\r\n"))  # saved with Windows line ends
    assert board_overrides(read_boards(tmp_path / "b.txt")) == ['device.boards=["pi4b", "pi-zero-2w"]',
                                                                 "device.contention=[0.0, 0.9]"]
    bad = launcher(tmp_path, "head coordinator\npi-a\n", "run", "c.toml", DRY_RUN="1")
    assert bad.returncode == 2 and "board pi-a needs a hardware profile" in bad.stderr
    # warmup: the head (this machine, which may run no sshd) here, every board over SSH
    warm = [shlex.split(line) for line in launcher(tmp_path, boards, "warmup", DRY_RUN="1").stdout.splitlines()]
    assert [c[0] == "ssh" and c[3] for c in warm] == [False, "pi-a", "pi-b"], warm
    assert all(c[-5:] == ["-m", "edgefed", "warmup", "--dtypes", "float32"] for c in warm), warm


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_pi_cluster_launcher_runs_a_deadline_run_on_local_boards(tmp_path):
    """MPICH's launcher starts "localhost" ranks without SSH: the board list, profiles and deadlines for real."""
    boards = "localhost coordinator\nlocalhost x86-64-laptop\nlocalhost pi4b\n"
    done = launcher(tmp_path, boards, "run", str(LAUNCHER.parent / "pi-deadline.toml"), "--set", "rounds=2",
                    "--out", str(tmp_path / "r.h5"), "--quiet", MPI="mpich", MPIRUN=MPIEXEC)
    assert done.returncode == 0, done.stderr
    deadlines = read_run(tmp_path / "r.h5")["attrs"]["deadline_s"]
    fast = hwprofile.load_profile("x86-64-laptop").step_seconds("logreg", 20, 610)
    slow = hwprofile.load_profile("pi4b").step_seconds("logreg", 20, 610)
    np.testing.assert_allclose(deadlines[:4], 1.5 * 200 * np.array([fast, slow, fast, slow]))


def test_board_readings_come_from_sysfs_like_a_pis(tmp_path):
    from edgefed.runtime.deadline import BoardReadings

    freq = tmp_path / "devices/system/cpu/cpu2/cpufreq/scaling_cur_freq"
    temp = tmp_path / "class/thermal/thermal_zone0/temp"
    for path, value in ((freq, "1500000\n"), (temp, "48312\n")):
        path.parent.mkdir(parents=True)
        path.write_text(value)
    board = BoardReadings(core=2, sys_root=str(tmp_path))
    assert board.frequency_mhz() == 1500.0 and board.temperature_c() == pytest.approx(48.312)
    freq.write_text("600000\n")  # throttled: read anew every time
    assert board.frequency_mhz() == 600.0


def test_a_resumed_deadline_run_keeps_the_deadlines_it_started_with(tmp_path):
    from edgefed.orchestration import run as runs

    profile = tmp_path / "board.toml"
    profile.write_text(profile_text([("logreg", 610, 20, 2000.0)]))
    cfg = load_config(None, ["rounds=4", "data.clients=3", 'train.clients_per_round="all"', "train.local_steps=4",
                             'participation.mode="deadline"', 'participation.deadline_s="auto"',
                             f'device.profile="{profile}"'])
    path = tmp_path / "run.h5"
    point = run_until(cfg, path, 2)
    profile.write_text(profile_text([("logreg", 610, 20, 100.0)]))  # the board re-profiled in between
    runs.run(cfg, path, resume_point=point)
    np.testing.assert_allclose(read_run(path)["attrs"]["deadline_s"], [1.1 * 4 / 2000.0] * 3)


def test_resuming_a_log_without_a_newer_column_pads_its_completed_rounds(tmp_path):
    """A log written before `participation/compiled` existed resumes with that column aligned to the rounds."""
    import h5py

    from edgefed.orchestration import run as runs
    from edgefed.orchestration.resume import resolve_config

    cfg = load_config(None, ["rounds=4", "data.clients=3", "train.clients_per_round=2", "train.local_steps=2"])
    path = tmp_path / "old.h5"
    run_until(cfg, path, 2)
    with h5py.File(path, "r+") as f:
        del f["participation/compiled"]
    _, point = resolve_config(None, [], str(path))
    runs.run(cfg, path, resume_point=point)
    log = read_run(path)
    assert log["participation/compiled"].shape == log["participation/steps"].shape == (4, 3)


def test_a_profile_that_does_not_time_the_model_is_one_line_naming_the_model_and_the_command(run_experiment, tmp_path):
    """Once "set [device] profile" although one was set: now the profile, the model and how to time it."""
    with pytest.raises(ConfigError, match=r"hardware profile Raspberry Pi 4 Model B \(.*pi4b.toml\) has no speed for "
                                          r"the model 'quadratic' \(it times: charlstm, cnn, logreg, mlp\); measure it on that "
                                          r"board with `edgefed profile --config CONFIG --out FILE`"):
        run_experiment({"data.kind": "quadratic", "participation.mode": "deadline", "participation.deadline_s": "auto",
                        "device.profile": "pi4b"})
    layers = [{"type": "dense", "out": 8}, {"type": "relu"}, {"type": "dense", "out": 10}]
    with pytest.raises(ConfigError, match=r"has no speed for the model 'sequential: 60: dense\(out=8\) relu "
                                          r"dense\(out=10\)'"):
        run_experiment({"model.kind": "sequential", "model.layers": layers, "device.profile": "pi4b"})
    assert not list(tmp_path.glob("*.h5"))  # refused before a log was written
