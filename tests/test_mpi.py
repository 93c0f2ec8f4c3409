"""The MPI runtime, each test a real `mpiexec` in a subprocess with a timeout (a hang fails the test)."""

import re
import subprocess
import sys

import numpy as np
import pytest

from edgefed.config import load_config
from edgefed.orchestration import run as runs
from edgefed.runlog import measured, read_run
from edgefed.runtime.mpi.comm import local_mpiexec, outside_world_env

MPIEXEC = local_mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
TIMEOUT = 240

SMALL = """rounds = 6
[data]
clients = 7
samples = "pareto"
[train]
clients_per_round = 4
local_steps = 10
"""


def edgefed(args, ranks=None, timeout=TIMEOUT):
    cmd = [sys.executable, "-m", "edgefed", *args]
    if ranks:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = outside_world_env()
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def simulator_then_ranks(tmp_path, text: str, ranks: int = 3) -> list[dict]:
    """The logs of one config run in the simulator (in this process: no second interpreter to start) and
    under `mpiexec -n ranks`."""
    cfg = write(tmp_path, "c.toml", text)
    runs.run(load_config(cfg), tmp_path / "sim.h5")
    done = edgefed(["run", cfg, "--out", str(tmp_path / "mpi.h5"), "--quiet"], ranks)
    assert done.returncode == 0, done.stderr
    return [read_run(tmp_path / "sim.h5"), read_run(tmp_path / "mpi.h5")]


def same_datasets(a, b, skip=()):
    skip = set(skip) | measured(a["attrs"]) | measured(b["attrs"])
    return [k for k in a if k != "attrs" and k not in skip and a[k].tobytes() != b[k].tobytes()]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """The simulator's log (a process of its own) of the config the MPI runs must reproduce."""
    folder = tmp_path_factory.mktemp("sim")
    cfg = write(folder, "fedavg.toml", SMALL)
    out = folder / "fedavg.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"])
    assert done.returncode == 0, done.stderr
    return cfg, read_run(out)


def test_mpi_writes_the_simulators_bytes(tmp_path, simulated):
    """One device rank (3 ranks: most other tests; more, and uneven shares, over the loopback world:
    tests/test_protocol.py)."""
    cfg, sim = simulated
    out = tmp_path / "mpi.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"], 2)
    assert done.returncode == 0, done.stderr
    assert "MPI: 1 device ranks" in done.stdout
    log = read_run(out)
    assert same_datasets(sim, log) == []
    # each rank's peak resident memory (the device rank's from its reports) beside the plan's estimate
    peaks, estimates = log["attrs"]["rank_peak_rss_mb"], log["attrs"]["rank_memory_estimate_mb"]
    assert peaks.shape == estimates.shape == (2,) and (peaks > 50).all() and (estimates > peaks * 0.8).all()
    assert sim["attrs"]["rank_peak_rss_mb"].shape == (1,)


def test_a_raising_rank_aborts_the_world_with_its_message(tmp_path):
    cfg = write(tmp_path, "c.toml", SMALL.replace("clients_per_round = 4", 'clients_per_round = "all"')
                + "\n[[fault]]\ndevice = 5\nround = 3\nkind = \"raise\"\n")
    out = tmp_path / "r.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"], 3, timeout=120)
    assert done.returncode != 0
    assert "edgefed: error on rank 2: injected fault: device 5 raised in round 3" in done.stderr
    log = read_run(out)  # everything before the failing round is logged, ready for --resume
    assert log["state/round"][0] == 2 and log["participation/steps"].shape == (2, 7)


