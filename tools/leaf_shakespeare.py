#!/usr/bin/env python3
"""Build LEAF's Shakespeare data set (Caldas et al., 2018) from Shakespeare's plays written as Markdown.

    python tools/leaf_shakespeare.py PLAYS_DIR OUT_DIR [--seq-len 80] [--train-fraction 0.8] [--min-lines 2]
                                     [--force]

PLAYS_DIR is searched recursively for `*.md` plays in this form: `# Title` on the first heading line,
`## ACT ...` / `### SCENE ...` headings, stage directions as lines in italics (`_..._`, in one play `*...*`,
sometimes running over several lines), and each speech as a line `**SPEAKER**` followed by its lines. The
result is LEAF's JSON layout, which edgefed's `[data] kind = "leaf"` reads:

    OUT_DIR/train/all_data_train.json   {"users": [...], "num_samples": [...],
    OUT_DIR/test/all_data_test.json      "user_data": {user: {"x": [80-character strings], "y": [characters]}}}

Every kept user appears in both files, in name order (its test part may hold no sample).

What is taken over from LEAF's preprocessing (and, for the split, from the code of McMahan et al. that LEAF
starts from):

* A user is one speaking role of one play. A speaker's name is upper-cased, so that one name written in
  several casings is one role. Its user name is LEAF's: the play's title and the role joined by "_", each
  space made "_" and then each run of other characters that are not letters, digits or "_" made one "_"
  (so "Hamlet" and "QUEEN GERTRUDE" give "Hamlet_QUEEN_GERTRUDE", "Henry VI, Part 3" and "PRINCE" give
  "Henry_VI__Part_3_PRINCE"). Speaker names that give one user name are one role.
* The unit of text is the line: one printed line of a speech, as in LEAF, which takes each line of the
  Gutenberg edition under a speaker as one entry. A role's lines are kept in the order of the play.
* A role needs at least --min-lines lines (default 2: at least one for training and one for test, the
  reason LEAF gives for its check). LEAF's code in fact drops roles with 2 lines or fewer too;
  --min-lines 3 reproduces that.
* The split is by lines, as in McMahan et al.: the last max(floor(n * (1 - f)), 1) of a role's n lines are
  its test lines and the rest, in order, its training lines, i.e. min(ceil(n * f), n - 1) lines for training
  (f = --train-fraction; f = 1 puts every line in training). The fraction is taken exactly as written, so
  0.8 is 4/5.
* A role is kept if its training part gives at least one sample (the others are skipped and counted).
* Each part's lines become one text as LEAF makes it: every line followed by a newline, newlines then
  turned into spaces and every run of two or more spaces squeezed to one (the text so ends in a space).
  Its samples slide one character at a time: x = text[i:i + L], y = text[i + L] for i = 0 ... len - L - 1
  (L = --seq-len), so a text of c characters gives c - L samples and one of L characters or fewer none.
* Characters are not changed: those outside LEAF's 80-character vocabulary (ALL_LETTERS, edgefed's problems/text.py) are only
  counted; a reader maps them as it maps any unknown character.

Where the Markdown differs from the Gutenberg text LEAF parsed, the rules that apply to the Markdown:

* Stage directions are left out, whether between speeches or inside one (an `_[Aside]_` line), and so are
  directions set inside a spoken line in italics. (LEAF's parser kept the bracketed directions and the
  right-aligned "Exit." lines of the Gutenberg text in the speaker's text.) Markdown escapes (`\\[`) are
  undone, and emphasis markers left in a spoken line are dropped.
* A speaker stays the speaker across blank lines and stage directions until the next `**SPEAKER**` or
  heading; a heading (any `#` line, or a bold line that starts with ACT or SCENE) ends the speech, and lines
  after it with no speaker are dropped and counted. A play's title is its first `#` heading, or if it has
  none its file name with "-" as spaces, in title case; later `#` headings (an EPILOGUE) are section headings.
* Names are taken as written: "BOTH", "ALL" or "FIRST LORD" is a role of its own, as in LEAF. A name with
  other characters than letters and spaces ("CONRADE & BORACHIO") is a role too, where LEAF's pattern for a
  speaker would not have seen it at all.
* LEAF's special cases for the Gutenberg file (The Comedy of Errors' indentation, the sonnets, "plays" of one
  character that are parsing debris) have no counterpart here.

Samples and splits are the same on every run: plays are read in the sorted order of their paths, users are
written in name order. An existing OUT_DIR (other than an empty folder) is refused unless --force, which
replaces the *.json files in OUT_DIR/train and OUT_DIR/test and leaves anything else alone.

The last line printed counts plays, roles kept and skipped, training and test samples and the characters
outside ALL_LETTERS. Bad input (no such folder, no .md file, an unreadable file, settings that keep no role:
nothing is then written) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

from edgefed.problems.text import ALL_LETTERS  # LEAF's 80 characters, as edgefed's reader maps them

HEADING_RE = re.compile(r"^(#+)\s*(.*?)\s*#*\s*$")
SPEAKER_RE = re.compile(r"^\*\*([^*]+)\*\*\s*(.*)$")
SCENE_WORD_RE = re.compile(r"^(ACT|SCENE)\b", re.IGNORECASE)
# A whole line in italics: `_..._` (also the malformed `__...]_` and `[...]_`), or `*...*` but not bold.
DIRECTION_RE = re.compile(r"^(_+.*_|\*(?!\*).*(?<!\*)\*|\\?\[.*\]_)$")
INLINE_DIRECTION_RE = re.compile(r"(?<![\w*])(_+[^_]+_+|\*[^*]+\*)(?![\w*])")
ESCAPE_RE = re.compile(r"\\([!-/:-@\[-`{-~])")
SPACES_RE = re.compile(r"   *")  # LEAF's: two or more spaces become one


class InputError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class Play:
    def __init__(self, path: Path, title: str):
        self.path = path
        self.title = title
        self.roles: dict[str, list[str]] = {}  # user name -> its lines in play order
        self.names: dict[str, set[str]] = collections.defaultdict(set)  # user name -> speaker names
        self.unattributed = 0  # spoken-looking lines with no speaker (after a heading)
        self.directions = 0  # stage-direction lines left out


def user_name(title: str, role: str) -> str:
    """LEAF's name for a role of a play: title and role joined by "_", non-word runs turned into "_"."""
    return re.sub(r"\W+", "_", (title + "_" + role).replace(" ", "_"))


