"""The compact arrays file (`edgefed data convert`, and what a LEAF folder is read through): every format edgefed
reads gives the same run bits from it as from the source, in the smallest exact types, chunked by rows; a LEAF
folder is converted once into a cache its runs share; bad sources are one line and write nothing."""

import json
import os

import h5py
import numpy as np
import pytest

from conftest import config_with
from edgefed.cli import main
from edgefed.config import to_toml
from edgefed.errors import EdgefedError
from edgefed.orchestration import run as runs
from edgefed.problems.compact import CHUNK_BYTES
from edgefed.problems.convert import convert
from edgefed.problems.leaf import cache_places, cached
from edgefed.runlog import read_run
from golden import write_shakespeare
from helpers import assert_same_logs
from test_datasets import write_cifar
from test_images import write_idx

SMALL = {"rounds": 2, "train.clients_per_round": 2, "train.local_steps": 2, "train.batch_size": 4}
CHAR = {"model.kind": "sequential", "model.layers": [{"type": "embedding", "num": 80, "dim": 3},
                                                     {"type": "lstm", "hidden": 4}, {"type": "dense", "out": 80}]}


def same_run(tmp_path, source: dict, converted, **extra):
    """A run on the source and on its converted file (kind = "arrays"): their logs, compared byte for byte."""
    a, b = tmp_path / "source.h5", tmp_path / "converted.h5"
    a.unlink(missing_ok=True)
    b.unlink(missing_ok=True)
    runs.run(config_with({**SMALL, **source, **extra}), a)
    runs.run(config_with({**SMALL, "data.kind": "arrays", "data.path": str(converted), **extra}), b)
    assert_same_logs(read_run(a), read_run(b))
    return read_run(b)


def leaf(folder, users: dict, test: dict | None = None):
    """A LEAF folder from {user: (x, y)} (and test/ from test)."""
    for part, content in (("train", users), ("test", test)):
        if content is None:
            continue
        (folder / part).mkdir(parents=True, exist_ok=True)
        data = {"users": list(content), "num_samples": [len(x) for x, _ in content.values()],
                "user_data": {u: {"x": x, "y": y} for u, (x, y) in content.items()}}
        (folder / part / "data.json").write_text(json.dumps(data))
    return folder


def test_shakespeare_converts_to_uint8_rows_with_its_devices_and_runs_the_same_bits(tmp_path):
    folder = tmp_path / "plays"
    write_shakespeare(folder, users=4, samples=6)
    out = tmp_path / "plays.h5"
    assert main(["data", "convert", str(folder), str(out)]) == 0
    with h5py.File(out) as f:
        assert f["x_train"].dtype == np.uint8 and f["x_train"].shape == (24, 80) and f["y_train"].dtype == np.uint8
        assert f["x_train"].chunks[0] == CHUNK_BYTES // 80  # chunked by rows: a rank reads its devices' chunks
        assert f["device_rows_train"][()].tolist() == [[6 * k, 6 * k + 6] for k in range(4)]
        assert [u.decode() for u in f["users"][()]] == [f"PLAY_ROLE_{k}" for k in range(4)]
        assert f.attrs["text_task"] == "shakespeare" and f.attrs["token_ids"] == 80 and f.attrs["partition"] == "natural"
    log = same_run(tmp_path, {"data.kind": "leaf", "data.path": str(folder)}, out, **CHAR)
    assert log["attrs"]["model"] == "sequential"


def test_sent140_keeps_its_vocabulary_and_femnist_numbers_are_stored_exactly(tmp_path):
    tweet = lambda text: ["1", "Mon", "NO_QUERY", "u", text]  # noqa: E731
    folder = leaf(tmp_path / "sent", {"a": ([tweet("good day"), tweet("bad day bad")], [1, 0]),
                                      "b": ([tweet("good good"), tweet("day?")], [1, "0"])},
                  {"a": ([tweet("good night")], [1]), "b": ([tweet("bad")], [0])})
    out = tmp_path / "sent.h5"
    convert(folder, out, vocab_size=2)
    with h5py.File(out) as f:  # by count: day 3, good 3 (ties in code-point order), bad 2; ids from 2
        assert [w.decode() for w in f["vocabulary"][()]] == ["day", "good"] and f.attrs["token_ids"] == 4
        assert f["x_train"][0, :3].tolist() == [3, 2, 0] and f["x_test"][0, :2].tolist() == [3, 1]
    layers = {"model.kind": "sequential", "model.layers": [{"type": "embedding", "num": 4, "dim": 2},
                                                           {"type": "gru", "hidden": 3}, {"type": "dense", "out": 2}]}
    same_run(tmp_path, {"data.kind": "leaf", "data.path": str(folder), "data.vocab_size": 2}, out, **layers)
    # numbers: k/255 pixels as uint8 (x_scale), widened when a later user's are not (values kept to the bit)
    pixels = lambda k: [[(i * k % 256) / 255 for i in range(6)] for _ in range(3)]  # noqa: E731
    folder = leaf(tmp_path / "fem", {"a": (pixels(7), [0, 1, 2]), "b": (pixels(11), [2, 1, 0])})
    convert(folder, tmp_path / "fem.h5")
    with h5py.File(tmp_path / "fem.h5") as f:
        assert f["x_train"].dtype == np.uint8 and f.attrs["x_scale"] == 255
    leaf(folder, {"a": (pixels(7), [0, 1, 2]), "b": ([[0.1] * 6] * 3, [2, 1, 0])})
    convert(folder, tmp_path / "fem.h5")
    with h5py.File(tmp_path / "fem.h5") as f:
        assert f["x_train"].dtype == np.float64 and "x_scale" not in f.attrs
        assert f["x_train"][:3].tolist() == pixels(7) and f["x_train"][3].tolist() == [0.1] * 6
    same_run(tmp_path, {"data.kind": "leaf", "data.path": str(folder)}, tmp_path / "fem.h5",
             **{"model.kind": "logreg", "train.clients_per_round": 1})