def test_bad_config_under_mpi_is_one_line_and_exit_2(tmp_path):
    cfg = write(tmp_path, "c.toml", SMALL + "local_step = 3\n")
    done = edgefed(["run", cfg, "--out", str(tmp_path / "r.h5")], 2, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["edgefed: error: config: unknown key [train] 'local_step'; did you mean 'local_steps'?"]
    bad_map = write(tmp_path, "m.toml", SMALL + "[mpi]\ndevice_ranks = [1, 1, 1, 1, 1, 1, 5]\n")
    done = edgefed(["run", bad_map, "--out", str(tmp_path / "r.h5")], 3, timeout=120)
    assert done.returncode == 2 and "mpi.device_ranks holds rank 5; devices live on ranks 1..2" in done.stderr
    good = write(tmp_path, "g.toml", SMALL)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    unwritable = edgefed(["run", good, "--out", str(blocker / "r.h5")], 2, timeout=120)
    lines = [line for line in unwritable.stderr.splitlines() if line.strip()]
    assert unwritable.returncode == 2 and len(lines) == 1 and "is not a writable folder" in lines[0]
    huge = write(tmp_path, "h.toml", SMALL + '[model]\nkind = "sequential"\nlayers = [{type = "dense", out = '
                                              '1000000000}, {type = "dense", out = 10}]\n')
    done = edgefed(["run", huge, "--out", str(tmp_path / "h.h5")], 2, timeout=120)  # (was a traceback, exit 3)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "model.layers[0] (dense) makes the model need" in lines[0]
    assert not (tmp_path / "h.h5").exists()
    large = write(tmp_path, "b.toml", SMALL + '[model]\nkind = "sequential"\nlayers = [{type = "dense", out = '
                                               '400000}, {type = "dense", out = 10}]\n[device]\nboards = ["pi-zero-2w"]\n')
    done = edgefed(["run", large, "--out", str(tmp_path / "b.h5")], 2, timeout=120)  # fits here, not a Zero
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert re.search(r"board pi-zero-2w \(rank 1\) has 512 MB, of which its system takes 220 MB: 292 MB for the "
                     r"rank, which needs about [\d.]+ [MG]B", lines[0]), lines[0]
    assert not (tmp_path / "b.h5").exists()


DEADLINE = """rounds = 5
[data]
clients = 4
samples = 300
[train]
clients_per_round = "all"
local_steps = 100000
[participation]
mode = "deadline"
deadline_s = 0.1
grace_s = 0.3
"""


def test_deadline_run_with_a_hung_device_replays_as_a_trace(tmp_path):
    """The hung device does not hold its round, its late report never enters a later one, and the log replays."""
    cfg = write(tmp_path, "d.toml", DEADLINE + "[mpi]\ndevice_ranks = [1, 1, 1, 2]\n"
                + "\n[[fault]]\ndevice = 3\nround = 2\nkind = \"stall\"\nseconds = 2.5\n")
    out = tmp_path / "d.h5"
    done = edgefed(["run", cfg, "--out", str(out)], 3)
    assert done.returncode == 0, done.stderr
    log = read_run(out)
    late = log["participation/late"]
    assert late[1, 3] and not late[:, :3].any() and not late[0].any()
    assert log["metrics/round_elapsed_s"][1] < 2.0  # the round went on without the hung device
    steps = log["participation/steps"]
    assert steps[1, 3] == 0 and log["participation/coeff"][1, 3] == 0
    assert np.all(steps[:, :3] > 0) and np.all(steps < 100000)  # the deadline, not the budget, stopped them
    elapsed = log["participation/elapsed_s"][~late]
    assert elapsed.max() < 0.1 + 0.08  # overshoot within a chunk (1 ms) plus scheduling noise on a shared VM
    # Replay the log as a trace, in the simulator and under MPI: the same trajectory, bit for bit.
    replay = DEADLINE.replace('mode = "deadline"', f'mode = "trace"\ntrace = "{out}"')
    replay = replay.replace("deadline_s = 0.1\n", "").replace("grace_s = 0.3\n", "")
    rcfg = write(tmp_path, "r.toml", replay + "[mpi]\ndevice_ranks = [1, 1, 1, 2]\n")
    runs.run(load_config(rcfg), tmp_path / "sim.h5")  # the simulator in this process
    done = edgefed(["run", rcfg, "--out", str(tmp_path / "mpi.h5"), "--quiet"], 3)
    assert done.returncode == 0, done.stderr
    for name in ("sim.h5", "mpi.h5"):
        again = read_run(tmp_path / name)
        assert again["trajectory/x"].tobytes() == log["trajectory/x"].tobytes()
        assert np.array_equal(again["participation/steps"], steps)


@pytest.mark.parametrize("where", [
    "contention = [0.0, 0.9]\n[mpi]\ndevice_ranks = [1, 1, 2, 2]\n",  # per device, cycled: devices 1 and 3
    "[mpi]\ndevice_ranks = [1, 2, 1, 2]\n[device]\ncontention = [0.0, 0.9]\n",  # per board: rank 2's devices
])
def test_contention_costs_steps(tmp_path, where):
    cfg = write(tmp_path, "c.toml", DEADLINE.replace("rounds = 5", "rounds = 4") + where)
    out = tmp_path / "c.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"], 3)
    assert done.returncode == 0, done.stderr
    log = read_run(out)
    steps = log["participation/steps"].astype(float)
    free, loaded = steps[:, [0, 2]].mean(), steps[:, [1, 3]].mean()
    assert loaded < 0.6 * free, (free, loaded)  # a 90 % competitor leaves about 10 % of the core
    cpu = log["participation/cpu_percent"]
    assert np.nanmean(cpu[:, [1, 3]]) < np.nanmean(cpu[:, [0, 2]]) - 20


