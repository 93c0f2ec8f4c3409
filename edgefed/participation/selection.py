"""Who takes part in a round: the selection policies of docs/design.md 2.18, as arithmetic.

- `uniform` (the default): S of the members uniformly, from the round's SELECT stream.
- `fedcs` (Nishio and Yonetani, ICC 2019): from `candidates` members drawn uniformly (its resource request
  to a random share of the clients; 2S by default), greedily the device whose predicted time adds least to
  the round, while its K_k steps fit in its deadline; up to S.
- `oort` (Lai et al., OSDI 2021): exploitation of the explored devices by statistical utility
  |B_k| sqrt(mean of squared sample losses), normalized and clipped, plus a staleness bonus, times the
  system penalty (T / t_k)^alpha past the preferred duration T; a decaying share explores unexplored
  devices by their data size (penalized alike); a pacer relaxes T when the utility falls.
- `power_of_choice` (Cho, Wang and Joshi, AISTATS 2022): `candidates` members drawn without replacement
  by their objective weight, their local losses at the current model evaluated, the S highest taken.

Under FedBuff a policy chooses each task's device, one among the idle members at a time.

A policy reads only a `View` (what the log holds or the devices reported) and declares its state as
(name, shape, dtype) slots, which the engine keeps in the log's /state for --resume, as it keeps an
algorithm's server vectors; every draw comes from a stream of its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from edgefed.participation.sampling import select_devices
from edgefed.participation.timing import steps_within
from edgefed.rng import Purpose, generator

POLICIES = ("uniform", "fedcs", "oort", "power_of_choice")

# Oort's constants beside its parameters: the reference selector's (the paper's algorithm has no clip or
# window): rewards clipped at their 98th percentile, the unexplored drawn from the top 5x of those needed.
OORT_CLIP = 0.98
OORT_SAMPLE_WINDOW = 5.0
OORT_STALENESS = 0.1  # the bonus sqrt(0.1 ln r / L_k)
# Oort's parameters left unset take the paper's values (Lai et al., OSDI 2021, and its reference selector:
# exploration 0.9 decaying by 0.98 a round to 0.3, penalty exponent 2, cut-off 0.95, pacer window 20)
OORT_DEFAULTS = {"alpha": 2.0, "exploration": 0.9, "exploration_decay": 0.98, "exploration_min": 0.3,
                 "cut_off": 0.95, "pacer_step": 20}


def oort_settings(settings):
    """The [selection] table with Oort's unset parameters at their defaults."""
    return dataclasses.replace(settings, **{key: value for key, value in OORT_DEFAULTS.items()
                                            if getattr(settings, key) is None})


@dataclass(frozen=True)
class View:
    """What a policy may read when it selects the devices of round `round_idx`."""

    round_idx: int
    members: np.ndarray  # the federation's device ids, ascending
    count: int  # how many to select (S, or over-selection's ceil((1 + o) S))
    weights: np.ndarray | None  # (members,) the objective's weights of the members; None for a policy that
    # reads none
    seconds: np.ndarray | None  # (N,) each device's predicted round: K_k x its seconds per step + its links; NaN
    # unknown; None for a policy that reads no speeds
    work_s: np.ndarray | None  # (N,) of that, the K_k steps alone
    sizes: np.ndarray  # (N,) min(n_k, K_k b): the samples a full round trains on (Oort's |B_k| before it reports)
    budgets: np.ndarray | None = None  # (N,) K_k
    least: int = 1  # the fewest devices a round may have (secure aggregation needs 2 to hide one)
    window: Callable | None = None  # window(ids) -> (ids,) seconds the deadline leaves ids' steps (candidates set it)
    deadline_s: np.ndarray | None = None  # (N,) a fixed deadline policy's seconds (Oort's preferred duration)
    losses: Callable | None = None  # losses(ids) -> (ids,) F_k at the current model (one pass over their data)
    draw: int | None = None  # the key of the policy's streams (None: the round; FedBuff: its n-th task draw)

    @property
    def key(self) -> int:
        return self.round_idx if self.draw is None else self.draw


@dataclass(frozen=True)
class Choice:
    """A policy's decision: the selected ids (ascending), the devices it considered and each one's score."""

    selected: np.ndarray
    candidates: np.ndarray  # ascending ids
    utility: np.ndarray  # (candidates,) float64
    deadline_among: np.ndarray | None = None  # whose predictions set an adaptive deadline (None: the selected)