def test_numbers_are_stored_in_the_narrowest_kind_that_holds_every_block(tmp_path):
    """uint8, k/255 as uint8, float32 and float64 do not hold one another: a block that the kind stored so far
    cannot take moves every row to one that holds both (to the bit)."""
    from edgefed.problems.compact import CompactWriter

    for blocks, kind, scale in (([[0, 1, 1]], [[7 / 255, 0, 1]]), "uint8", 255.0), \
                               (([[2, 3, 4]], [[0.5, 0.25, 1]]), "float32", None), \
                               (([[2, 3, 4]], [[7 / 255, 0, 1]]), "float64", None), \
                               (([[0.5, 0.25, 1]], [[7 / 255, 1, 0]]), "float64", None):
        writer = CompactWriter(tmp_path / f"{kind}.h5", (3,))
        for block in blocks:
            writer.add("train", np.array(block, np.float64), np.zeros(1, np.int64))
        writer.finish({})
        with h5py.File(writer.path) as f:
            x, got = f["x_train"][()], f.attrs.get("x_scale")
        assert (x.dtype.name, got) == (kind, scale)
        values = x.astype(np.float64) / (scale or 1)
        assert values.tobytes() == np.array(blocks, np.float64).reshape(-1, 3).tobytes()


@pytest.mark.parametrize("kind", ["npz", "cifar10", "cifar100", "mnist"])
def test_arrays_cifar_and_idx_files_convert_to_the_same_bits(tmp_path, kind):
    g = np.random.default_rng(3)
    if kind == "npz":
        source = tmp_path / "a.npz"
        np.savez(source, x_train=g.integers(0, 300, (40, 5)), y_train=g.integers(0, 3, 40),
                 device_train=np.repeat([4, 1, 7, 2], 10))
        config = {"data.kind": "arrays", "data.path": str(source), "data.partition": "natural",
                  "data.normalize": "standard", "model.kind": "logreg"}
    elif kind.startswith("cifar"):
        source = write_cifar(tmp_path / "c", kind, n=10)
        config = {"data.kind": kind, "data.path": str(source), "data.clients": 4, "model.kind": "logreg",
                  "data.split": "coarse" if kind == "cifar100" else None}
    else:
        source = tmp_path / "idx"
        source.mkdir()
        write_idx(source, "t10k", g.integers(0, 256, (60, 4, 4)), g.integers(0, 10, 60))
        config = {"data.kind": "mnist", "data.path": str(source), "data.clients": 4, "data.holdout": 12,
                  "model.kind": "logreg"}
    out = tmp_path / "out.h5"
    convert(source, out, split=config.get("data.split"), holdout=config.get("data.holdout", 2000))
    with h5py.File(out) as f:
        assert f["x_train"].dtype == (np.uint16 if kind == "npz" else np.uint8)
        if kind == "npz":  # each device's rows are one run: stored as ranges, in the order of the ids
            assert f["device_rows_train"][()].tolist() == [[10, 20], [30, 40], [0, 10], [20, 30]]
    extra = {k: v for k, v in config.items() if k in ("data.partition", "data.normalize", "data.clients", "model.kind")}
    same_run(tmp_path, config, out, **extra)


def test_a_leaf_folder_is_converted_once_and_again_when_it_changes(tmp_path, capsys):
    folder = tmp_path / "plays"
    write_shakespeare(folder, users=3, samples=4)
    path, said = cached(folder, 10_000, None)
    assert path == cache_places(folder, path.stem[len("leaf-"):])[0] and path.parent == folder / ".edgefed"
    assert said.startswith(f"LEAF folder {folder}: converted once (")
    assert cached(folder, 10_000, None) == (path, None)  # read, not converted again
    other = tmp_path / "other"
    write_shakespeare(other, users=2, samples=3)
    with pytest.raises(EdgefedError, match="has no converted copy on this machine"):  # a device rank never converts
        cached(other, 10_000, None, convert=False)
    assert not (other / ".edgefed").exists()
    data = folder / "train" / "all_data_train.json"
    data.write_text(data.read_text())
    os.utime(data, ns=(1, 1))  # the files changed: a new copy, the old one gone
    again, said = cached(folder, 10_000, None)
    assert again != path and said and not path.exists() and again.exists()