def test_missing_mpi_names_the_fix(monkeypatch):
    from edgefed.errors import EdgefedError
    from edgefed.runtime.mpi import comm as mpi

    monkeypatch.setenv("PMI_SIZE", "3")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(EdgefedError, match=r"pip install 'edgefed\[mpi\]'"):
        mpi.world()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert mpi.world() is None  # one rank: the simulator, MPI untouched


def test_one_rank_under_mpiexec_is_the_simulator(tmp_path, simulated):
    cfg, sim = simulated
    out = tmp_path / "one.h5"
    done = edgefed(["run", cfg, "--out", str(out), "--quiet"], 1)
    assert done.returncode == 0, done.stderr
    assert "MPI:" not in done.stdout and same_datasets(sim, read_run(out)) == []


SEQUENTIAL = """[model]
kind = "sequential"
layers = [
  {type = "conv2d", out = 6, kernel = 3},
  {type = "groupnorm", groups = 2},
  {type = "relu"},
  {type = "maxpool2d", size = 2},
  {type = "conv1d", out = 4, kernel = 3, padding = "valid"},
  {type = "flatten"},
  {type = "dropout", rate = 0.25},
  {type = "dense", out = 3},
]
"""


@pytest.mark.parametrize("model", ["cnn", "sequential"])
def test_image_models_under_mpi_match_the_simulator(tmp_path, model):
    """MNIST-format files in and McMahan et al.'s CNN, or an arrays file of 3-channel samples and a layer list
    of every kind of operation (a gather in channels-last order, convolutions, groupnorm, pooling, a reshape
    the 1-D convolution reads, dropout's masks from the devices' streams) trained by device ranks under
    deadline-free rounds: the simulator's bytes out."""
    g = np.random.default_rng(9)
    if model == "cnn":
        from test_images import write_idx
        write_idx(tmp_path, "t10k", g.integers(0, 256, (300, 28, 28)), g.integers(0, 10, 300))
        data = f'[data]\nkind = "mnist"\npath = "{tmp_path}"\nclients = 4\nholdout = 60\n[model]\nkind = "cnn"\n'
    else:
        np.savez(tmp_path / "x.npz", x_train=g.normal(size=(80, 3, 8, 6)).astype(np.float32),
                 y_train=g.integers(0, 3, 80), device_train=np.repeat(np.arange(4), 20))
        data = (f'[data]\nkind = "arrays"\npath = "{tmp_path / "x.npz"}"\npartition = "natural"\n'
                f'normalize = "standard"\n' + SEQUENTIAL.replace('{type = "conv1d"', '{type = "reshape", shape = [6, -1]},\n  {type = "conv1d"'))
    sim, mpi = simulator_then_ranks(tmp_path, 'rounds = 2\n' + data + '[train]\nclients_per_round = 3\n'
                                              'local_steps = 2\nbatch_size = 10\n')
    assert sim["trajectory/x"].shape[1] == (1663370 if model == "cnn" else 379)
    assert same_datasets(sim, mpi) == []
    assert not np.array_equal(sim["trajectory/x"][0], sim["trajectory/x"][-1])


