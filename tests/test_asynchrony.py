"""FedBuff's rule and schedule as arithmetic (edgefed/participation/asynchrony.py): the weights, the
coefficients through FedAvg's server update, and the schedule's invariants on random clusters."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.algorithms.fedavg import server_update
from edgefed.participation.asynchrony import Schedule, buffer_coefficients, staleness_weights


def test_staleness_weights_and_the_buffered_update_by_hand():
    assert staleness_weights([0, 3, 8], "constant").tolist() == [1.0, 1.0, 1.0]
    np.testing.assert_allclose(staleness_weights([0, 3, 8], "polynomial", 0.5), [1.0, 0.5, 1 / 3], rtol=1e-15)
    np.testing.assert_allclose(staleness_weights([1], "polynomial", 2.0), [0.25], rtol=1e-15)
    with pytest.raises(ValueError, match="unknown staleness rule 'linear'"):
        staleness_weights([0], "linear")
    # x_t = x + eta_g sum (w(tau_k)/M) Delta_k: M = 2, taus 0 and 3, polynomial a = 0.5, eta_g = 1
    coeffs = buffer_coefficients(np.array([3, 0]), 2, "polynomial")
    deltas = np.array([[3.0, 0.0], [1.0, 2.0]], np.float32)
    x = server_update(np.zeros(2, np.float32), np.array([4, 1]), deltas, coeffs, 1.0)
    assert x.tolist() == [1.25, 1.0]


def _run(seed, speeds, concurrency, buffer, max_staleness, updates):
    schedule = Schedule(seed, concurrency, buffer, max_staleness, lambda k: (10, 10 * speeds[k] + 0.5))
    members = np.arange(len(speeds))
    schedule.fill(members)
    return [schedule.next_update(members) for _ in range(updates)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=3, max_size=12), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 4), st.integers(0, 2**32))
def test_the_schedule_keeps_fedbuffs_invariants(speeds, concurrency, buffer, max_staleness, seed):
    n = len(speeds)
    concurrency = min(concurrency, n - 1)
    buffer = min(buffer, n - concurrency if concurrency < n else 1, concurrency)
    buffer = max(buffer, 1)
    updates = _run(seed, speeds, concurrency, buffer, max_staleness, 15)
    last = 0.0
    for t, update in enumerate(updates, start=1):
        devices = [task.device for task in update.taken]
        assert update.version == t and len(devices) == buffer and len(set(devices)) == buffer
        tau = update.staleness()
        assert (tau >= 0).all() and (tau <= max_staleness).all()
        assert all(t - 1 - task.version > max_staleness for task in update.discarded)
        arrivals = sorted(update.taken + update.discarded)  # reports are taken in arrival order
        assert arrivals[0].finish_s >= last and update.time_s == update.taken[-1].finish_s
        last = update.time_s
        for task in update.taken:  # a task's time is its device's
            assert task.finish_s - task.start_s == pytest.approx(10 * speeds[task.device] + 0.5)
    again = _run(seed, speeds, concurrency, buffer, max_staleness, 15)
    assert [(u.taken, u.discarded) for u in again] == [(u.taken, u.discarded) for u in updates]


def test_fast_devices_report_more_often_and_draws_are_uniform_over_the_idle():
    speeds = [0.1] * 5 + [1.0] * 5  # five fast, five slow boards: a slow one is busy (not idle, not drawn)
    updates = _run(7, speeds, 4, 2, 100, 400)  # seven times as long, so fewer of its reports come
    counts = np.bincount([task.device for u in updates for task in u.taken], minlength=10)
    assert counts[:5].sum() > 1.5 * counts[5:].sum()
    # equal boards: each device drawn about equally often
    updates = _run(8, [1.0] * 6, 3, 1, 100, 600)
    counts = np.bincount([task.device for u in updates for task in u.taken], minlength=6)
    assert counts.min() > 0.8 * counts.mean()
    staleness = np.concatenate([u.staleness() for u in updates])
    assert staleness.max() >= 1 and staleness.min() == 0  # concurrency 3, buffer 1: some reports are stale


def test_a_stale_report_is_discarded_and_its_slot_starts_again():
    # one very slow board among fast ones, buffer 1: its reports are many versions old when they come
    updates = _run(3, [0.01, 0.01, 0.01, 1.0], 4, 1, 2, 200)
    dropped = [task for u in updates for task in u.discarded]
    assert dropped and all(task.device == 3 for task in dropped)
    assert all(3 not in [task.device for task in u.taken] for u in updates)


def test_an_idle_draw_is_the_choice_among_the_idle_members_without_listing_them():
    """draw_idle steps past the busy members by search (FedBuff at ten million devices): the same device as
    NumPy's choice over the list of idle members, which it no longer builds."""
    from edgefed.participation.asynchrony import draw_idle, idle_members
    from edgefed.rng import Purpose, generator

    g = np.random.default_rng(1)
    for trial in range(200):
        members = np.sort(g.choice(200, size=g.integers(1, 60), replace=False))
        busy = set(g.choice(220, size=g.integers(0, 40), replace=False).tolist())
        idle = np.array([k for k in members if int(k) not in busy], np.int64)
        assert np.array_equal(idle_members(members, busy), idle)
        want = None if idle.size == 0 else int(generator(7, Purpose.ASYNC_SELECT, trial).choice(idle))
        assert draw_idle(7, trial, members, busy) == want
