"""What a new user types never costs a file or shows a traceback: every verb's outputs follow one rule
(--force, never a folder, never the command's own input), a model too large for memory is refused at its
layer before anything is allocated, malformed files are one line, a sweep plans every run before the first,
a failure of any kind in start-up leaves no stub, and a run whose updates were all non-finite says so.
Each case: exit code, the one line, and every file as it was (checksums)."""

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.cli import main
from edgefed.orchestration import run as runs
from edgefed.models import minibatch_rows
from edgefed.orchestration import budget
from edgefed.runlog import read_run

from helpers import run_until

TINY = ["rounds=2", "data.clients=4", "train.clients_per_round=2", "train.local_steps=2"]


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def digest(folder) -> dict:
    """Every file under folder and its checksum: what a refused command must leave as it was."""
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def one_line(capsys, code: int, args, expected: int = 2) -> str:
    out, err = capsys.readouterr()
    assert code == expected and err.count("\n") == 1 and "Traceback" not in err, (args, out, err)
    return err


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    for name in ("a", "b"):
        runs.run(config_mod.load_config(None, TINY), folder / f"{name}.h5")
    g = np.random.default_rng(0)
    np.savez(folder / "data.npz", x_train=g.normal(size=(40, 5)).astype(np.float32), y_train=g.integers(0, 3, 40))
    (folder / "run.toml").write_text("rounds = 2\n")
    (folder / "data.toml").write_text(f'[data]\nkind = "arrays"\npath = "{folder / "data.npz"}"\n[model]\nkind = "logreg"\n')
    return folder


# -- data loss: one rule for every file a verb writes ------------------------------------------------------------
WRITERS = {  # verb -> (args with OUT for its output, the file it reads that OUT may name)
    "export --weights": (["export", "{a}", "--weights", "{out}"], "{a}"),
    "export --csv": (["export", "{a}", "--csv", "{out}"], None),
    "report": (["report", "{a}", "--out", "{out}"], "{a}"),
    "run": (["run", "{toml}", *sets(TINY), "--out", "{out}", "--quiet"], "{toml}"),
    "run data": (["run", *sets(TINY), "--set", 'data.kind="arrays"', "--set", 'data.path="{data}"',
                  "--set", 'model.kind="logreg"', "--out", "{out}", "--quiet"], "{data}"),
    "trace record": (["trace", "record", "--names", "a", "--rounds", "1", "--local-steps", "2", "--deadline-s",
                      "1", "--out", "{out}", "--quiet"], None),
    "profile": (["profile", "--config", "{toml}", "--no-cold", "--out", "{out}"], "{toml}"),
    "profile data": (["profile", "--config", "{datatoml}", "--models", "logreg", "--no-cold", "--out", "{out}"],
                     "{data}"),
}


@pytest.mark.parametrize("verb", sorted(WRITERS))
def test_no_verb_replaces_a_file_without_force_nor_its_own_input_with_it(logs, tmp_path, capsys, verb):
    args, own = WRITERS[verb]
    names = {"a": logs / "a.h5", "toml": logs / "run.toml", "data": logs / "data.npz", "datatoml": logs / "data.toml"}
    before = digest(logs)

    def call(out, *more):
        given = [a.format(out=out, **names) for a in args] + list(more)
        return main(given), given

    for out, message in [(logs / "b.h5", "already exists; use "),
                         (logs, "is a folder" if verb != "export --csv" else "already exists; use ")]:
        if verb == "export --csv":  # a folder is its output: the files it would write in it count
            (tmp_path / "csv").mkdir()
            (tmp_path / "csv" / "metrics.csv").write_text("mine\n")
            out = tmp_path / "csv"
        code, given = call(out)
        err = one_line(capsys, code, given)
        assert message in err and ("--force to replace it" in err or message == "is a folder")
        if verb == "export --csv":
            assert (tmp_path / "csv" / "metrics.csv").read_text() == "mine\n"
            break
    if verb != "export --csv":  # a path ending in "/" names a folder: not written as a file of that name
        code, given = call(f"{tmp_path / 'new'}/")
        assert "ends in '/', which names a folder; give a file to write" in one_line(capsys, code, given)
        assert not (tmp_path / "new").exists()
    if own is not None:
        code, given = call(own.format(**names), "--force")
        assert "which this command reads; it is never written over, even with --force" in one_line(capsys, code, given)
    assert digest(logs) == before