@dataclass(frozen=True)
class Feedback:
    """What a round tells a policy of its selected devices (rows in plan order)."""

    round_idx: int
    ids: np.ndarray
    taken: np.ndarray  # bool: the report was applied
    loss_sq: np.ndarray  # summed squared sample losses of the device's steps
    samples: np.ndarray  # how many samples those were


class Uniform:
    name = "uniform"
    reads_losses = False  # whether it reads what the devices' steps say of their losses
    reads_speeds = False  # whether it reads the devices' predicted times (View.seconds, work_s)
    reads_weights = False  # whether it reads the members' objective weights (View.weights)

    def __init__(self, seed: int, settings, n_train: np.ndarray, rounds: int):
        self.seed, self.n_train = seed, np.asarray(n_train, np.int64)

    @staticmethod
    def slots(n: int, rounds: int) -> tuple:
        """The state a policy keeps for --resume in a federation of n devices over `rounds` rounds, as
        (name, shape, dtype) slots: known before any policy is built (the log's header declares them)."""
        return ()

    def select(self, view: View) -> Choice:
        chosen = select_devices(self.seed, view.key, view.members, view.count)
        # (a read-only view: no N-wide array a round for scores a uniform draw does not have)
        return Choice(chosen, view.members, np.broadcast_to(np.nan, view.members.shape))

    def observe(self, fb: Feedback) -> None:
        pass

    def values(self) -> dict:
        return {}

    def load(self, values: dict) -> None:
        pass


def draw_candidates(seed: int, round_idx: int, members: np.ndarray, d: int, p: np.ndarray | None = None) -> np.ndarray:
    """d distinct members in the order drawn (uniformly, or by weights p without replacement), from the
    round's CANDIDATES stream."""
    if d >= members.size and p is None:
        return generator(seed, Purpose.CANDIDATES, round_idx).permutation(members)
    rng = generator(seed, Purpose.CANDIDATES, round_idx)
    return rng.choice(members, size=min(d, members.size), replace=False, p=p)


class _FromCandidates(Uniform):
    """A policy that first draws `candidates` members (2S unless set)."""

    def __init__(self, seed: int, settings, n_train: np.ndarray, rounds: int):
        super().__init__(seed, settings, n_train, rounds)
        self.candidates = settings.candidates

    def asked(self, view: View) -> int:
        return 2 * view.count if self.candidates is None else self.candidates


class FedCS(_FromCandidates):
    """Nishio and Yonetani's greedy: with each device's link its own (edgefed's links, the deadline per device),
    the round's time is the largest predicted time of its devices, so the device adding least to it is the
    fastest left; a device is taken when its K_k steps fit in the compute its deadline leaves. Unknown
    speeds count as 0 (tried first, measured once)."""

    name = "fedcs"
    reads_speeds = True

    def select(self, view: View) -> Choice:
        drawn = draw_candidates(self.seed, view.key, view.members, self.asked(view))
        seconds, budgets = view.seconds[drawn], view.budgets[drawn]
        step_s, window = view.work_s[drawn] / np.maximum(budgets, 1), view.window(drawn)
        # the steps the window leaves at the device's speed, as a simulated deadline counts them; unknown
        # speed (NaN) or no window: it fits
        known = np.isfinite(step_s) & np.isfinite(window)
        fits = ~known | (steps_within(budgets, np.where(known, step_s, 1.0), np.where(known, window, 0.0)) >= budgets)
        order = np.lexsort((np.arange(drawn.size), np.where(np.isfinite(seconds), seconds, 0.0)))
        taken = [i for i in order if fits[i]][:view.count]
        if len(taken) < view.least:  # too few fit: the fastest still work (and show their partial work)
            taken += [i for i in order if i not in taken][:view.least - len(taken)]
        return _choice(drawn[taken], drawn, seconds, deadline_among=drawn)


class PowerOfChoice(_FromCandidates):
    """Cho, Wang and Joshi's pi_pow-d: d candidates by weight, the S with the highest local loss F_k(x)."""

    name = "power_of_choice"
    reads_weights = True

    def select(self, view: View) -> Choice:
        p = view.weights / math.fsum(view.weights)
        drawn = draw_candidates(self.seed, view.key, view.members, self.asked(view), p)
        losses = np.asarray(view.losses(np.sort(drawn)), np.float64)[np.argsort(np.argsort(drawn))]
        # highest first (a device that did not answer, NaN, last), then by id
        order = np.lexsort((drawn, -np.nan_to_num(losses, nan=-np.inf, posinf=np.inf, neginf=-np.inf)))
        return _choice(drawn[order[:view.count]], drawn, losses)


