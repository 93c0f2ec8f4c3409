"""User-level differential privacy for partial work (DP-FedAvg, McMahan et al., ICLR 2018; docs/design.md
2.19), as arithmetic: each applied device's contribution, its rule's multiplier applied first, clipped to
L2 norm C; Gaussian noise N(0, z^2 C^2 I) added to their sum; and the (epsilon, delta) the rounds spend, from
Google's dp-accounting (its RDP accountant over Poisson-sampled Gaussian mechanisms, q = S/N).

With uniform weights (w_k = 1/S) a rule's coefficient is p_k = a_k / S, so the round is
x_r = x_{r-1} + eta_g / S (sum_k clip_C(a_k Delta_k) + N(0, z^2 C^2 I)): one device changes the sum by at
most C whatever its steps, and the noise is z times that sensitivity.

`PrivateUpdate` wraps an algorithm's server update in that arithmetic (NoPrivacy: the update as it is), so
either engine gets it without a branch of its own; `settled` fixes a run's z and delta before round 1.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import numpy as np

from edgefed.algorithms.base import DELTA_X, Algorithm, RoundReports, ServerState
from edgefed.errors import ConfigError
from edgefed.participation.timing import overselected
from edgefed.rng import Purpose, generator

MECHANISMS = ("none", "central", "distributed")
NOISE_SOURCES = ("seeded", "os")


def clip(deltas: np.ndarray, multipliers: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """(the rows scaled so that multiplier_k * row_k has L2 norm at most bound, which rows were cut).

    The norm is taken in float64 of the product a_k Delta_k, the contribution the sum receives; a row is
    scaled by bound / norm when it is longer (so a_k times the new row is exactly on the sphere, up to the
    model dtype's rounding)."""
    products = np.abs(multipliers)[:, None] * deltas.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", products, products))
    cut = norms > bound
    scale = np.where(cut, bound / np.where(cut, norms, 1.0), 1.0)
    return (deltas * scale[:, None]).astype(deltas.dtype), cut


def gaussian(seed: int, round_idx: int, d: int, std: float, source: str, device: int | None = None,
             purpose: Purpose = Purpose.PRIVACY) -> np.ndarray:
    """d draws of N(0, std^2) in float64: from the stream (seed, purpose, round[, device]), or (source "os")
    from the operating system's CSPRNG by the Box-Muller transform of its 53-bit uniforms."""
    if std == 0:
        return np.zeros(d)
    if source == "seeded":
        return std * generator(seed, purpose, round_idx, device).standard_normal(d)
    pairs = (d + 1) // 2
    words = np.frombuffer(os.urandom(16 * pairs), np.uint64).reshape(2, pairs)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0 ** 53  # (0, 1]: the log is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    radius = np.sqrt(-2.0 * np.log(u1))
    out = np.concatenate([radius * np.cos(2 * math.pi * u2), radius * np.sin(2 * math.pi * u2)])
    return std * out[:d]


def update_noise(z: float, sigma_b: float) -> float:
    """Andrew et al.'s z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the updates' noise multiplier that, with the
    count's noise sigma_b (sensitivity 1/2), composes to one Gaussian mechanism of multiplier z."""
    if z == 0:
        return 0.0
    rest = z ** -2 - (2.0 * sigma_b) ** -2
    return rest ** -0.5 if rest > 0 else math.inf


def next_clip(clip_now: float, unclipped: int, count_noise: float, reports: int, target: float, lr: float) -> float:
    """C <- C exp(-eta_C (b - gamma)) with b = (unclipped + noise) / S: geometric steps towards the norm below
    which a share gamma of the updates fall (Andrew et al., NeurIPS 2021)."""
    b = (unclipped + count_noise) / reports
    return clip_now * math.exp(-lr * (b - target))


def sampling_rate(cfg, n_devices: int, recorded: np.ndarray | None = None) -> float:
    """q, the chance a device's data is in one release: the devices a round selects (over-selection's
    whole draw, not its quorum; in a replay the most a recorded round selected, (R, N) `recorded`), or the M
    reports of a FedBuff update, over the N members."""
    if recorded is not None:
        return int(recorded.sum(axis=1).max()) / n_devices
    if cfg.participation.mode == "async":
        return cfg.asynchronous.buffer / n_devices
    count = cfg.clients_per_round_count(n_devices)
    return overselected(count, cfg.participation.overselect, n_devices) / n_devices


def default_delta(n_devices: int) -> float:
    """1 / N^1.1: below 1/N, as user-level DP needs, by the usual margin."""
    return 1.0 / n_devices ** 1.1


def available() -> None:
    """Raise the one-line ConfigError naming the extra when dp-accounting is missing."""
    _accounting()


def _accounting():
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError("config: [privacy] accounts epsilon with Google's dp-accounting, which is not installed: "
                          "pip install 'edgefed[privacy]'") from None
    logging.getLogger("absl").setLevel(logging.ERROR)  # orders that do not converge are left out, said at WARNING
    return dp_accounting


def _event(q: float, z: float, rounds: int):
    dp = _accounting()
    return dp.SelfComposedDpEvent(dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(z)), rounds)


