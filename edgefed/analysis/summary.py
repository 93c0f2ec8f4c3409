"""`edgefed summary`: what a run was and what it reached, as lines for a terminal."""

from __future__ import annotations

import json
import math

import numpy as np

from edgefed.analysis.logs import Run
from edgefed.memory import size_text

DEVICE_ROWS = 1000  # the per-device table lists at most this many devices


def _ids(devices, shown: int = 8) -> str:
    """Device ids, the first few of many ("1, 3, 5, ... 4,093 more")."""
    head = ", ".join(str(k) for k in devices[:shown])
    return head if len(devices) <= shown else f"{head}, ... {len(devices) - shown:,} more"


def _num(value: float, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summary_lines(run: Run, target: float | None = None) -> list[str]:
    lines = [f"{run.path}: {run.status}, {run.rounds} of {run.rounds_planned} rounds; "
             f"{run.attrs.get('problem', '')}; model {run.attrs.get('model', '')}"]
    diffs = run.differences()
    lines.append("config, where it differs from the built-in default:" if diffs else "config: the built-in default")
    lines += [f"  {key} = {value!r}" for key, value in diffs]
    clock = run.clock[-1]
    lines.append(f"test accuracy: final {_num(run.final('test_accuracy'))}, best {_num(run.best('test_accuracy'))}; "
                 f"train loss: final {_num(run.final('train_loss'), '.6g')}; "
                 f"clock {_num(clock, '.3f')} s ({run.attrs.get('clock', 'measured')}), wall {run.wall_s():.2f} s")
    for i, r in enumerate(run.restarts, 1):  # what happened to a board: edgefed launch's restarts
        ended = "ended" if r["cause"].endswith("answered again") else "died"  # (a board taken back)
        lines.append(f"launch restart {i}: the world {ended} after round {r['round']} ({r['time']}): {r['cause']}; "
                     f"ranks {r['ranks_before']} -> {r['ranks_after']}")
    for e in json.loads(str(run.attrs.get("away", "[]"))):  # whose board was out of the world, and when
        until = (f"rounds {e['round']}..{e['back'] - 1}, back in round {e['back']}" if e.get("back") is not None
                 else f"from round {e['round']}, not back")
        lines.append(f"devices away with their board: {len(e['devices'])} ({_ids(e['devices'])}) {until}")
    dropped = run.nonfinite()
    if dropped["reports"] or dropped["no_update"]:
        lines.append(f"non-finite: {dropped['reports']} reports dropped as non-finite (NaN or infinity in the update) "
                     f"in {dropped['rounds']} rounds; {dropped['no_update']} of {run.rounds} rounds applied no update"
                     + (" (the model never moved from x_0)" if dropped["no_update"] == run.rounds else ""))
    part = run.partition()
    if part is not None:
        n, c = part["counts"].shape
        devices = f"{n} devices" if n == part["of"] else f"{n} of {part['of']} devices (the ones built)"
        lines.append(f"partition: {devices} x {c} labels, {part['samples'][0]}..{part['samples'][1]} training "
                     f"samples each; a device holds {part['labels_held']:.1f} of the {c} labels on average; label "
                     f"skew {part['skew']:.2f} (mean total variation from the pooled labels: 0 IID, 1 disjoint)")
    who = run.participation()
    lines.append(f"selection: {who['policy']}; Jain's index of the devices' participation {_num(who['jain'], '.3f')} "
                 f"(1: each as often), {who['never']} of {who['n']} devices never selected")
    up, down = run.bytes_per_round("up"), run.bytes_per_round("down")
    if not math.isnan(up):
        lines.append(f"wire per round: {size_text(up)} up, {size_text(down)} down "
                     f"(uplink {run.config_dict().get('compress', {}).get('uplink', 'none')}, "
                     f"downlink {run.config_dict().get('compress', {}).get('downlink', 'none')})")
    sub = run.widths()
    if sub is not None:
        lines.append(f"submodel {sub['method']}: device-rounds per width " + ", ".join(
            f"{w:g}: {n} ({_num(done, '.0%')} of their steps)" for w, (n, done) in sub["widths"].items()))
    private = run.privacy()
    if private is not None:
        clipped = ("each device clipped its own, unseen" if private["mechanism"] == "distributed" else
                   f"{_num(private['clipped'], '.1%')} of applied contributions clipped")
        lines.append(f"privacy: {private['mechanism']} noise; epsilon {_num(private['epsilon'], '.3f')} at delta "
                     f"{private['delta']:.3g} (z = {private['z']:.4g}, clip C = {private['clip']:g}); {clipped}")
    secure = run.secagg()
    if secure is not None:
        lines.append(f"secure aggregation: {_num(secure['seconds'] * 1e3, '.1f')} ms and "
                     f"{size_text(secure['bytes'])} of protocol per device and round, {secure['aborted']} rounds "
                     f"aborted, {secure['clipped']} coordinates clipped ({secure['keys']} keys)")
    lines += _memory_lines(run.attrs)
    lines += _steps_lines(run)
    energy = run.energy()
    lines += _energy_lines(run, energy)
    if target is not None:
        rounds, seconds = run.to_target(target)
        spent = "" if energy is None else f", energy {_num(run.energy_to_target(target), '.4g')} J"
        lines.append(f"to test accuracy {target:g}: " + ("never reached" if math.isnan(rounds) else
                                                           f"round {rounds:.0f}, clock {seconds:.3f} s{spent}"))
    lines.append("device  selected  fraction  inactive   late  non-finite  cpu %"
                 + ("" if energy is None else "  energy J  J a round"))
    shown = run.most_selected(DEVICE_ROWS)  # a large federation: not a million lines
    devices = run.devices(shown)
    for d, k in zip(devices, shown):
        spent = "" if energy is None else (
            f"  {_num(energy['device'][k], '8.4g'):>8}  "
            f"{_num(_share(energy['device'][k], energy['device_rounds'][k]), '9.4g'):>9}")
        lines.append(f"{d['device']:>6}  {d['selected']:>8}  {_num(d['fraction'], '8.3f'):>8}  "
                     f"{_num(d['inactive'], '8.1%'):>8}  {_num(d['late'], '5.1%'):>5}  {d['nonfinite']:>10}  "
                     f"{_num(d['cpu_percent'], '5.1f'):>5}{spent}")
    if len(devices) < run.attrs["n_devices"]:
        lines.append(f"(the {DEVICE_ROWS} devices selected most of {run.attrs['n_devices']}; edgefed export --csv "
                     "writes every device's rows)")
    return lines


def _share(total: float, rounds: int) -> float:
    return float(total) / rounds if rounds else math.nan


def _energy_lines(run: Run, energy: dict | None) -> list[str]:
    """The run's energy in all and a round, and per board where devices shared boards (a measured run's ranks)."""
    if energy is None:
        return []
    lines = [f"energy (modelled from the boards' [power]): {energy['total']:.4g} J in all, {energy['per_round']:.4g} J "
             "a round" + ("" if energy["boards"] is not None else "; each simulated device is a board of its own")
             + ("; devices on boards without [power] not counted" if energy["partial"] else "")]
    if energy.get("read"):
        read = energy["read"]
        lines.append(f"energy read by the boards' own meters (RAPL, a Pi 5's PMIC; measured): {read['total']:.4g} J over "
                     f"{read['device_rounds']} device-rounds, where the model says {read['modelled']:.4g} J")
    if energy["boards"] and energy["since"]:
        lines.append(f"  per board, rounds {energy['since'] + 1}..{run.rounds} (the last world's boards):")
    for board in energy["boards"] or ():
        devices = f"{board['devices']} device" + ("" if board["devices"] == 1 else "s")
        metered = "" if math.isnan(board["read"]) else f"; its meter read {board['read']:.4g} J"
        lines.append(f"  {_board_name(run, board['board'])}: {devices}, {_num(board['total'], '.4g')} J, "
                     f"{_num(board['per_round'], '.4g')} J a round it worked{metered}")
    return lines


def _board_name(run: Run, b: int) -> str:
    """A real board as the summary names it: its rank and profile (the simulator's: this machine)."""
    device = run.config_dict().get("device", {})
    ranks = len(np.atleast_1d(run.attrs.get("rank_memory_estimate_mb", [0]))) > 1
    profile = device["boards"][b] if b < len(device.get("boards") or ()) else device.get("profile")
    return (f"rank {b + 1}" if ranks else "this machine") + (f" ({profile})" if profile else "")


def _steps_lines(run: Run) -> list[str]:
    """Each real board's steps within the deadlines: what its profile predicts, what it did, the gap."""
    boards = run.board_steps()
    if boards is None:
        return []
    since = run.since_restart()
    rounds = f", rounds {since + 1}..{run.rounds} (the last world's boards)" if since else ""
    return [f"steps within the deadlines, predicted by the boards' profiles and measured{rounds}:"] + [
        f"  {_board_name(run, b['board'])}: predicted {b['predicted']}, measured {b['measured']} "
        f"({_num(b['gap'], '+.1%')})" for b in boards]


def _memory_lines(attrs) -> list[str]:
    """Each rank's measured peak beside the run's estimate for it and what its board leaves it."""
    estimate = np.asarray(attrs.get("rank_memory_estimate_mb", []), np.float64)
    if not estimate.size:
        return []  # a log from before ranks' memory was kept
    peak = np.asarray(attrs.get("rank_peak_rss_mb", np.full(estimate.size, np.nan)), np.float64)
    board = np.asarray(attrs.get("rank_board_memory_mb", np.full(estimate.size, np.nan)), np.float64)
    cells = []
    for r in range(estimate.size):
        got = "peak not known (the run did not complete, or the rank never reported)" if r >= peak.size or \
            math.isnan(peak[r]) else f"peak {peak[r]:.0f} MB"
        fits = "" if r >= board.size or math.isnan(board[r]) else f", its board leaves {board[r]:.0f} MB"
        cells.append(f"rank {r} {got} (estimated {estimate[r]:.0f} MB{fits})")
    return [f"memory: {'; '.join(cells)}"]
