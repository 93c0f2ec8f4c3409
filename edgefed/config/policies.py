"""The checks of the policies a run's rounds follow, beside validation.py's of what is trained on what:
client selection, differential privacy, FedBuff, secure aggregation and update compression."""

from __future__ import annotations

import dataclasses
import math

from edgefed import compression
from edgefed.config.checks import choice, positive
from edgefed.config.schema import CompressConfig, Config, DataConfig, ParticipationConfig, SelectionConfig, TrainConfig
from edgefed.errors import ConfigError
from edgefed.participation import asynchrony, privacy, schemes
from edgefed.participation.selection import OORT_DEFAULTS, POLICIES, oort_settings
from edgefed.participation.timing import overselected
from edgefed.secagg import crypto as secagg_crypto
from edgefed.secagg import fixedpoint
from edgefed.secagg import protocol as secagg_protocol

ASYNC_ALGORITHMS = ("fedavg", "fedprox")


def validate_privacy(cfg: Config, p: ParticipationConfig, t: TrainConfig) -> None:
    d = cfg.privacy
    choice(d.mechanism, privacy.MECHANISMS, "privacy.mechanism")
    choice(d.noise_source, privacy.NOISE_SOURCES, "privacy.noise_source")
    positive(d.clip, "privacy.clip", "clip = 1.0")
    if d.noise_multiplier is not None and not (d.noise_multiplier >= 0 and math.isfinite(d.noise_multiplier)):
        raise ConfigError(f"config: privacy.noise_multiplier = {d.noise_multiplier} must be a finite number >= 0")
    if d.epsilon is not None:
        positive(d.epsilon, "privacy.epsilon", "epsilon = 8.0")
    if not 0 < d.target_quantile < 1:
        raise ConfigError(f"config: privacy.target_quantile = {d.target_quantile} must lie in (0, 1) (Andrew et al.: "
                          "0.5, the median update norm)")
    positive(d.clip_lr, "privacy.clip_lr", "clip_lr = 0.2")
    if d.quantile_noise is not None:
        positive(d.quantile_noise, "privacy.quantile_noise", "quantile_noise = 1.5")
    if d.adaptive_clip and d.mechanism == "distributed":
        raise ConfigError("config: privacy.adaptive_clip with mechanism = \"distributed\" would need the count of "
                          "unclipped updates summed securely too; use mechanism = \"central\" or a fixed clip")
    if d.delta is not None and not 0 < d.delta < 1:
        raise ConfigError(f"config: privacy.delta = {d.delta} must lie in (0, 1) (e.g. 1e-5, below 1 / N)")
    if d.mechanism == "none":
        return
    if d.mechanism == "distributed" and not cfg.secagg.enabled:
        raise ConfigError('config: privacy.mechanism = "distributed" has each device add its share of the noise '
                          'before secure aggregation masks it: set [secagg] enabled = true (or use "central")')
    if (d.noise_multiplier is None) == (d.epsilon is None):
        raise ConfigError("config: [privacy] needs exactly one of noise_multiplier (z) and epsilon (a target over "
                          "the planned rounds, which sets z)")
    clash = [(key, why) for key, used, why in (
        ('train.algorithm = "scaffold"', t.algorithm == "scaffold",
         "its control variates are a second sum the clip does not bound"),
        ("[secagg] enabled = true", cfg.secagg.enabled and d.mechanism == "central",
         'the coordinator sees only the masked sum and cannot clip a device\'s part: use mechanism = '
         '"distributed"'),
    ) if used]
    if clash:
        key, why = clash[0]
        raise ConfigError(f"config: [privacy] mechanism = {d.mechanism!r} does not take {key}: {why}")


# each policy's own parameters
POLICY_KEYS = {"uniform": (), "fedcs": ("candidates",), "power_of_choice": ("candidates",),
               "oort": tuple(OORT_DEFAULTS) + ("preferred_s", "pacer_delta")}


