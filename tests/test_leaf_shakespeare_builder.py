"""tools/leaf_shakespeare.py: LEAF's Shakespeare layout built from Markdown plays (two tiny plays, and the real
corpus where it is beside the checkout)."""

import importlib.util
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = _ROOT / "tools" / "leaf_shakespeare.py"
PLAYS = _ROOT.parent / "shared" / "data" / "shakespeare"

_spec = importlib.util.spec_from_file_location("leaf_shakespeare", SCRIPT)
leaf_shakespeare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(leaf_shakespeare)

ANNA = [f"Anna speaks line {i:02d} of her part, in quite good verse." for i in range(1, 11)]  # 53 characters each
LORD = [f"The lord's line {i} is short." for i in range(1, 6)]

ALPHA = "\n".join([
    "# The Alpha Play", "", "## ACT I", "", "### SCENE I. A room.", "",
    "_Enter ANNA, BEN and CAROL,", "with others_", "",
    "**ANNA**  ", *[line + "  " for line in ANNA[:4]], ANNA[4], "",
    "_Exit BEN_", "",  # a stage direction inside the speech: ANNA goes on
    *[line + "  " for line in ANNA[5:7]], "",
    "**BEN**  ", "Ben has but this one line.", "",
    "**CAROL**  ", "Yes.  ", "No.", "",
    "**Anna**  ", "_\\[Aside]_  ", *[line + "  " for line in ANNA[7:9]], ANNA[9], "",
    "_Exeunt_", ""])
BETA = "\n".join([
    "# Beta, Part 2", "", "## ACT I", "", "### SCENE I. A field.", "",
    "**FIRST LORD**  ", *[line + "  " for line in LORD[:3]], "",
    "**BOTH**  ", "We two speak \\[as one] here,  ", "And so we _\\[ ]_ end.", "",
    "### SCENE II. Another field.", "",
    "Nobody says this line.", "",
    "**First Lord**  ", *[line + "  " for line in LORD[3:]], ""])


@pytest.fixture
def plays(tmp_path):
    folder = tmp_path / "plays"
    (folder / "comedies").mkdir(parents=True)
    (folder / "tragedies").mkdir()
    (folder / "comedies" / "alpha.md").write_text(ALPHA, encoding="utf-8")
    (folder / "tragedies" / "beta.md").write_text(BETA, encoding="utf-8")
    (folder / "notes.txt").write_text("not a play", encoding="utf-8")
    return folder


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def load(out: Path, part: str) -> dict:
    files = sorted((out / part).glob("*.json"))
    assert [f.name for f in files] == [f"all_data_{part}.json"]
    return json.loads(files[0].read_text(encoding="utf-8"))