class Accountant:
    """epsilon after r rounds of Poisson-sampled Gaussian mechanisms (rate q, noise multiplier z) at delta,
    by dp-accounting's RDP accountant (DP-FedAvg's convention: the round's selection treated as Poisson
    sampling with q = S/N)."""

    def __init__(self, q: float, z: float, delta: float):
        self.q, self.z, self.delta = q, z, delta
        self._dp = _accounting()
        self._one = None  # (orders, one round's RDP): composing r rounds multiplies it by r

    def epsilon(self, rounds: int) -> float:
        if rounds == 0:
            return 0.0
        if self.z == 0:
            return math.inf
        rdp = self._dp.rdp.rdp_privacy_accountant
        if self._one is None:
            accountant = rdp.RdpAccountant()
            accountant.compose(_event(self.q, self.z, 1))
            # the accountant's RDP per order (computed once: about 65 ms a call here), or None where a release
            # keeps it elsewhere, when every round is composed afresh
            self._one = (getattr(accountant, "_orders", None), getattr(accountant, "_rdp", None))
        orders, one = self._one
        if orders is None or one is None:
            accountant = rdp.RdpAccountant()
            accountant.compose(_event(self.q, self.z, rounds))
            return float(accountant.get_epsilon(self.delta))
        return float(rdp.compute_epsilon(orders, np.asarray(one) * rounds, self.delta)[0])


def noise_for(epsilon: float, delta: float, q: float, rounds: int) -> float:
    """The smallest noise multiplier z whose rounds spend at most epsilon at delta (dp-accounting's
    calibration, to its default tolerance)."""
    dp = _accounting()
    return float(dp.calibrate_dp_mechanism(dp.rdp.RdpAccountant, lambda z: _event(q, z, rounds), epsilon, delta,
                                           dp.LowerEndpointAndGuess(1e-3, 1.0)))


def settled(cfg, n: int, attrs: dict, on_info, recorded: np.ndarray | None = None):
    """The config as run with z and delta settled (z solved for an epsilon target over the planned rounds),
    and the log's attributes that say what the run's epsilon means (recorded: a replayed log's selections,
    whose rate q is the one that was run)."""
    d = cfg.privacy
    available()
    q = sampling_rate(cfg, n, recorded)
    delta = default_delta(n) if d.delta is None else d.delta
    z = d.noise_multiplier if d.epsilon is None else noise_for(d.epsilon, delta, q, cfg.rounds)
    attrs.update(privacy_mechanism=d.mechanism, privacy_noise_multiplier=float(z), privacy_clip=float(d.clip),
                 privacy_delta=float(delta), privacy_sampling_rate=float(q), privacy_noise_source=d.noise_source)
    sigma_b = d.quantile_noise
    if d.adapts:  # the count of unclipped updates is released too: its noise shares the budget
        reports = cfg.asynchronous.buffer if cfg.participation.mode == "async" else cfg.clients_per_round_count(n)
        sigma_b = reports / 20.0 if sigma_b is None else sigma_b
        if not math.isfinite(update_noise(z, sigma_b)):
            raise ConfigError(f"config: privacy.adaptive_clip needs the count's noise 2 sigma_b above z = {z:.4g}, but "
                              f"sigma_b = {sigma_b:g}; raise privacy.quantile_noise or select more devices a round")
        attrs.update(privacy_quantile_noise=float(sigma_b), privacy_update_noise=update_noise(z, sigma_b))
    target = "" if d.epsilon is None else f" (for epsilon {d.epsilon:g} over {cfg.rounds} rounds)"
    on_info(f"privacy: {d.mechanism} noise, z = {z:.4g}{target}, clip C = {d.clip:g}, delta = {delta:.3g}, "
            f"q = {'M' if cfg.participation.mode == 'async' else 'S'}/N = {q:.3g}")
    # as run: z in place of the target (the ranks are sent this config; the log keeps the one given)
    return dataclasses.replace(cfg, privacy=dataclasses.replace(d, noise_multiplier=float(z), epsilon=None,
                                                                delta=float(delta), quantile_noise=sigma_b))


def clip_slots(settings) -> tuple:
    """The resume state privacy keeps, as (name, shape, dtype) slots: adaptive clipping's next C."""
    return (("privacy_clip", (1,), np.float64),) if settings.adapts else ()


