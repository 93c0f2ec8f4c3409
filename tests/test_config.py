"""Config: the keys of docs/design.md 3.2, overrides, errors that name the key, and the TOML round trip."""

import pytest

from edgefed.config import absolute_paths, config_from_dict, load_config, parse_toml, same_experiment, to_toml
from edgefed.errors import ConfigError


def test_default_is_the_documented_experiment():
    cfg = load_config(None)
    assert (cfg.data.kind, cfg.data.clients, cfg.data.alpha, cfg.data.beta) == ("synthetic", 30, 1.0, 1.0)
    assert (cfg.model.kind, cfg.model.dtype) == ("logreg", "float32")
    assert (cfg.train.clients_per_round, cfg.train.local_steps, cfg.train.batch_size, cfg.rounds) == (10, 20, 20, 100)


def test_file_and_overrides(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text('seed = 3\nrounds = 7\n[data]\nkind = "quadratic"\ndim = 4\n[train]\nlocal_epochs = 2\n'
                    'clients_per_round = 0.5\n')
    cfg = load_config(path, ["train.lr_local=0.01", "model.dtype=float64", "log.every=3"])
    assert (cfg.seed, cfg.rounds, cfg.data.dim, cfg.model.kind, cfg.model.dtype) == (3, 7, 4, "quadratic", "float64")
    assert (cfg.train.local_epochs, cfg.train.local_steps, cfg.train.lr_local) == (2, None, 0.01)
    assert cfg.train.clients_per_round == 0.5 and isinstance(cfg.train.clients_per_round, float)
    assert cfg.log.every == 3


def test_round_trip_through_toml():
    cfg = load_config(None, ["train.clients_per_round=0.25", "train.batch_size=\"full\"", "data.iid=true",
                             "train.lr_local=1e-05"])
    assert config_from_dict(parse_toml(to_toml(cfg))) == cfg


def test_same_experiment_names_the_differing_keys():
    a = load_config(None)
    b = load_config(None, ["train.lr_local=0.1", "seed=4", "log.path=\"elsewhere.h5\""])
    assert same_experiment(a, b) == ["seed", "train.lr_local"]


@pytest.mark.parametrize("override,message", [
    ("train.local_step=3", "unknown key [train] 'local_step'; did you mean 'local_steps'?"),
    ("trian.local_steps=3", "unknown key 'trian'; did you mean 'train'?"),
    ("train.local_steps=\"ten\"", "train.local_steps = 'ten' is a string; expected an integer"),
    ("seed=1.5", "seed = 1.5 is a number; expected an integer"),
    ("train.clients_per_round=31", "train.clients_per_round = 31 exceeds the 30 devices"),
    ("train.clients_per_round=1.5", "train.clients_per_round = 1.5 is a fraction and must lie in (0, 1]"),
    ("train.local_steps=0", "train.local_steps = 0; K must be at least 1"),
    ("train.lr_local=0", "train.lr_local = 0.0 must be positive"),
    ("train.lr_global=-1", "train.lr_global = -1.0 must be positive"),
    ("train.batch_size=0", "train.batch_size = 0 must be positive"),
    ("train.batch_size=\"half\"", "train.batch_size = 'half'; give a positive integer or \"full\""),
    ("data.kind=\"synthetc\"", "data.kind = 'synthetc' is not known; did you mean 'synthetic'?"),
    ("model.kind=\"quadratic\"", "model.kind = 'quadratic' does not fit data.kind = 'synthetic'"),
    ("train.weighting=\"count\"", "train.weighting = 'count' is not known"),
    ("participation.scheme=\"D\"", "participation.scheme = 'D' is not known"),
    ("rounds=0", "rounds = 0 must be positive"),
    ("data=3", "data must be a table"),
    ("train.local_epochs=0", "train.local_epochs = 0 must be positive"),
    ("data.samples=1", "data.samples = 1; a device needs at least 2 samples"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_steps_and_epochs_are_exclusive():
    with pytest.raises(ConfigError, match="local_steps or train.local_epochs, not both"):
        load_config(None, ["train.local_steps=3", "train.local_epochs=1"])


def test_bad_toml_file_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = = 3\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="nope.toml not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        load_config(None, ["train.local_steps"])


def test_every_path_in_a_config_is_relative_to_the_file_that_names_it(tmp_path, monkeypatch):
    """One rule for every key that names a file: the config file's folder (the working folder for --set);
    names that are not paths (a shipped board, the built-in traces) stay names; a path found only in the
    working folder (the old rule for data.path) is refused saying what to write."""
    (tmp_path / "exp" / "data").mkdir(parents=True)
    (tmp_path / "exp" / "data" / "words.txt").write_text("good\n")
    (tmp_path / "exp" / "t.csv").write_text("")
    cfg_file = tmp_path / "exp" / "a.toml"
    cfg_file.write_text('[data]\nkind = "arrays"\npath = "data/d.npz"\n[device]\nprofile = "pi4b"\n'
                        'boards = ["pi5", "b/x.toml"]\n[participation]\nmode = "trace"\ntrace = "t.csv:3"\n'
                        '[log]\npath = "runs/a.h5"\n')
    monkeypatch.chdir(tmp_path)
    raw = parse_toml(cfg_file.read_text())
    absolute_paths(raw, cfg_file.parent, str(cfg_file))
    exp = str((tmp_path / "exp").resolve())
    assert raw["data"]["path"] == f"{exp}/data/d.npz" and raw["log"]["path"] == f"{exp}/runs/a.h5"
    assert raw["device"] == {"profile": "pi4b", "boards": ["pi5", f"{exp}/b/x.toml"]}
    assert raw["participation"]["trace"] == f"{exp}/t.csv:3"
    for trace in ("builtin:5", ["cpu0", "cpu90"]):
        raw = {"participation": {"trace": trace}}
        absolute_paths(raw, cfg_file.parent, str(cfg_file))
        assert raw["participation"]["trace"] == trace
    raw = {"participation": {"trace": ["t.csv#cpu0", "cpu90", "builtin#cpu30"]}}
    absolute_paths(raw, cfg_file.parent, str(cfg_file))
    assert raw["participation"]["trace"] == [f"{exp}/t.csv#cpu0", "cpu90", "builtin#cpu30"]
    cfg = load_config(None, ['data.kind="leaf"', 'data.path="exp"', 'data.vocab="exp/data/words.txt"',
                             'model.kind="sequential"', 'model.layers=[{type = "embedding", num = 9, dim = 2}, '
                             '{type = "flatten"}, {type = "dense", out = 2}]'])  # --set: the working folder
    assert cfg.data.vocab == f"{exp}/data/words.txt"
    (tmp_path / "exp" / "b.toml").write_text('[data]\nkind = "leaf"\npath = "exp"\n')  # meant from the working folder
    with pytest.raises(ConfigError, match=f"config: data.path = 'exp' is not at {exp}/exp: a path in a config file is "
                                          "relative to that file .*; write '.' for the working folder's exp, or an "
                                          "absolute path"):
        load_config(tmp_path / "exp" / "b.toml")