def test_outputs_inside_a_data_folder_a_foreign_table_and_one_path_for_two_outputs_write_nothing(logs, tmp_path,
                                                                                                 capsys):
    leaf = tmp_path / "leaf"
    _leaf(leaf, {"x": [[0.0, 1.0, 2.0]] * 2, "y": [0, 1]})
    before = digest(tmp_path)
    cases = [(["run", *sets(TINY + ['data.kind="leaf"', f'data.path="{leaf}"', "data.clients=2"]), "--out",
               str(leaf / "train" / "a.json"), "--force", "--quiet"], f"is in {leaf}, the data.path folder, which this "
                                                                       "command reads"),
             (["export", str(logs / "a.h5"), "--weights", str(tmp_path / "x"), "--csv", str(tmp_path / "x")],
              "--weights and --csv both name"),
             (["export", str(logs / "a.h5"), "--weights", str(tmp_path / "w.npz"), "--csv", "/proc/csv"],
              "/proc is not a writable folder; choose another --csv"),
             (["trace", "record", "--names", "a", "--rounds", "1", "--local-steps", "1", "--out", "/proc/t.csv"],
              "/proc is not a writable folder")]
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "summary.csv").write_text("mine\n")
    (tmp_path / "sweep.toml").write_text('[set]\nrounds = 1\n')
    cases.append((["sweep", str(tmp_path / "sweep.toml"), "--out", str(tmp_path / "sweep")],
                  "summary.csv is there and is not a sweep's table; it is never replaced"))
    before = digest(tmp_path)
    for args, message in cases:
        assert message in one_line(capsys, main(args), args)
    assert digest(tmp_path) == before and not (tmp_path / "w.npz").exists()


def test_export_of_a_folder_or_its_own_log_writes_nothing_and_force_replaces_another_file(logs, tmp_path, capsys):
    target = tmp_path / "other.h5"
    target.write_bytes((logs / "b.h5").read_bytes())
    assert main(["export", str(logs / "a.h5"), "--weights", str(target), "--force"]) == 0
    assert set(np.load(target)) == {"1.weight", "1.bias"}  # replaced by the weights, as asked


# -- memory: refused at the layer, before anything is allocated ------------------------------------------------
@pytest.mark.parametrize("layers,where", [
    ('[{type = "conv2d", out = 4, kernel = 100000}, {type = "flatten"}, {type = "dense", out = 10}]',
     "model.layers[0] (conv2d) makes the model need at least"),
    ('[{type = "flatten"}, {type = "dense", out = 1000000000}, {type = "dense", out = 10}]',
     "model.layers[1] (dense) makes the model need at least"),
    ('[{type = "conv2d", out = 4, kernel = 3, padding = 100000}, {type = "flatten"}, {type = "dense", out = 10}]',
     "model.layers[0] (conv2d) makes the model need at least"),
])
def test_a_model_that_cannot_fit_is_refused_at_its_layer_before_anything_is_allocated(tmp_path, capsys, layers,
                                                                                      where):
    """Each would allocate 150 GB or more (parameters, activations or the plan's own layout); the refusal
    comes from the plan (it names the layer), not from a failed allocation, and leaves no log."""
    args = ["run", "examples/digits-cnn.toml", *sets(TINY), "--set", f"model.layers={layers}", "--out",
            str(tmp_path / "r.h5"), "--quiet"]
    err = one_line(capsys, main(args), args)
    assert where in err and "of memory" in err and "make the layer smaller" in err
    assert list(tmp_path.iterdir()) == []