class NoPrivacy:
    """A server update as the algorithm makes it: nothing clipped, no noise, no account."""

    slots: tuple = ()  # (name, shape, dtype) of the resume state it keeps (clip_slots)

    def values(self) -> dict:
        return {}

    def load(self, values: dict) -> None:
        pass

    def first_row(self) -> dict:
        """What the log's round 0 says of it."""
        return {}

    def server_update(self, algorithm: Algorithm, state: ServerState, reports: RoundReports, s: int,
                      round_idx: int) -> tuple[ServerState, dict]:
        """(the algorithm's new state, the round's log columns of the privacy it adds); s: the round's fixed
        denominator, p_k = a_k / s."""
        return algorithm.server_update(state, reports), {}


class PrivateUpdate(NoPrivacy):
    """Differential privacy around an algorithm's server update, as Flower wraps a strategy in
    DifferentialPrivacyServerSideFixedClipping. Central noise: each contribution a_k Delta_k (a_k = s p_k) is
    clipped to C before the algorithm's update and x + eta_g / s N(0, z^2 C^2 I) is its result, drawn in
    float64 (with adaptive clipping z_Delta, C next from the noised count of unclipped contributions, Andrew
    et al.); distributed noise (the devices clip and noise what they mask): the account only. Every
    mechanism logs the epsilon spent."""

    def __init__(self, settings, seed: int, n_devices: int, lr_global: float, rate: float):
        """settings: the [privacy] table as run (z settled: settled()); rate: q (sampling_rate)."""
        self.settings, self.seed, self.n_devices, self.lr_global = settings, seed, n_devices, lr_global
        self.central = settings.mechanism == "central"
        self.clip_now = self._clip_used = settings.clip  # the clip C of the next round, and of the one just clipped
        self.accountant = Accountant(rate, settings.noise_multiplier, settings.delta)
        self.slots = clip_slots(settings)

    def values(self) -> dict:
        return {name: np.array([self.clip_now]) for name, _, _ in self.slots}

    def load(self, values: dict) -> None:
        for name, _, _ in self.slots:
            self.clip_now = float(values[name][0])

    def first_row(self) -> dict:
        return {"metrics/epsilon": 0.0}

    def server_update(self, algorithm: Algorithm, state: ServerState, reports: RoundReports, s: int,
                      round_idx: int) -> tuple[ServerState, dict]:
        extra = {}
        if self.central:
            reports, extra = self._clipped(reports, s, round_idx)
        state = algorithm.server_update(state, reports)
        if self.central:
            state = self._noised(state, s, round_idx)
        extra["metrics/epsilon"] = self.accountant.epsilon(round_idx)
        return state, extra

    def _clipped(self, reports: RoundReports, s: int, round_idx: int) -> tuple[RoundReports, dict]:
        """(the reports with each Delta_k scaled so that a_k Delta_k is at most C long; the log's columns of
        who was cut and, with adaptive clipping, the C used), the next C adapted."""
        rows, cut = clip(reports.vectors[DELTA_X], reports.coeffs * s, self.clip_now)
        clipped = np.zeros(self.n_devices, bool)
        clipped[reports.device_ids] = cut & reports.reported
        extra = {"participation/clipped": clipped}
        if self.settings.adapts:
            extra["metrics/privacy_clip"] = self.clip_now
            self._adapt(int(np.count_nonzero(reports.reported & ~cut)), s, round_idx)
        return dataclasses.replace(reports, vectors={**reports.vectors, DELTA_X: rows}), extra

    def _noised(self, state: ServerState, s: int, round_idx: int) -> ServerState:
        d, x = self.settings, state.x
        z = update_noise(d.noise_multiplier, d.quantile_noise) if d.adapts else d.noise_multiplier
        noise = gaussian(self.seed, round_idx, x.size, z * self._clip_used, d.noise_source)
        return ServerState((x.astype(np.float64) + self.lr_global / s * noise).astype(x.dtype), state.vectors)

    def _adapt(self, unclipped: int, s: int, round_idx: int) -> None:
        """The next round's C from this round's noised count of unclipped contributions (Andrew et al.)."""
        d = self.settings
        noise = gaussian(self.seed, round_idx, 1, d.quantile_noise, d.noise_source, purpose=Purpose.PRIVACY_QUANTILE)[0]
        self._clip_used = self.clip_now
        self.clip_now = next_clip(self.clip_now, unclipped, noise, s, d.target_quantile, d.clip_lr)


def around_updates(cfg, n_devices: int, recorded: np.ndarray | None = None) -> NoPrivacy:
    """What wraps a run's server updates: the privacy its config asks for (recorded: as sampling_rate)."""
    d = cfg.privacy
    if d.mechanism == "none":
        return NoPrivacy()
    return PrivateUpdate(d, cfg.seed, n_devices, cfg.train.lr_global, sampling_rate(cfg, n_devices, recorded))