def test_users_samples_and_split(plays, tmp_path):
    out = tmp_path / "out"
    done = run(plays, out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    train, test = load(out, "train"), load(out, "test")
    users = ["Beta__Part_2_FIRST_LORD", "The_Alpha_Play_ANNA"]
    # BEN (one line) is skipped, and so are CAROL and BOTH, whose one training line gives no 80-character window
    assert train["users"] == test["users"] == users

    # ANNA: 10 lines over three speeches, stage directions left out; 8 for training, the last 2 for test
    anna_train = " ".join(ANNA[:8]) + " "
    anna_test = " ".join(ANNA[8:]) + " "
    x, y = train["user_data"]["The_Alpha_Play_ANNA"]["x"], train["user_data"]["The_Alpha_Play_ANNA"]["y"]
    assert len(x) == len(y) == 8 * 54 - 80
    assert x[0] == "Anna speaks line 01 of her part, in quite good verse. Anna speaks line 02 of her"
    assert y[0] == " "
    assert x[1] == x[0][1:] + y[0] and y[1] == "p"  # the window slides by one character
    assert x[-1] == anna_train[-81:-1] and y[-1] == " "
    assert test["user_data"]["The_Alpha_Play_ANNA"] == {"x": [anna_test[i:i + 80] for i in range(28)],
                                                       "y": list(anna_test[80:])}

    # FIRST LORD (two casings, one role): 5 lines, 4 for training; its one test line is too short for a sample
    # (across a scene heading, and after a line with no speaker, which is dropped)
    lord_train = " ".join(LORD[:4]) + " "
    assert train["user_data"]["Beta__Part_2_FIRST_LORD"]["x"][0] == lord_train[:80]
    assert train["user_data"]["Beta__Part_2_FIRST_LORD"]["y"][0] == lord_train[80]
    assert train["num_samples"] == [len(lord_train) - 80, 8 * 54 - 80]
    assert test["num_samples"] == [0, 28]
    assert test["user_data"]["Beta__Part_2_FIRST_LORD"] == {"x": [], "y": []}
    for data in (train, test):
        for user, n in zip(data["users"], data["num_samples"]):
            record = data["user_data"][user]
            assert len(record["x"]) == len(record["y"]) == n
            assert all(len(s) == 80 for s in record["x"]) and all(len(c) == 1 for c in record["y"])


def test_short_window(plays):
    users, stats, oov = leaf_shakespeare.build(plays, seq_len=10)
    assert list(users) == ["Beta__Part_2_BOTH", "Beta__Part_2_FIRST_LORD", "The_Alpha_Play_ANNA"]
    # BOTH: 2 lines, one each; the escape undone and the inline direction left out
    assert users["Beta__Part_2_BOTH"] == ("We two speak [as one] here, ", "And so we end. ")
    assert stats["skipped_few_lines"] == 1  # BEN
    assert stats["skipped_no_train_sample"] == 1  # CAROL: "Yes. " gives no 10-character window
    # the one line with no speaker is BETA's after its scene heading (ALPHA's two-line direction is a direction)
    assert stats["unattributed_lines"] == 1 and stats["plays"] == 2 and not oov


def test_summary_line_counts(plays, tmp_path):
    done = run(plays, tmp_path / "out")
    line = done.stdout.strip()
    assert line.startswith("2 plays, 2 roles kept, 3 skipped (1 with too few lines, 2 with no training sample)")
    assert f"{8 * 54 - 80 + len(' '.join(LORD[:4]) + ' ') - 80} train and 28 test samples" in line
    assert "(1 kept roles without a test sample)" in line
    assert "0 characters outside ALL_LETTERS" in line


def test_min_lines_and_fraction(plays):
    users, stats, _ = leaf_shakespeare.build(plays, seq_len=10, min_lines=3)
    assert "Beta__Part_2_BOTH" not in users and stats["skipped_few_lines"] == 3  # BEN, CAROL and BOTH
    users, _, _ = leaf_shakespeare.build(plays, train_fraction=Fraction(1))
    assert users["The_Alpha_Play_ANNA"] == (" ".join(ANNA) + " ", "")


@pytest.mark.parametrize("n, train", [(2, 1), (4, 3), (5, 4), (9, 8), (10, 8), (14, 12), (15, 12), (100, 80)])
def test_split_rounds_like_mcmahan(n, train):
    lines = [str(i) for i in range(n)]
    first, last = leaf_shakespeare.split_lines(lines, Fraction("0.8"))
    assert first == lines[:train] and last == lines[train:]


def test_refuses_to_overwrite(plays, tmp_path):
    out = tmp_path / "out"
    assert run(plays, out).returncode == 0
    before = (out / "train" / "all_data_train.json").read_bytes()
    (out / "train" / "stale.json").write_text("{}")
    (out / "keep.txt").write_text("mine")
    done = run(plays, out, "--seq-len", "20")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--force" in done.stderr and "Traceback" not in done.stderr
    assert (out / "train" / "all_data_train.json").read_bytes() == before
    done = run(plays, out, "--seq-len", "20", "--force")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (out / "train").iterdir()) == ["all_data_train.json"]
    assert (out / "keep.txt").read_text() == "mine"
    assert len(load(out, "train")["user_data"]["The_Alpha_Play_ANNA"]["x"][0]) == 20
    done = run(plays, out, "--seq-len", "20", "--force")  # the same input gives the same bytes
    assert done.returncode == 0, done.stderr
    again = (out / "train" / "all_data_train.json").read_bytes()
    assert run(plays, tmp_path / "other", "--seq-len", "20").returncode == 0
    assert (tmp_path / "other" / "train" / "all_data_train.json").read_bytes() == again


@pytest.mark.parametrize("case", ["missing", "empty", "bad-option"])
def test_bad_input_is_one_line(tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no plays")
    args = {"missing": [tmp_path / "nope", tmp_path / "out"], "empty": [tmp_path / "empty", tmp_path / "out"],
            "bad-option": [tmp_path / "empty", tmp_path / "out", "--train-fraction", "1.5"]}[case]
    done = run(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, says", [(["--seq-len", "100000"], "(the longest has 432), so no role has a "
                                                                  "training sample; lower --seq-len"),
                                        (["--min-lines", "50"], "no role has --min-lines 50 lines (5 roles)")])
def test_refuses_settings_that_keep_no_role(plays, tmp_path, capsys, args, says):
    """A dataset with no user is not written: exit 2, one line saying which setting to lower (the longest
    training text: ANNA's 8 training lines of 54 characters)."""
    out = tmp_path / "none"
    assert leaf_shakespeare.main([str(plays), str(out), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and says in captured.err, captured.err
    assert not out.exists()


@pytest.mark.skipif(not PLAYS.is_dir(), reason=f"the Shakespeare Markdown plays are not in {PLAYS} (shared data "
                    "beside the checkout)")
def test_real_corpus():
    """The whole corpus, parsed and split in process (about 2 s; writing its 380 MB of JSON is left out)."""
    users, stats, oov = leaf_shakespeare.build(PLAYS)
    assert (stats["plays"], stats["kept"], stats["skipped"]) == (38, 1150, 267)
    assert (stats["train_samples"], stats["test_samples"]) == (3457508, 776239)
    assert dict(oov) == {"\u2014": 64, "$": 1}
    hamlet_train, hamlet_test = users["Hamlet_HAMLET"]
    assert (len(hamlet_train) - 80, len(hamlet_test) - 80) == (49230, 11900)
    assert hamlet_train[:80] == "A little more than kin, and less than kind. Not so, my lord; I am too much i' th"