def validate_selection(s: SelectionConfig, p: ParticipationConfig, t: TrainConfig, n: int | None,
                        cfg_secagg: bool) -> SelectionConfig:
    choice(s.policy, POLICIES, "selection.policy")
    for key in POLICY_KEYS["oort"] + ("candidates",):
        if getattr(s, key) is not None and key not in POLICY_KEYS[s.policy]:
            owners = " and ".join(repr(name) for name, keys in POLICY_KEYS.items() if key in keys)
            raise ConfigError(f"config: selection.{key} is a parameter of policy {owners}, not of {s.policy!r}; "
                              "remove it or choose that policy")
    replay = p.mode == "trace" and isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5"))
    deadline = p.mode == "deadline" or (p.mode == "async" and p.deadline_s is not None)
    if s.policy == "fedcs" and not deadline and not replay:  # a replay takes the logged selection
        raise ConfigError('config: selection.policy = "fedcs" takes the devices whose work fits the deadline: set '
                          'participation.mode = "deadline" (or "async") and participation.deadline_s')
    if s.policy in ("oort", "power_of_choice") and cfg_secagg:
        raise ConfigError(f"config: selection.policy = {s.policy!r} reads each device's training loss in the clear, "
                          "which [secagg] exists to hide; use \"uniform\" or \"fedcs\" (speeds only) with secure "
                          "aggregation")
    if s.candidates is not None:
        positive(s.candidates, "selection.candidates", "candidates = 20")
        if n is not None and s.candidates > n:
            raise ConfigError(f"config: selection.candidates = {s.candidates} exceeds the {n} devices (data.clients)")
        count = t.clients_per_round
        if isinstance(count, int) and s.candidates < overselected(count, p.overselect, math.inf):
            count = overselected(count, p.overselect, math.inf)
            raise ConfigError(f"config: selection.candidates = {s.candidates} is fewer than the {count} devices a "
                              "round selects (train.clients_per_round, and participation.overselect's more); "
                              f"ask at least {count}")
    if s.policy != "oort":
        return s
    checked, s = s, oort_settings(s)  # the values as run; the config keeps what was set
    if not (s.alpha >= 0 and math.isfinite(s.alpha)):
        raise ConfigError(f"config: selection.alpha = {s.alpha} must be a finite number >= 0 (Oort's: 2)")
    for key in ("exploration", "exploration_min"):
        if not 0 <= getattr(s, key) <= 1:
            raise ConfigError(f"config: selection.{key} = {getattr(s, key)} must lie in [0, 1] (a share of S)")
    for key in ("exploration_decay", "cut_off"):
        if not 0 < getattr(s, key) <= 1:
            raise ConfigError(f"config: selection.{key} = {getattr(s, key)} must lie in (0, 1] (Oort's: "
                              f"{OORT_DEFAULTS[key]})")
    if s.exploration_min > s.exploration:
        raise ConfigError(f"config: selection.exploration_min = {s.exploration_min} exceeds selection.exploration "
                          f"= {s.exploration}; the share only decays to its floor")
    positive(s.pacer_step, "selection.pacer_step", "pacer_step = 20")
    if s.preferred_s is not None:
        positive(s.preferred_s, "selection.preferred_s", "preferred_s = 30.0")
    if s.pacer_delta is not None and not (s.pacer_delta >= 0 and math.isfinite(s.pacer_delta)):
        raise ConfigError(f"config: selection.pacer_delta = {s.pacer_delta} must be a finite number of seconds >= 0")
    return checked