def _choice(selected, considered, scores, deadline_among=None) -> Choice:
    at = np.argsort(considered)
    return Choice(np.sort(np.asarray(selected, np.int64)), considered[at], np.asarray(scores, np.float64)[at],
                  deadline_among)


class Oort(Uniform):
    """Lai et al.'s participant selector, its steps in the order of the authors' reference selector (Oort's
    repository; the cut-off at the score ranked just below the exploited count, as there), the pacer as the
    paper's Algorithm 1 (docs/design.md 2.18): state per device (its last statistical utility, NaN until it reported; the last round it took
    part in) and per run (the exploration share, the preferred duration T, each round's summed utility for
    the pacer)."""

    name = "oort"
    reads_losses = True
    reads_speeds = True

    def __init__(self, seed: int, settings, n_train: np.ndarray, rounds: int):
        super().__init__(seed, settings, n_train, rounds)
        s = oort_settings(settings)
        self.alpha, self.decay, self.floor = s.alpha, s.exploration_decay, s.exploration_min
        self.cut_off, self.step, self.preferred_s, self.delta = s.cut_off, s.pacer_step, s.preferred_s, s.pacer_delta
        self.reward = np.full(self.n_train.size, np.nan)
        self.last = np.zeros(self.n_train.size, np.int64)
        self.history = np.zeros(rounds + 1)  # round r's summed statistical utility of the devices taken
        self.scalars = np.array([s.exploration, math.nan, math.nan, 0.0])  # epsilon, T, pacer delta, last round

    @staticmethod
    def slots(n: int, rounds: int) -> tuple:
        return (("oort_reward", (n,), np.float64), ("oort_last", (n,), np.int64),
                ("oort_history", (rounds + 1,), np.float64), ("oort_scalars", (4,), np.float64))

    def values(self) -> dict:
        return {"oort_reward": self.reward.copy(), "oort_last": self.last.copy(), "oort_history": self.history.copy(),
                "oort_scalars": self.scalars.copy()}

    def load(self, values: dict) -> None:
        self.reward, self.last = values["oort_reward"].copy(), values["oort_last"].copy()
        self.history, self.scalars = values["oort_history"].copy(), values["oort_scalars"].copy()

    def _preferred(self, view: View) -> float:
        """T: as set, else the fixed deadline's (the median of the members'), else the members' median
        predicted round, once any is known; the pacer's step a tenth of it unless set."""
        if math.isfinite(self.scalars[1]):
            return float(self.scalars[1])
        if self.preferred_s is not None:
            t = float(self.preferred_s)
        else:
            basis = view.seconds[view.members] if view.deadline_s is None else view.deadline_s[view.members]
            basis = basis[np.isfinite(basis)]
            if basis.size == 0:
                return math.nan
            t = float(np.median(basis))
        self.scalars[1] = t
        self.scalars[2] = t / 10.0 if self.delta is None else float(self.delta)
        return t

    def _pace(self, r: int) -> None:
        """Once 2W rounds have run, every W rounds: T <- T + delta when the last W rounds' utility fell below
        the W before."""
        w = self.step
        if r > 2 * w and (r - 1) % w == 0 and math.isfinite(self.scalars[1]):  # rounds 1..r-1 have run
            earlier = math.fsum(self.history[r - 2 * w:r - w])
            recent = math.fsum(self.history[r - w:r])
            if earlier > recent:
                self.scalars[1] += self.scalars[2]

    def penalty(self, t: np.ndarray, preferred: float) -> np.ndarray:
        """(T / t_k)^alpha where t_k > T, else 1 (unknown t_k or T: 1)."""
        slow = np.isfinite(t) & (t > preferred) if math.isfinite(preferred) else np.zeros(t.size, bool)
        return np.where(slow, (preferred / np.where(slow, t, 1.0)) ** self.alpha, 1.0)

    def scores(self, r: int, members: np.ndarray, seconds: np.ndarray, sizes: np.ndarray, preferred: float):
        """(explored mask, each member's score): explored, the normalized clipped utility plus the staleness
        bonus, penalized; unexplored, its data size, penalized."""
        reward = self.reward[members]
        explored = np.isfinite(reward)
        pool = np.where(explored, reward, sizes[members]).astype(np.float64)  # the reference's moving rewards
        positive = np.sort(pool[pool > 0])
        scores = np.zeros(members.size)
        if positive.size:
            clip = positive[min(int(positive.size * OORT_CLIP), positive.size - 1)]
            low, high = positive[0] * 0.999, positive[-1]
            span = max(high - low, 1e-4)
            bonus = np.sqrt(OORT_STALENESS * math.log(max(r, 1)) / np.maximum(self.last[members], 1))
            scores = np.where(explored, (np.minimum(pool, clip) - low) / span + bonus, pool)
        return explored, np.abs(scores * self.penalty(seconds[members], preferred))

    def select(self, view: View) -> Choice:
        r, members, count = view.round_idx, view.members, view.count
        if r != self.scalars[3]:  # once a round (FedBuff draws a round's tasks one at a time)
            self.scalars[3] = r
            self._pace(r)
            self.scalars[0] = max(self.scalars[0] * self.decay, self.floor)
        preferred = self._preferred(view)
        explored, scores = self.scores(r, members, view.seconds, view.sizes, preferred)
        ex, un = np.flatnonzero(explored), np.flatnonzero(~explored)
        n_exploit = min(count if un.size == 0 else int(count * (1.0 - self.scalars[0])), ex.size)
        picked = []
        if n_exploit > 0:
            ranked = ex[np.lexsort((members[ex], -scores[ex]))]
            cut = scores[ranked[n_exploit]] * self.cut_off if n_exploit < ranked.size else -math.inf
            admitted = ranked[scores[ranked] >= cut]
            picked += list(_weighted(generator(self.seed, Purpose.EXPLOIT, view.key), admitted, scores[admitted], n_exploit))
        n_explore = min(un.size, count - len(picked))
        if n_explore > 0:
            ranked = un[np.lexsort((members[un], -scores[un]))]
            window = ranked[:min(int(OORT_SAMPLE_WINDOW * n_explore), ranked.size)]
            picked += list(_weighted(generator(self.seed, Purpose.EXPLORE, view.key), window, scores[window], n_explore))
        if len(picked) < count:  # nothing left to explore: the rest uniformly among the others
            rest = np.setdiff1d(np.arange(members.size), picked)
            more = generator(self.seed, Purpose.EXPLORE, view.key, 0).choice(rest, size=min(count - len(picked), rest.size),
                                                                     replace=False)
            picked += list(more)
        return Choice(np.sort(members[np.asarray(picked, np.int64)]), members, scores)

    def utility(self, fb: Feedback, sizes: np.ndarray) -> np.ndarray:
        """|B_k| sqrt(sum of squared losses / samples), |B_k| = min(n_k, samples): the reference's bound on the
        distinct samples a device trained on; NaN where it trained on none."""
        samples = fb.samples.astype(np.float64)
        trained = samples > 0
        mean_sq = np.where(trained, fb.loss_sq / np.where(trained, samples, 1.0), np.nan)
        return np.where(trained, np.minimum(sizes[fb.ids], samples) * np.sqrt(mean_sq), np.nan)

    def observe(self, fb: Feedback) -> None:
        """A taken report sets its device's utility; a selected device whose report was not taken (late,
        dropped, nothing done) gets the mean of the round's taken ones, as the reference treats stragglers;
        every selected device's last round becomes this one."""
        u = self.utility(fb, self.n_train)
        ok = fb.taken & np.isfinite(u)
        self.reward[fb.ids[ok]] = u[ok]
        if ok.any():
            self.reward[fb.ids[~ok]] = float(np.mean(u[ok]))
        self.last[fb.ids] = fb.round_idx
        self.history[min(fb.round_idx, self.history.size - 1)] = math.fsum(u[ok])


def _weighted(rng: np.random.Generator, items: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
    """k of items without replacement, each draw in proportion to the weights (uniform when they are all 0)."""
    total = math.fsum(weights)
    p = None if not total > 0 else weights / total
    if p is not None and np.count_nonzero(p) < k:  # fewer weighted than needed: uniformly among all
        p = None
    return rng.choice(items, size=k, replace=False, p=p)


POLICY_CLASSES = {cls.name: cls for cls in (Uniform, FedCS, Oort, PowerOfChoice)}


def build_policy(settings, seed: int, n_train: np.ndarray, rounds: int):
    """The policy a [selection] table names, for a federation with these training sizes and this many rounds."""
    return POLICY_CLASSES[settings.policy](seed, settings, n_train, rounds)