def _unescape(text: str) -> str:
    return ESCAPE_RE.sub(r"\1", text)


def _spoken(text: str) -> str:
    """A spoken line as text: italic directions inside it dropped, escapes undone, stray markers dropped."""
    text = INLINE_DIRECTION_RE.sub(" ", text)
    text = text.replace("**", "").replace("__", "")
    text = re.sub(r"(?<!\w)_|_(?!\w)", "", text)
    text = text.replace("*", "")
    text = _unescape(text)
    return " ".join(text.split())


def parse_play(path: Path) -> Play:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
    play = None
    role = None
    closing = None  # the marker that ends a stage direction running over several lines
    for raw in lines:
        s = raw.strip()
        heading = HEADING_RE.match(s) if s.startswith("#") else None
        speaker = SPEAKER_RE.match(s)
        if closing is not None:
            if s and not heading and not speaker:
                if s.endswith(closing):
                    closing = None
                play.directions += 1
                continue
            closing = None
        if heading:
            if play is None and len(heading.group(1)) == 1:
                play = Play(path, _unescape(heading.group(2)).strip() or _stem_title(path))
            role = None
            continue
        if play is None and s:
            play = Play(path, _stem_title(path))
        if not s:
            continue
        if speaker:
            name = " ".join(_unescape(speaker.group(1)).split()).upper()
            if SCENE_WORD_RE.match(name) and not speaker.group(2).strip():
                role = None  # a scene heading set in bold
                continue
            role = name
            rest = _spoken(speaker.group(2))
            if rest:
                _add(play, role, rest)
            continue
        if DIRECTION_RE.match(s):
            play.directions += 1
            continue
        if s.startswith("_") or (s.startswith("*") and not s.startswith("**")):
            closing = "_" if s.startswith("_") else "*"  # a direction that goes on over the next lines
            play.directions += 1
            continue
        text = _spoken(s)
        if not text:
            continue
        if role is None:
            play.unattributed += 1
            continue
        _add(play, role, text)
    return play or Play(path, _stem_title(path))