def test_the_runs_estimate_counts_the_models_lanes_and_a_rounds_vectors(monkeypatch):
    """A model that fits once but not once per lane plus a round's reports: refused in one line naming the
    model's buffers, before the lanes are built."""
    from edgefed.errors import ResourceError

    cfg = config_mod.load_config("examples/digits-cnn.toml", TINY + ["mpi.threads_per_rank=2"])
    problem, model = runs.problem_and_model(cfg)
    extra = budget.model_bytes(cfg, runs.build_algorithm(cfg), problem, model, 2)
    one = model.memory_bytes(minibatch_rows(cfg.train.batch_size, problem.n_train.max()))
    assert model.memory_bytes() == one  # (built for the run's minibatches)
    assert extra >= 2 * one + (2 + 4) * model.n_trainable * 4  # two lanes, two reports and the server's vectors
    runtime = budget.psutil.Process().memory_info().rss + budget.KERNEL_BYTES
    monkeypatch.setattr(budget, "memory_limit", lambda: (runtime + extra // 2, "the memory available"))
    with pytest.raises(ResourceError, match="the model's buffers .* use a smaller model"):
        budget.check_device_memory(runs.build_algorithm(cfg), cfg, problem, model, Path("r.h5"), lambda _: None)


# -- malformed files: one line, whatever their structure ---------------------------------------------------------
def _group_in_place(path, key):
    g = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for name, value in (("x_train", g.normal(size=(40, 5))), ("y_train", g.integers(0, 3, 40)),
                            ("x_test", g.normal(size=(8, 5))), ("y_test", g.integers(0, 3, 8))):
            if name == key:
                f.create_group(name)
            else:
                f[name] = value


def _leaf(folder, second_user):
    for part in ("train", "test"):
        (folder / part).mkdir(parents=True)
    users = {"u1": {"x": [[0.0, 1.0, 2.0]] * 4, "y": [0, 1, 0, 1]}, "u2": second_user}
    (folder / "train" / "a.json").write_text(json.dumps({"users": list(users), "num_samples": [4, 2],
                                                         "user_data": users}))
    (folder / "test" / "a.json").write_text(json.dumps({"users": [], "num_samples": [], "user_data": {}}))


@pytest.mark.parametrize("case,message", [
    ("x_train group", "x_train is a group, not a dataset; store x_train as one array"),
    ("y_train group", "y_train is a group, not a dataset"),
    ("x_test group", "x_test is a group, not a dataset"),
    ("leaf ragged", "user 'u2': sample 1 has shape (2,) but the user's other samples have (3,); give every sample one "
                    "shape"),
    ("leaf words", "user 'u2': sample 0 (\"['a', 'b', 'c']\") is not numbers of one shape like the user's other "
                   "samples; LEAF samples are numbers"),
    ("text .npz", "is not an .npz file (a zip of arrays, as numpy.savez writes it): it starts with b'x_train,y"),
])
def test_a_malformed_data_file_is_one_line_and_leaves_no_log(tmp_path, capsys, case, message):
    if case.endswith("group"):
        path = tmp_path / "data.h5"
        _group_in_place(path, case.split()[0])
        data = ['data.kind="arrays"', f'data.path="{path}"']
    elif case.startswith("leaf"):
        path = tmp_path / "leaf"
        second = ({"x": [[0.0, 1.0, 2.0], [0.0, 1.0]], "y": [0, 1]} if case == "leaf ragged"
                  else {"x": [["a", "b", "c"], [0.0, 1.0, 2.0]], "y": [0, 1]})
        _leaf(path, second)
        data = ['data.kind="leaf"', f'data.path="{path}"', "data.clients=2"]
    else:
        path = tmp_path / "data.npz"
        path.write_text("x_train,y_train\n1,2\n")
        data = ['data.kind="arrays"', f'data.path="{path}"']
    before = digest(tmp_path)
    args = ["run", *sets(TINY + data + ['model.kind="logreg"']), "--out", str(tmp_path / "r.h5"), "--quiet"]
    assert message in one_line(capsys, main(args), args)
    assert digest(tmp_path) == before


@pytest.mark.parametrize("dataset", ["metrics/test_accuracy", "trajectory/x", "state/round"])
def test_a_log_with_a_group_where_a_dataset_belongs_is_one_line_for_every_reader(logs, tmp_path, capsys, dataset):
    """Checked where every reader opens a log (runlog.reading), whether or not the reader needs that dataset."""
    path = tmp_path / "grp.h5"
    path.write_bytes((logs / "a.h5").read_bytes())
    with h5py.File(path, "r+") as f:
        del f[dataset]
        f.create_group(dataset)
    before = path.read_bytes()
    replay = [*sets(TINY), "--set", 'participation.mode="trace"', "--set", f'participation.trace="{path}"']
    for args in (["run", "--resume", str(path), "--quiet"], ["summary", str(path)],
                 ["export", str(path), "--weights", str(tmp_path / "w.npz")],
                 ["run", *replay, "--out", str(tmp_path / "r.h5"), "--quiet"]):
        assert f"has a group, not a dataset, at {dataset}" in one_line(capsys, main(args), args)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["grp.h5"]


def test_a_resume_on_changed_data_is_refused_before_it_trains_on_other_samples(tmp_path):
    """The log's per-device sample counts are the data's fingerprint: a file grown by four samples (or a
    partition drawn otherwise, as a Dirichlet one redrawn under a new min_partition_size) is one line."""
    from edgefed.errors import RunLogError

    g = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=g.normal(size=(60, 5)), y_train=g.integers(0, 3, 60))
    cfg = config_mod.load_config(None, TINY + ['data.kind="arrays"', f'data.path="{tmp_path / "d.npz"}"',
                                             'model.kind="logreg"'])
    point = run_until(cfg, tmp_path / "r.h5", 1)
    np.savez(tmp_path / "d.npz", x_train=g.normal(size=(64, 5)), y_train=g.integers(0, 3, 64))
    before = (tmp_path / "r.h5").read_bytes()
    with pytest.raises(RunLogError, match="device 0 trained on 13 samples in the log's run but its data now gives it "
                                          "14: the data file or its partition changed"):
        runs.run(cfg, tmp_path / "r.h5", resume_point=point)
    assert (tmp_path / "r.h5").read_bytes() == before


def test_leaf_users_without_samples_are_skipped_and_counted_in_the_first_line(tmp_path, capsys):
    folder = tmp_path / "leaf"
    _leaf(folder, {"x": [], "y": []})
    main(["run", *sets(TINY + ['data.kind="leaf"', f'data.path="{folder}"', "data.clients=1",
                               "train.clients_per_round=1", 'model.kind="logreg"']), "--out", str(tmp_path / "r.h5"),
          "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"LEAF folder {folder}: converted once (") and ", which runs read until its " in lines[0]
    assert lines[1].startswith("LEAF leaf, 2 users, 1 without samples skipped (natural): 1 devices")


# -- a sweep plans every run before the first --------------------------------------------------------------------
DIGITS = Path(__file__).resolve().parents[1] / "examples" / "data" / "digits.npz"


@pytest.mark.parametrize("axis,cell,reason", [
    ('"model.layers" = [[{type = "flatten"}, {type = "dense", out = 10}], '
     '[{type = "flatten"}, {type = "dense", out = 7}]]',
     "cell 'layers=[{type = \"flatten\"}, {type = \"dense\", out = 7}]', seed 0 cannot run",
     "model.layers ends with 7 outputs but the data has 10 classes"),
    (f'"data.path" = ["{DIGITS}", "NAN"]', "nan.npz', seed 0 cannot run", "x_train row 5 holds NaN or infinity"),
])
def test_a_sweep_with_a_cell_that_cannot_run_writes_nothing(tmp_path, capsys, axis, cell, reason):
    digits = np.load(DIGITS)
    x = digits["x_train"].copy()
    x[5, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x_train=x, y_train=digits["y_train"], x_test=digits["x_test"],
             y_test=digits["y_test"])
    (tmp_path / "base.toml").write_text(
        f'rounds = 1\n[data]\nkind = "arrays"\npath = "{DIGITS}"\nclients = 4\n[model]\nkind = "sequential"\n'
        'layers = [{type = "flatten"}, {type = "dense", out = 10}]\n[train]\nclients_per_round = 2\nlocal_steps = 2\n')
    (tmp_path / "sweep.toml").write_text(f'base = "base.toml"\n[axes]\n{axis.replace("NAN", str(tmp_path / "nan.npz"))}\n')
    before = digest(tmp_path)
    args = ["sweep", str(tmp_path / "sweep.toml"), "--out", str(tmp_path / "out")]
    err = one_line(capsys, main(args), args)
    assert cell in err and reason in err and "nothing was run or written" in err
    assert digest(tmp_path) == before and not (tmp_path / "out").exists()


# -- start-up: any exception removes the stub -----------------------------------------------------------------
def test_a_bug_in_start_up_is_one_line_leaves_no_stub_and_debug_shows_it(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("an edgefed bug")

    monkeypatch.setattr(runs.LocalTransport, "warmup", broken)
    args = ["run", *sets(TINY), "--out", str(tmp_path / "r.h5"), "--quiet"]
    err = one_line(capsys, main(args), args, expected=1)
    assert err.startswith(f"edgefed: internal error in `edgefed run {' '.join(args[1:3])}") and "RuntimeError: an " \
        "edgefed bug; this is a bug in edgefed, not in your input: run the command again with --debug" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="an edgefed bug"):  # --debug: the exception itself, traceback and all
        main(args + ["--debug"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert main(args) == 0  # the same --out, at once


def test_a_bug_in_the_first_round_removes_the_log_too_but_not_after_it(tmp_path, monkeypatch):
    from edgefed.engine.rounds import RoundEngine

    real = RoundEngine.run

    def broken(self, done):
        raise ValueError("in round 1")

    monkeypatch.setattr(RoundEngine, "run", broken)  # after round 0 was evaluated and logged: not a round yet
    with pytest.raises(ValueError):
        runs.run(config_mod.load_config(None, TINY), tmp_path / "r.h5")
    assert not (tmp_path / "r.h5").exists()
    monkeypatch.setattr(RoundEngine, "run", real)
    point = run_until(config_mod.load_config(None, TINY), tmp_path / "r.h5", 1)  # (Ctrl-C: kept to resume)
    assert point.rounds_done == 1 and (tmp_path / "r.h5").exists()


# -- non-finite updates are said -------------------------------------------------------------------------------------
def test_a_run_whose_updates_are_all_non_finite_says_so_to_the_end(tmp_path, capsys):
    diverged = TINY + ["train.lr_local=1e38", "train.local_steps=20"]
    assert main(["run", *sets(diverged), "--out", str(tmp_path / "r.h5")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all("non-finite 2 dropped  no update" in line for line in out if line.startswith("round ") and
               not line.startswith("round 0"))
    assert ("4 reports dropped as non-finite (NaN or infinity) in 2 rounds; no update was ever applied: the model "
            "is still x_0 (a diverging run wants a smaller train.lr_local") in out[-1]
    assert main(["summary", str(tmp_path / "r.h5")]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert ("non-finite: 4 reports dropped as non-finite (NaN or infinity in the update) in 2 rounds; 2 of 2 rounds "
            "applied no update (the model never moved from x_0)") in summary
    table = summary[summary.index(next(s for s in summary if s.startswith("device "))) + 1:]
    log = read_run(tmp_path / "r.h5")
    assert [int(row.split()[5]) for row in table] == log["participation/nonfinite"].sum(axis=0).tolist()
    point = run_until(config_mod.load_config(None, diverged), tmp_path / "k.h5", 1)  # resumed: the whole run counted
    result = runs.run(config_mod.load_config(None, diverged), tmp_path / "k.h5", resume_point=point)
    assert (result.nonfinite, result.nonfinite_rounds, result.applied_rounds) == (4, 2, 0)


# -- said plainly -------------------------------------------------------------------------------------------------
def _arrays(tmp_path, name, **arrays):
    np.savez(tmp_path / name, **arrays)
    return ['data.kind="arrays"', f'data.path="{tmp_path / name}"', 'model.kind="logreg"']


def test_misleading_messages_say_what_is_wrong(tmp_path, capsys):
    g = np.random.default_rng(0)
    digits = np.load("examples/data/digits.npz")
    y_test = digits["y_test"].copy()
    y_test[3] = 109
    device = np.array([0, 0, 1, 1, 2, 2, 3, 3, 5, 5, 7])  # ids 4 and 6 absent: file id 7 is device 5
    one = ["data.clients=1", "train.clients_per_round=1"]
    cases = [
        (_arrays(tmp_path, "zero.npz", x_train=np.zeros((0, 4), np.float32), y_train=np.zeros(0, int)) + one,
         "zero.npz: x_train holds 0 samples, but a device needs at least 2 each; give more samples"),
        (_arrays(tmp_path, "one.npz", x_train=np.zeros((1, 4), np.float32), y_train=np.zeros(1, int)) + one,
         "one.npz: x_train holds 1 samples, but a device needs at least 2 each; give more samples"),
        (_arrays(tmp_path, "test109.npz", x_train=digits["x_train"], y_train=digits["y_train"],
                 x_test=digits["x_test"], y_test=y_test) + ['model.kind="sequential"',
                                                            'model.layers=[{type="flatten"}, {type="dense", out=10}]'],
         "ends with 10 outputs but the data has 110 classes (the largest label, 109, is y_test's; y_train's run "
         "0..9: fix y_test if it is wrong); give the last layer out = 110"),
        (_arrays(tmp_path, "natural.npz", x_train=g.normal(size=(11, 3)), y_train=np.arange(11) % 2,
                 device_train=device) + ['data.partition="natural"', "data.clients=6"],
         "device 5 (device_train id 7) has 1 training samples (natural partition)"),
        (['model.dtype="float16"'], "model.dtype = 'float16' is not known; choose one of 'float32', 'float64'"),
        (['model.kind="sequential"', 'model.layers=[{type="dense", out=10}'],
         "the value is not valid TOML (Unclosed array"),
        (['model.kind="sequential"', "model.layers=[{out=10}]"], "model.layers[0] has no type; give one"),
    ]
    for overrides, message in cases:
        args = ["run", *sets(TINY + overrides), "--out", str(tmp_path / "r.h5"), "--quiet"]
        assert message in one_line(capsys, main(args), args)
        assert not (tmp_path / "r.h5").exists()
    main(["run", *sets(TINY), "--out", str(tmp_path / "ok.h5"), "--quiet"])
    capsys.readouterr()
    for target in ("1.5", "-3", "nan", "0"):
        args = ["summary", str(tmp_path / "ok.h5"), "--target-accuracy", target]
        assert "is not an accuracy in (0, 1]" in one_line(capsys, main(args), args)