def validate_async(cfg: Config, data: DataConfig, train: TrainConfig, compress: CompressConfig) -> None:
    a = cfg.asynchronous
    positive(a.concurrency, "async.concurrency", "concurrency = 10")
    positive(a.buffer, "async.buffer", "buffer = 5")
    choice(a.staleness, asynchrony.STALENESS, "async.staleness")
    if not (a.staleness_exponent >= 0 and math.isfinite(a.staleness_exponent)):
        raise ConfigError(f"config: async.staleness_exponent = {a.staleness_exponent} must be a finite number >= 0")
    if a.max_staleness < 0:
        raise ConfigError(f"config: async.max_staleness = {a.max_staleness} must be at least 0")
    if cfg.participation.mode != "async":
        return
    if train.algorithm not in ASYNC_ALGORITHMS:
        raise ConfigError(f'config: participation.mode = "async" runs FedBuff over FedAvg or FedProx local updates, '
                          f'not {train.algorithm!r} (SCAFFOLD\'s controls need synchronous rounds); set '
                          'train.algorithm = "fedavg" or "fedprox"')
    p = cfg.participation
    clash = [(key, fix) for key, used, fix in (
        ("dynamics.arrive/depart", cfg.dynamics.arrive or cfg.dynamics.depart, "remove them"),
        ("participation.overselect", p.overselect > 0, "remove it"),
        ('participation.deadline_covers = "round"', p.deadline_covers == "round", "remove it (a task's deadline "
                                                                                   "bounds its local work)"),
        ('train.lr_schedule = "staircase"', train.lr_schedule == "staircase", "remove it (it counts rounds)"),
        ("compress.downlink", compress.downlink != "none", "remove it"),
        ("compress.error_feedback", compress.error_feedback, "set compress.error_feedback = false"),
        ("[[fault]]", bool(cfg.fault), "remove them")) if used]
    if clash:
        key, fix = clash[0]
        raise ConfigError(f'config: participation.mode = "async" does not take {key} yet; {fix}, or run '
                          'synchronous rounds')
    n = data.clients
    for key, value in (("concurrency", a.concurrency), ("buffer", a.buffer)):
        if n is not None and value > n:
            raise ConfigError(f"config: async.{key} = {value} exceeds the {n} devices (data.clients)")


def validate_secagg(cfg: Config, train: TrainConfig, compress: CompressConfig) -> None:
    s = cfg.secagg
    choice(s.bits, fixedpoint.BITS, "secagg.bits")
    positive(s.clip, "secagg.clip", "clip = 10.0")
    choice(s.key_source, secagg_protocol.KEY_SOURCES, "secagg.key_source")
    if s.neighbours is not None and s.neighbours < 1:
        raise ConfigError(f"config: secagg.neighbours = {s.neighbours} must be at least 1")
    if s.threshold is not None and s.threshold < 2:
        raise ConfigError(f"config: secagg.threshold = {s.threshold} would let one device's shares unmask its own "
                          "update; use at least 2")
    shares = None if s.neighbours is None else secagg_protocol.degree(s.neighbours) + 1
    if shares is not None and s.threshold is not None and s.threshold > shares:
        raise ConfigError(f"config: secagg.threshold = {s.threshold} exceeds the {shares} shares a device makes "
                          f"(its {shares - 1} neighbours, secagg.neighbours rounded up to even, and itself); "
                          f"use at most {shares}")
    if not s.enabled:
        return
    if train.clients_per_round == 1:
        raise ConfigError("config: [secagg] enabled = true with train.clients_per_round = 1 would show the one "
                          "device's update (every round would be aborted); select at least 2")
    if train.algorithm == "scaffold":
        raise ConfigError('config: [secagg] enabled = true sums one vector, x\'s update; SCAFFOLD\'s controls '
                          'need a second sum with weights of their own; set train.algorithm = "fedavg" or "fedprox"')
    p = cfg.participation
    clash = [(key, fix) for key, used, fix in (
        ('participation.mode = "async"', p.mode == "async", "run synchronous rounds"),
        ("compress.uplink", compress.uplink != "none", 'set compress.uplink = "none" (a masked update looks '
                                                      "random: nothing to compress)"),
        ("participation.scheme = " + repr(p.scheme), p.scheme not in schemes.DEVICE_MULTIPLIERS,
         "choose a rule a device can pre-scale its update for")) if used]
    if clash:
        key, fix = clash[0]
        raise ConfigError(f"config: [secagg] enabled = true does not take {key}; {fix}, or disable [secagg]")
    secagg_crypto.available()