def _stem_title(path: Path) -> str:
    """The title of a play with no `# Title`: its file name, "measure-for-measure" as "Measure For Measure"."""
    return path.stem.replace("-", " ").replace("_", " ").title()


def _add(play: Play, role: str, text: str) -> None:
    user = user_name(play.title, role)
    play.roles.setdefault(user, []).append(text)
    play.names[user].add(role)


def split_lines(lines: list[str], train_fraction: Fraction) -> tuple[list[str], list[str]]:
    """The first lines for training, the last max(floor(n * (1 - f)), 1) for test (all for training if f = 1)."""
    if train_fraction >= 1:
        return list(lines), []
    num_test = max(math.floor(len(lines) * (1 - train_fraction)), 1)
    return lines[:-num_test], lines[-num_test:]


def leaf_text(lines: list[str]) -> str:
    """A part's lines as one text, as LEAF joins a role's lines: newline-ended, newlines to spaces, runs of
    two or more spaces squeezed to one."""
    return SPACES_RE.sub(" ", "".join(line + "\n" for line in lines).replace("\n", " "))


def samples(text: str, seq_len: int) -> tuple[list[str], list[str]]:
    """LEAF's next-character samples: every window of seq_len characters and the character after it."""
    n = num_samples(text, seq_len)
    return [text[i:i + seq_len] for i in range(n)], [text[i + seq_len] for i in range(n)]


def num_samples(text: str, seq_len: int) -> int:
    return max(len(text) - seq_len, 0)


def find_plays(folder: Path) -> list[Path]:
    if not folder.exists():
        raise InputError(f"{folder}: no such folder; give the folder of Markdown plays")
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder; give the folder of Markdown plays")
    paths = sorted((p for p in folder.rglob("*.md") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())
    if not paths:
        raise InputError(f"{folder}: no .md files found (searched recursively); give the folder of Markdown plays")
    return paths


def build(plays_dir: Path, seq_len: int = 80, train_fraction: Fraction = Fraction(4, 5), min_lines: int = 2):
    """Parse the plays and split every role; returns (users, stats) with users[name] = (train text, test text)
    in name order. Nothing is written."""
    plays = [parse_play(p) for p in find_plays(plays_dir)]
    stats = collections.Counter(plays=len(plays))
    users: dict[str, tuple[str, str]] = {}
    oov: collections.Counter = collections.Counter()
    seen: dict[str, Path] = {}
    longest = 0  # characters of the longest training text, for the message when no role is kept
    for play in plays:
        stats["unattributed_lines"] += play.unattributed
        stats["direction_lines"] += play.directions
        stats["merged_names"] += sum(len(names) - 1 for names in play.names.values())
        for user, lines in play.roles.items():
            if user in seen:  # two plays of one title: their roles would be one user
                raise InputError(f"{play.path}: user {user!r} is also a role in {seen[user]} (two plays with one "
                                 "title?); give each play its own # title")
            seen[user] = play.path
            stats["lines"] += len(lines)
            if len(lines) < min_lines:
                stats["skipped_few_lines"] += 1
                continue
            train, test = split_lines(lines, train_fraction)
            train_text, test_text = leaf_text(train), leaf_text(test)
            longest = max(longest, len(train_text))
            if num_samples(train_text, seq_len) == 0:
                stats["skipped_no_train_sample"] += 1
                continue
            users[user] = (train_text, test_text)
    users = dict(sorted(users.items()))
    for train_text, test_text in users.values():
        stats["train_samples"] += num_samples(train_text, seq_len)
        stats["test_samples"] += num_samples(test_text, seq_len)
        stats["train_chars"] += len(train_text)
        stats["test_chars"] += len(test_text)
        stats["no_test_sample"] += num_samples(test_text, seq_len) == 0
        for text in (train_text, test_text):
            oov.update(c for c in text if c not in ALL_LETTERS)
    stats["kept"] = len(users)
    stats["skipped"] = stats["skipped_few_lines"] + stats["skipped_no_train_sample"]
    if not users:  # a dataset with no users is no dataset: a run on it could only refuse
        raise InputError(_nothing_kept(stats, longest, seq_len, min_lines))
    return users, stats, oov


def _nothing_kept(stats, longest: int, seq_len: int, min_lines: int) -> str:
    """Why no role was kept, with the setting that would keep some."""
    if not stats["lines"]:
        return f"{stats['plays']} plays but no speech in them; give Markdown plays with **SPEAKER** lines"
    if stats["skipped_few_lines"] and not stats["skipped_no_train_sample"]:
        return (f"no role has --min-lines {min_lines} lines ({stats['skipped_few_lines']} roles); lower "
                "--min-lines")
    return (f"no role's training text is longer than --seq-len {seq_len} characters (the longest has {longest}), "
            f"so no role has a training sample; lower --seq-len (LEAF's is 80)")


def _write_json(path: Path, users: dict[str, str], seq_len: int) -> None:
    """One LEAF file, written user by user (the samples of all users together would take gigabytes)."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"users": ' + json.dumps(list(users)))
        f.write(', "num_samples": ' + json.dumps([num_samples(t, seq_len) for t in users.values()]))
        f.write(', "user_data": {')
        for k, (user, text) in enumerate(users.items()):
            x, y = samples(text, seq_len)
            f.write((", " if k else "") + json.dumps(user) + ': {"x": ' + json.dumps(x) + ', "y": '
                    + json.dumps(y) + "}")
        f.write("}}\n")
    os.replace(tmp, path)


def check_out(out: Path, force: bool) -> None:
    """Refuse an output folder that exists (unless empty), before any work; --force lets it through."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder; give a new output folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError(f"{out}: exists already; give a new output folder, or --force to replace its "
                         "train/*.json and test/*.json")