def test_a_deadline_round_that_selects_nobody_under_mpi(tmp_path):
    """Every device departed: the round plans no work, and waiting for no rank must not fail."""
    cfg = write(tmp_path, "e.toml", DEADLINE.replace("clients = 4", "clients = 2").replace("rounds = 5", "rounds = 3")
                + "[[dynamics.depart]]\ndevice = 0\nround = 2\n[[dynamics.depart]]\ndevice = 1\nround = 2\n")
    done = edgefed(["run", cfg, "--out", str(tmp_path / "e.h5"), "--quiet"], 3)
    assert done.returncode == 0, done.stderr
    assert read_run(tmp_path / "e.h5")["participation/selected"][1:].sum() == 0


RULES = SMALL + """algorithm = "{algorithm}"
[participation]
mode = "trace"
trace = {trace}
scheme = "{scheme}"
"""


def test_scaffold_with_named_traces_under_mpiexec_writes_the_simulators_bytes(tmp_path):
    """(Every rule and algorithm over the loopback world: tests/test_rules.py.)"""
    logs = simulator_then_ranks(tmp_path, RULES.format(algorithm="scaffold", trace='["cpu30", "cpu90", "bw-low"]',
                                                       scheme="drop"))
    assert same_datasets(*logs) == []
    assert (logs[0]["participation/steps"] < 10).any() and logs[0]["participation/coeff"].any()


COMPRESSED = SMALL.replace("[train]\n", '[train]\nalgorithm = "scaffold"\n') + """[participation]
mode = "trace"
trace = "builtin"
[compress]
uplink = "{uplink}"
downlink = "{downlink}"
topk_fraction = 0.05
"""


def test_a_compressed_run_under_mpiexec_writes_the_simulators_bytes(tmp_path):
    """(int8 up, top-k down, and resumes, over the loopback world: tests/test_compressed_runs.py.)"""
    logs = simulator_then_ranks(tmp_path, COMPRESSED.format(uplink="topk", downlink="fp16"))
    assert same_datasets(*logs) == []
    worked = logs[0]["participation/steps"] > 0
    assert (logs[1]["participation/bytes_up"][worked] < 610 * 4).all() and logs[1]["state/residual_delta_c"].any()


SECURE = RULES.format(algorithm="fedavg", trace='"builtin"', scheme="fednova") + """[dynamics]
fast_reboot = true
[[dynamics.arrive]]
device = 2
round = 3
[secagg]
enabled = true
neighbours = 2
threshold = 2
key_source = "seeded"
"""


def test_secure_aggregation_under_mpiexec_writes_the_simulators_bytes(tmp_path):
    logs = simulator_then_ranks(tmp_path, SECURE)
    assert same_datasets(*logs) == []
    assert logs[1]["participation/secagg_bytes"][logs[1]["participation/selected"]].min() > 0


def test_submodels_under_mpiexec_write_the_simulators_bytes(tmp_path):
    """FjORD's widths by device and each width's step draws on the ranks, under secure aggregation (slices
    masked alone, the widths on the SECAGG command): the simulator's bytes."""
    logs = simulator_then_ranks(tmp_path, SMALL + """[model]
kind = "mlp"
hidden = [8, 8]
[secagg]
enabled = true
key_source = "seeded"
[submodel]
method = "fjord"
assign = [0.25, 1.0, 0.5, 1.0, 0.5, 0.25, 1.0]
""")
    assert same_datasets(*logs) == []
    widths = logs[1]["participation/width"][logs[1]["participation/selected"]]
    assert set(widths.tolist()) == {0.25, 0.5, 1.0}