def validate_compress(c: CompressConfig) -> CompressConfig:
    choice(c.uplink, compression.KINDS, "compress.uplink")
    choice(c.downlink, compression.KINDS, "compress.downlink")
    if not 0 < c.topk_fraction <= 1:
        raise ConfigError(f"config: compress.topk_fraction = {c.topk_fraction} must lie in (0, 1] "
                          "(the share of coordinates a top-k message keeps, e.g. 0.01)")
    if c.error_feedback is None:
        return dataclasses.replace(c, error_feedback=c.uplink in compression.LOSSY)
    if c.error_feedback and c.uplink not in compression.LOSSY:
        raise ConfigError(f'config: compress.error_feedback = true needs a lossy compress.uplink (fp16, int8, topk), '
                          f'not {c.uplink!r}; remove error_feedback or choose an uplink')
    return c


SUBMODEL_METHODS = ("none", "heterofl", "fjord")
DEFAULT_WIDTHS = (0.25, 0.5, 1.0)


def validate_submodel(cfg: Config, train: TrainConfig, compress: CompressConfig):
    """[submodel] checked against the run it joins; returns it with its widths and assignment resolved (the
    layer list is narrowed, and refused where it cannot be, when the model is built)."""
    s = cfg.submodel
    if s.method is None:
        given = [key for key in ("widths", "assign") if getattr(s, key) is not None]
        if given:
            raise ConfigError(f"config: submodel.{given[0]} is set but submodel.method is not; set method = "
                              '"heterofl" or "fjord", or remove [submodel]')
        return s
    choice(s.method, SUBMODEL_METHODS, "submodel.method")
    if not s.enabled:  # (inert, as [privacy] mechanism = "none": a sweep switches submodels off)
        return s
    widths = DEFAULT_WIDTHS if s.widths is None else s.widths
    if not widths:
        raise ConfigError("config: submodel.widths is empty; give the widths devices train, e.g. widths = "
                          "[0.25, 0.5, 1.0]")
    for w in widths:
        if not 0.0 < w <= 1.0:
            raise ConfigError(f"config: submodel.widths holds {w}; a width is a fraction of a hidden layer's units "
                              "in (0, 1], e.g. widths = [0.25, 0.5, 1.0]")
    if any(b <= a for a, b in zip(widths, widths[1:])):
        raise ConfigError(f"config: submodel.widths = {list(widths)} must ascend, each width once "
                          f"(e.g. {sorted(set(widths))})")
    if widths[-1] != 1.0:
        raise ConfigError(f"config: submodel.widths = {list(widths)} must end with 1.0: the metrics evaluate the "
                          "whole model, whose units past the widest width nobody would train")
    assign = "speed" if s.assign is None else s.assign
    if isinstance(assign, str):
        choice(assign, ("speed",), "submodel.assign")
    else:
        n = cfg.data.clients
        if n is not None and len(assign) != n:
            raise ConfigError(f"config: submodel.assign lists {len(assign)} widths for {n} devices; give one a "
                              'device, or assign = "speed"')
        bad = next((w for w in assign if w not in widths), None)
        if bad is not None:
            raise ConfigError(f"config: submodel.assign holds {bad}, which is not one of submodel.widths "
                              f"{list(widths)}")
    p = cfg.participation
    clash = [(key, fix) for key, used, fix in (
        ('model.kind = "torch"', cfg.model.kind == "torch", "slice a layer list (a sequential or built-in model); "
                                                            "a PyTorch module's units cannot be told apart"),
        ('model.kind = "quadratic"', cfg.model.kind == "quadratic", "use a model with hidden layers"),
        ('train.algorithm = "scaffold"', train.algorithm == "scaffold",
         'use "fedavg" or "fedprox" (SCAFFOLD\'s controls are whole-model vectors kept per device)'),
        ("compress.uplink", compress.uplink != "none", 'set compress.uplink = "none" (a submodel already sends '
                                                      "its slice alone)"),
        ("compress.downlink", compress.downlink != "none", 'set compress.downlink = "none"'),
        ('participation.mode = "async"', p.mode == "async", "run synchronous rounds"),
        ("[privacy]", cfg.privacy.mechanism != "none", "remove [privacy] (a coordinate's holders differ, and so "
                                                       "would its sensitivity)")) if used]
    if clash:
        key, fix = clash[0]
        raise ConfigError(f"config: [submodel] cannot run with {key}; {fix}")
    return dataclasses.replace(s, widths=tuple(widths), assign=assign)
