"""A run log read for answers: its config, headline numbers, time to a target, and per-device participation.

Only the run log's reader and the config's schema are used: nothing here runs anything.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed.errors import EdgefedError, RunLogError
from edgefed.runlog import LazyRun, no_round_yet, nonfinite_counts, restart_records


@dataclass(frozen=True)
class Run:
    """One run log, with the numbers a summary, a report and a sweep table show."""

    path: Path
    data: Mapping  # every dataset (read on first use) and, under "attrs", the root attributes
    config_toml: str

    @classmethod
    def read(cls, path) -> "Run":
        data = LazyRun(path)
        stub = no_round_yet(path, data["attrs"], data)
        if stub is not None:
            raise stub
        for name in ("metrics/test_accuracy", "metrics/train_loss", "participation/steps", "participation/selected"):
            if name not in data:
                raise RunLogError(f"{path} lacks {name}; it is not an edgefed run log")
        return cls(Path(path), data, str(data["attrs"].get("config", "")))

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.data[name]
        except KeyError:  # (a group where the dataset belongs is not listed either)
            raise RunLogError(f"{self.path} lacks {name}; it is not an edgefed run log, or it is damaged") from None

    @property
    def attrs(self) -> dict:
        return self.data["attrs"]

    @property
    def status(self) -> str:
        return str(self.attrs.get("status", "running"))

    @property
    def rounds(self) -> int:
        """Rounds completed (the log's rows)."""
        return int(self["participation/steps"].shape[0])

    @property
    def rounds_planned(self) -> int:
        return int(self.attrs.get("rounds", self.rounds))

    @property
    def clock(self) -> np.ndarray:
        """(rounds + 1,) the federation's clock; NaN where the log kept none (logs before it existed)."""
        clock = self.data.get("metrics/clock_s")
        return np.full(self.rounds + 1, np.nan) if clock is None else clock

    @property
    def restarts(self) -> tuple:
        """The worlds `edgefed launch` started again on this log (/launch/restarts): round, time, cause, ranks."""
        return restart_records(self.data.get("launch/restarts", ()))

    def final(self, name: str) -> float:
        values = self[f"metrics/{name}"]
        finite = values[np.isfinite(values)]
        return float(finite[-1]) if finite.size else math.nan

    def best(self, name: str) -> float:
        values = self[f"metrics/{name}"]
        finite = values[np.isfinite(values)]
        return float(finite.max()) if finite.size else math.nan

    def wall_s(self) -> float:
        return float(np.nansum(self.data.get("metrics/round_elapsed_s", np.zeros(0))))

    def bytes_per_round(self, direction: str) -> float:
        """Mean over the rounds of what travelled "up" (reports) or "down" (broadcasts), summed over the
        devices; NaN for a log from before the wire was logged."""
        sent = self.data.get(f"participation/bytes_{direction}")
        if sent is None or not sent.shape[0]:
            return math.nan
        return float(sent.sum(axis=1).mean())

    def partition(self) -> dict | None:
        """How the training labels are spread over the devices (logs with /devices/label_counts): the counts,
        the labels each device holds a sample of (the mean over the devices), and the label skew: the mean total-variation
        distance of a device's label distribution from the pooled one (0: every device like the pool, IID;
        near 1: devices with disjoint labels)."""
        counts = self.data.get("devices/label_counts")
        if counts is None or not counts.size:
            return None
        known = (counts >= 0).all(axis=1)  # a large generated federation's log counts a device once it is built
        if not known.any():
            return None
        counts = np.asarray(counts[known], np.float64)
        totals = counts.sum(axis=1)
        shares = counts / np.maximum(totals[:, None], 1)
        pooled = counts.sum(axis=0) / max(counts.sum(), 1)
        return {"counts": counts.astype(np.int64), "labels_held": float((counts > 0).sum(axis=1).mean()),
                "skew": float(0.5 * np.abs(shares - pooled).sum(axis=1).mean()),
                "samples": (int(totals.min()), int(totals.max())), "of": int(known.size)}

    def widths(self) -> dict | None:
        """[submodel] runs only: the method, and the device-rounds that trained each width and their steps done
        of those asked ({width: (device-rounds, share of the budget done)})."""
        width = self.data.get("participation/width")
        if width is None:
            return None
        out = {}
        for w in np.unique(width[np.isfinite(width)]):
            at = width == w
            asked = int(self["participation/budget"][at].sum())
            out[float(w)] = (int(at.sum()), self["participation/steps"][at].sum() / asked if asked else math.nan)
        return {"method": self.config_dict().get("submodel", {}).get("method"), "widths": out}

    def secagg(self) -> dict | None:
        """Secure aggregation's cost and outcome ([secagg] runs only): mean protocol seconds and bytes per
        device and round (over the selected ones that reported a time), aborted rounds, coordinates clipped."""
        spent = self.data.get("participation/secagg_s")
        if spent is None or not spent.shape[0]:
            return None
        selected = self["participation/selected"]
        timed = selected & np.isfinite(spent)
        return {"seconds": float(spent[timed].mean()) if timed.any() else math.nan,
                "bytes": float(self["participation/secagg_bytes"][selected].mean()) if selected.any() else math.nan,
                "aborted": int(self["metrics/secagg_aborted"].sum()),
                "clipped": int(self.data.get("metrics/secagg_clipped", np.zeros(0, np.int64)).sum()),
                "keys": str(self.attrs.get("secagg_key_source", "os"))}

    def to_target(self, accuracy: float) -> tuple[float, float]:
        """(rounds, clock seconds) of the first evaluated round whose test accuracy reaches `accuracy`;
        NaN where it never does."""
        acc = np.nan_to_num(self["metrics/test_accuracy"], nan=-math.inf)
        reached = np.flatnonzero(acc >= accuracy)
        if not reached.size:
            return math.nan, math.nan
        return float(reached[0]), float(self.clock[reached[0]])

    def spent_j(self) -> np.ndarray | None:
        """(rounds + 1,) the energy spent by the end of each round, J (0 at round 0; None: the log has no
        energy: its boards' profiles have no [power], or it is from before energy was logged)."""
        joules = self.data.get("participation/energy_j")
        if joules is None:
            return None
        return np.concatenate([[0.0], np.cumsum(np.nansum(joules, axis=1))])

    def energy_to_target(self, accuracy: float) -> float:
        """The energy spent when the test accuracy first reached `accuracy`, J (NaN: never, or no energy)."""
        rounds, _ = self.to_target(accuracy)
        spent = self.spent_j()
        return math.nan if spent is None or math.isnan(rounds) else float(spent[int(rounds)])

    def energy(self) -> dict | None:
        """What the run's work cost in energy (logs with /participation/energy_j): J in all and a round; per
        device, J and J a round in which it worked; per board where a measured run's devices shared boards
        (the rank's), J and J a round in which any of its devices worked."""
        joules = self.data.get("participation/energy_j")
        if joules is None or not joules.shape[0]:
            return None
        charged = np.isfinite(joules)
        per_device = np.where(charged.any(axis=0), np.nansum(joules, axis=0), np.nan)  # (NaN: never known)
        total = float(np.nansum(per_device))
        out = {"total": total, "per_round": total / joules.shape[0], "device": per_device,
               "device_rounds": charged.sum(axis=0), "boards": None, "since": self.since_restart(),
               "partial": bool((self["participation/selected"] & ~charged).any())}
        read = self.data.get("participation/energy_read_j")  # what the boards' own meters read, beside it
        if read is not None:
            known = np.isfinite(read)
            out["read"] = {"total": float(read[known].sum()), "modelled": float(joules[known & charged].sum()),
                           "device_rounds": int(known.sum())} if known.any() else None
        board = self.attrs.get("device_board")
        if board is not None:  # (the last world's boards: the rounds since its restart)
            board, since = np.asarray(board, np.int64), out["since"]
            later = np.where(charged[since:], joules[since:], 0.0)
            out["boards"] = []
            for b in range(int(board.max(initial=-1)) + 1):
                mine = board == b
                worked = int(charged[since:, mine].any(axis=1).sum())
                spent = float(later[:, mine].sum()) if worked else math.nan
                metered = None if read is None else read[since:, mine]
                out["boards"].append({"board": b, "devices": int(mine.sum()), "total": spent, "rounds": worked,
                                      "per_round": spent / worked if worked else math.nan,
                                      "read": float(np.nansum(metered)) if metered is not None
                                      and np.isfinite(metered).any() else math.nan})
        return out

    def since_restart(self) -> int:
        """The rounds completed before the world that wrote the log's last rows started (0: one world): a
        restart may have placed the devices on other boards, and the log keeps the last world's placement."""
        return int(self.restarts[-1]["round"]) if self.restarts else 0

    def board_steps(self) -> list[dict] | None:
        """Per real board (a measured run on profiled boards), over the device-rounds that had a deadline since
        the last restart: the steps the profiles predict within it (min(K_k, floor(W (1 - L_k) / the profile's
        seconds a step)), W the deadline (less the links' time with deadline_covers = "round"), L_k the CPU
        competitor's load beside the device, which takes that much of its core), the steps completed, and the
        gap (completed / predicted - 1). None without boards, profiles or deadlines."""
        board, step_s = self.attrs.get("device_board"), self.attrs.get("profile_step_s")
        deadline = self.data.get("participation/deadline_s")
        if board is None or step_s is None or deadline is None:
            return None
        timed = self["participation/selected"] & np.isfinite(deadline)
        timed[:self.since_restart()] = False  # (the last world's boards)
        if not timed.any():
            return None
        board = np.asarray(board, np.int64)
        free = 1.0 - self._competitor_loads(board)
        window = np.where(timed, deadline, 0.0)
        if self.config_dict().get("participation", {}).get("deadline_covers") == "round":  # less the links
            comm = self.data.get("participation/comm_s")
            window = window - (0.0 if comm is None else np.where(np.isfinite(comm), comm, 0.0))
        fit = np.floor(np.maximum(window, 0.0) * free / np.asarray(step_s, np.float64) + 1e-9)
        predicted = np.where(timed, np.minimum(self["participation/budget"], fit), 0).sum(axis=0)
        done = np.where(timed, self["participation/steps"], 0).sum(axis=0)
        out = []
        for b in range(int(board.max(initial=-1)) + 1):
            mine = board == b
            p, m = int(predicted[mine].sum()), int(done[mine].sum())
            out.append({"board": b, "predicted": p, "measured": m, "gap": m / p - 1 if p else math.nan})
        return out

    def _competitor_loads(self, board: np.ndarray) -> np.ndarray:
        """(N,) the CPU competitor's load beside each device: its board's ([device] contention, entry b: rank
        b + 1), else [participation] contention cycled over the devices, else none."""
        cfg = self.config_dict()
        per_board = cfg.get("device", {}).get("contention") or []
        cycled = cfg.get("participation", {}).get("contention") or []
        if per_board:
            return np.asarray(per_board, np.float64)[np.minimum(board, len(per_board) - 1)]
        if cycled:
            return np.asarray(cycled, np.float64)[np.arange(board.size) % len(cycled)]
        return np.zeros(board.size)

    def config_dict(self) -> dict:
        """The config the log stores, as TOML data (parsed once, shared: not to be changed)."""
        return self._config

    @functools.cached_property
    def _config(self) -> dict:  # (parsed once: a summary asks it per board and per line)
        try:
            return tomllib.loads(self.config_toml)
        except tomllib.TOMLDecodeError as exc:
            raise RunLogError(f"{self.path}: its stored config is not TOML ({exc})") from None

    def differences(self) -> list[tuple[str, object]]:
        """(table.key, value) of every key whose value differs from the built-in default's."""
        try:
            default = config_mod.to_dict(config_mod.load_config(None))
            mine = config_mod.to_dict(config_mod.config_from_dict(self.config_dict()))
        except EdgefedError:  # a config this edgefed does not know: show it as stored
            default, mine = {}, self.config_dict()
        # a key this run leaves unset (None) is one its problem has no use for, not a choice it made
        return [(key, value) for key, value in config_mod.dict_differences(mine, default) if value is not None]

    def fractions(self) -> np.ndarray:
        """(rounds, N) completed fraction s_k / K_k of the selected devices, NaN where not selected."""
        budget = self["participation/budget"].astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self["participation/selected"] & (budget > 0), self["participation/steps"] / budget, np.nan)

    def privacy(self) -> dict | None:
        """Differential privacy's terms ([privacy] runs only): the mechanism, z, C, delta, the last epsilon
        logged, and the share of applied contributions the clip cut."""
        if "privacy_mechanism" not in self.attrs:
            return None
        eps = self.data.get("metrics/epsilon", np.array([math.nan]))
        clipped, applied = self.data.get("participation/clipped"), self["participation/coeff"] != 0
        share = float(clipped[applied].mean()) if clipped is not None and applied.any() else math.nan
        a = self.attrs
        return {"mechanism": str(a["privacy_mechanism"]), "z": float(a["privacy_noise_multiplier"]),
                "clip": float(a["privacy_clip"]), "delta": float(a["privacy_delta"]),
                "epsilon": float(eps[-1]) if eps.size else math.nan, "clipped": share}

    def participation(self) -> dict:
        """Who took part: the selection policy, Jain's index of the devices' selection counts and how many
        devices were never selected."""
        counts = self["participation/selected"].sum(axis=0)
        policy = self.config_dict().get("selection", {}).get("policy", "uniform")
        return {"policy": policy, "jain": jain_index(counts), "never": int((counts == 0).sum()), "n": counts.size}

    def most_selected(self, limit: int) -> np.ndarray:
        """Every device id, or in a larger federation the `limit` selected most (ties: the lower ids), in
        id order: what a per-device table or figure shows."""
        counts = self["participation/selected"].sum(axis=0)
        if counts.size <= limit:
            return np.arange(counts.size)
        return np.sort(np.argsort(-counts, kind="stable")[:limit])

    def nonfinite(self) -> dict:
        """Reports dropped as non-finite (NaN or infinity in an update) in all, the rounds in which any were,
        and the rounds that applied no update."""
        return nonfinite_counts(self.data)

    def devices(self, ids=None) -> list[dict]:
        """Per device (these ids, ascending; by default all): rounds selected, mean completed fraction,
        inactive and late shares (of its selected rounds), reports dropped as non-finite, mean CPU share."""
        sel, steps = self["participation/selected"], self["participation/steps"]
        ids = np.arange(sel.shape[1]) if ids is None else np.asarray(ids, np.int64)
        sel, steps, budget = sel[:, ids], steps[:, ids], self["participation/budget"][:, ids].astype(float)
        nonfinite = self["participation/nonfinite"][:, ids].sum(axis=0)
        late = self.data["participation/late"][:, ids] if "participation/late" in self.data else np.zeros_like(sel)
        cpu = (self.data["participation/cpu_percent"][:, ids] if "participation/cpu_percent" in self.data
               else np.full(sel.shape, np.nan))
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(sel & (budget > 0), steps / budget, np.nan)
        rows = []
        for j, k in enumerate(ids):
            mine = sel[:, j]
            n = int(mine.sum())
            with np.errstate(invalid="ignore"):
                rows.append({"device": int(k), "selected": n,
                             "fraction": float(np.nanmean(frac[mine, j])) if n else math.nan,
                             "inactive": float(np.mean(steps[mine, j] == 0)) if n else math.nan,
                             "late": float(np.mean(late[mine, j])) if n else math.nan,
                             "nonfinite": int(nonfinite[j]),
                             "cpu_percent": float(np.nanmean(cpu[mine, j])) if n and np.isfinite(cpu[mine, j]).any()
                             else math.nan})
        return rows


def jain_index(counts) -> float:
    """Jain's fairness index (sum c)^2 / (N sum c^2) of per-device counts: 1 when all are equal, 1/N when
    one device has everything (NaN when all are zero)."""
    c = np.asarray(counts, np.float64)
    total = float((c ** 2).sum())
    return float(c.sum() ** 2 / (c.size * total)) if total > 0 else math.nan