LATE = """rounds = 2
[data]
clients = 5
samples = "pareto"
[train]
clients_per_round = "all"
local_steps = 10
[participation]
mode = "deadline"
deadline_s = 0.1
grace_s = 0.2
[[fault]]
device = 2
round = 1
kind = "stall"
seconds = 1.0
[mpi]
device_ranks = [1, 1, 2, 1, 1]
"""


def test_a_secure_deadline_run_under_mpiexec_recovers_its_late_device(tmp_path):
    """Device 2 hangs in round 1 past its deadline and its rank is still busy with it when round 2 starts
    (new keys for it while its old round's work goes on): a dropout both rounds, its masks removed with the 4
    survivors' shares; the model is the plain run's up to the fixed-point rounding."""
    logs = []
    for name, extra in (("plain", ""), ("secure", '[secagg]\nenabled = true\n')):
        cfg = write(tmp_path, f"{name}.toml", LATE + extra)
        done = edgefed(["run", cfg, "--out", str(tmp_path / f"{name}.h5"), "--quiet"], 3)
        assert done.returncode == 0, done.stderr
        logs.append(read_run(tmp_path / f"{name}.h5"))
    plain, secure = logs
    assert secure["participation/late"][:, 2].tolist() == [True, True]
    assert not secure["metrics/secagg_aborted"].any()
    np.testing.assert_array_equal(plain["participation/late"], secure["participation/late"])
    np.testing.assert_array_equal(plain["participation/steps"], secure["participation/steps"])
    assert np.abs(plain["trajectory/x"] - secure["trajectory/x"]).max() < 1e-6
    assert secure["attrs"]["secagg_key_source"] == "os"


ASYNC = """rounds = 12
[data]
clients = 8
[train]
local_steps = 10
clients_per_round = "all"
[participation]
mode = "async"
[async]
concurrency = 4
buffer = 2
max_staleness = 4
"""


def test_async_under_mpiexec_replays_in_the_simulator_bit_for_bit(tmp_path):
    """FedBuff on real ranks (measured clock, reports in arrival order), then its log replayed in the
    simulator on a profile: the recorded order, staleness and clock, the same trajectory; with Oort drawing
    the tasks' devices from the speeds and losses measured (a superset of the uniform draw's path), its rows
    too."""
    cfg = write(tmp_path, "a.toml", ASYNC + '[selection]\npolicy = "oort"\n')
    done = edgefed(["run", cfg, "--out", str(tmp_path / "mpi.h5"), "--quiet"], 3)
    assert done.returncode == 0, done.stderr
    replay = ["run", cfg, "--set", f'participation.trace="{tmp_path / "mpi.h5"}"', "--out", str(tmp_path / "r.h5"),
              "--quiet"]
    done = edgefed(replay)
    assert done.returncode == 0, done.stderr
    mpi, again = read_run(tmp_path / "mpi.h5"), read_run(tmp_path / "r.h5")
    assert mpi["attrs"]["clock"] == "measured" and again["attrs"]["clock"] == "replayed"
    names = ["trajectory/x", "participation/staleness", "participation/coeff", "participation/steps",
             "participation/selected", "metrics/test_accuracy", "metrics/clock_s"]
    names += ["participation/candidate", "participation/utility"]
    assert mpi["participation/candidate"].any() and np.isfinite(mpi["state/oort_reward"]).any()
    for name in names:
        assert mpi[name].tobytes() == again[name].tobytes(), name
    resumed = edgefed(["run", cfg, "--resume", str(tmp_path / "mpi.h5")], 3)
    assert resumed.returncode == 0 and "already complete" in resumed.stdout