@pytest.mark.parametrize("case, message", [
    ("cut", "cannot be read as LEAF JSON"),
    ("no user_data", "user 'b' has no \"x\" and \"y\" in user_data"),
    ("negative label", "user 'a': label 1 is -1; a label is a class, an integer from 0"),
    ("exists", "already exists; use --force"),
    ("own source", "is the dataset, which this command reads"),
    ("not a dataset", "is not a dataset folder edgefed reads"),
])
def test_bad_sources_are_one_line_and_write_nothing(tmp_path, capsys, case, message):
    folder = leaf(tmp_path / "leaf", {"a": ([[1.0, 2.0]] * 2, [0, 1]), "b": ([[3.0, 4.0]] * 2, [1, 0])})
    data = folder / "train" / "data.json"
    out = tmp_path / "out.h5"
    source = folder
    if case == "cut":
        data.write_text(data.read_text()[:60])
    elif case == "no user_data":
        raw = json.loads(data.read_text())
        del raw["user_data"]["b"]
        data.write_text(json.dumps(raw))
    elif case == "negative label":
        leaf(folder, {"a": ([[1.0, 2.0]] * 2, [0, -1])})
    elif case == "exists":
        out.write_text("mine")
    elif case == "own source":
        source = out = tmp_path / "a.npz"
        np.savez(source, x_train=np.zeros((4, 2)), y_train=np.zeros(4, int))
    elif case == "not a dataset":
        source = tmp_path / "empty"
        source.mkdir()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code = main(["data", "convert", str(source), str(out)] + (["--force"] if case == "own source" else []))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_device_ranks_read_their_shards_to_the_simulators_bytes_and_refuse_stale_ones(tmp_path):
    """Three ranks over the loopback world (tests/loopback_mpi.py), each device rank reading its shard of a
    LEAF folder's converted copy (a shard holds only its devices' rows: four ranks find them missing); a shard
    of another placement is one line naming the fix."""
    from loopback_mpi import World
    from edgefed.orchestration import ranks
    from edgefed.orchestration.datasets import make_shards

    folder = tmp_path / "plays"
    write_shakespeare(folder, users=5, samples=4)
    config = {**SMALL, "data.kind": "leaf", "data.path": str(folder), **CHAR, "data.shards": str(tmp_path / "s")}
    cfg = config_with(config)
    runs.run(cfg, tmp_path / "sim.h5")
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    made = make_shards(str(tmp_path / "c.toml"), [], 3, str(tmp_path / "s"), False)
    assert [(rank, path.name) for rank, path, _ in made] == [(1, "rank-1.h5"), (2, "rank-2.h5")]
    with h5py.File(tmp_path / "s" / "rank-2.h5") as f:  # devices 1 and 3: their rows only, every label
        assert f["rows_train"][()].tolist() == [4, 5, 6, 7, 12, 13, 14, 15] and f["y_train"].shape == (20,)

    def world(size, path):
        errors = []
        mains = {0: lambda comm: ranks.run_coordinator(comm, lambda: (cfg, None, path), False, None,
                                                       lambda line: None, errors.append)}
        mains.update({r: ranks.run_device_rank for r in range(1, size)})
        World(size).run(mains)
        return errors

    assert world(3, tmp_path / "mpi.h5") == []
    assert_same_logs(read_run(tmp_path / "sim.h5"), read_run(tmp_path / "mpi.h5"))
    assert world(4, tmp_path / "four.h5") == ["rank 1: the shard " + str(tmp_path / "s" / "rank-1.h5") + " lacks "
                                              "device 3's rows, which this world places on its rank (the boards' "
                                              "placement or the partition changed since: a board left out?); make "
                                              "the boards' shards "
                                              "again: launch/pi-cluster.sh data BOARDS CONFIG; rank 2: the shard "
                                              + str(tmp_path / "s" / "rank-2.h5") + " lacks device 4's rows, which "
                                              "this world places on its rank (the boards' placement or the partition "
                                              "changed since: a board left out?); make the boards' shards again: "
                                              "launch/pi-cluster.sh data "
                                              "BOARDS CONFIG; rank 3: config: data.shards: this board has no shard "
                                              + str(tmp_path / "s" / "rank-3.h5") + " of " + str(folder)
                                              + "; make and copy the boards' shards with launch/pi-cluster.sh data "
                                              "BOARDS CONFIG"]
    assert not (tmp_path / "four.h5").exists()
    other = tmp_path / "other"  # shards of other data at the config's shards path
    write_shakespeare(other, users=5, samples=5)
    (tmp_path / "o.toml").write_text(to_toml(config_with({**config, "data.path": str(other)})))
    make_shards(str(tmp_path / "o.toml"), [], 3, str(tmp_path / "s"), True)
    errors = world(3, tmp_path / "stale.h5")
    assert len(errors) == 1 and errors[0].count("was made from other data than the coordinator's data.path") == 2