def write(out: Path, users: dict[str, tuple[str, str]], seq_len: int) -> None:
    """train/ and test/ in out; *.json files already there (an earlier build's) are removed first, as a reader
    would take every one of them."""
    for k, (part, name) in enumerate((("train", "all_data_train.json"), ("test", "all_data_test.json"))):
        (out / part).mkdir(parents=True, exist_ok=True)
        for old in (out / part).glob("*.json"):
            old.unlink()
        _write_json(out / part / name, {u: texts[k] for u, texts in users.items()}, seq_len)


def summary(stats, oov, seconds: float) -> str:
    chars = ", ".join(f"{c!r} {n}" for c, n in sorted(oov.items(), key=lambda kv: (-kv[1], kv[0])))
    return (f"{stats['plays']} plays, {stats['kept']} roles kept, {stats['skipped']} skipped "
            f"({stats['skipped_few_lines']} with too few lines, {stats['skipped_no_train_sample']} with no training "
            f"sample), {stats['train_samples']} train and {stats['test_samples']} test samples "
            f"({stats['no_test_sample']} kept roles without a test sample), "
            f"{sum(oov.values())} characters outside ALL_LETTERS" + (f" ({chars})" if chars else "")
            + f", {seconds:.1f} s")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage and message
        raise InputError(message)


def _fraction(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="leaf_shakespeare.py", description="Build LEAF's Shakespeare JSON layout from "
                     "Markdown plays.")
    parser.add_argument("plays_dir", type=Path, help="folder of *.md plays (searched recursively)")
    parser.add_argument("out_dir", type=Path, help="output folder: train/ and test/ are written in it")
    parser.add_argument("--seq-len", type=_positive, default=80, help="characters in a sample's x (80)")
    parser.add_argument("--train-fraction", type=_fraction, default=Fraction(4, 5),
                        help="fraction of each role's lines, from its first, for training (0.8)")
    parser.add_argument("--min-lines", type=_positive, default=2, help="fewest lines a role needs (2)")
    parser.add_argument("--force", action="store_true", help="replace the JSON files of an existing output")
    start = time.perf_counter()
    try:
        args = parser.parse_args(argv)
        check_out(args.out_dir, args.force)  # before the work, so a refusal is at once
        users, stats, oov = build(args.plays_dir, args.seq_len, args.train_fraction, args.min_lines)
        write(args.out_dir, users, args.seq_len)
    except InputError as exc:
        print(f"leaf_shakespeare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"leaf_shakespeare: cannot write {args.out_dir} ({exc})", file=sys.stderr)
        return 1
    print(summary(stats, oov, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
