"""The MPI wire format in one process: every record written by one side and read by the other, and the
coordinator, device servers and rank roles run over an in-process world (tests/loopback_mpi.py)."""

import math

import numpy as np
import pytest

from edgefed.orchestration import ranks
from edgefed.orchestration import run as runs
from edgefed.runlog import read_run
from edgefed.runtime.mpi import protocol
from edgefed.runtime.mpi.protocol import Wire
from edgefed.transport import Evaluation, LocalResults, RoundPlan
from conftest import config_with
from helpers import assert_same_logs, compared, run_until
from loopback_mpi import World


def test_a_round_plan_reaches_each_rank_as_its_own_share():
    wire = Wire(6, 3, np.float32, ("delta_x", "delta_c"), server=("c",), device=("c_clients",))
    plan = RoundPlan(7, np.array([1, 2, 4]), np.array([10, 20, 30], np.int32), 0.125,
                     steps=np.array([3, 0, 30], np.int32), deadline_s=np.array([0.5, 0.25, 2.0]), grace_s=1.5)
    buf = wire.command_buffer()
    wire.encode_command(buf, protocol.ROUND, plan, accepted=(6, np.array([4, 0])))
    received = wire.command_buffer()  # as the bytes arrive: the head, then the body the head sizes
    received.head.view(np.uint8)[:] = buf.head.view(np.uint8)
    received.body()[:] = buf.body()
    assert received.body().size == 3 * protocol.COMMAND_ENTRY.itemsize + 2 * 8  # the round's devices, not N's
    assert int(received["command"]) == protocol.ROUND
    assert wire.accepted(received)[0] == 6 and wire.accepted(received)[1].tolist() == [0, 4]
    mine = wire.decode_plan(received, np.array([0, 2, 4, 5]))  # this rank hosts devices 0, 2, 4, 5
    assert (mine.round_idx, mine.lr, mine.grace_s) == (7, 0.125, 1.5)
    assert mine.device_ids.tolist() == [2, 4] and mine.budgets.tolist() == [20, 30]
    assert mine.steps.tolist() == [0, 30] and mine.deadline_s.tolist() == [0.25, 2.0]
    assert wire.decode_plan(received, np.array([0, 3, 5])) is None  # nobody of this rank was selected
    full = RoundPlan(8, np.array([5]), np.array([10], np.int32), 0.1)  # full mode: no trace, no deadline
    wire.encode_command(buf, protocol.ROUND, full)
    again = wire.decode_plan(buf, np.arange(6))
    assert again.steps is None and again.deadline_s is None and wire.accepted(buf) is None
    wire.encode_command(buf, protocol.PROBE, devices=np.array([4, 1]))  # in any order: addressed ascending
    assert wire.addressed(buf, np.array([0, 1, 2, 4])).tolist() == [1, 4] and not wire.addressed(buf, np.array([3])).size
    wire.encode_command(buf, protocol.STOP)
    assert buf.body().size == 0  # nothing follows the head


def _results(n, d, late=()):
    g = np.random.default_rng(n)
    vectors = {"delta_x": g.normal(size=(n, d)).astype(np.float32), "delta_c": g.normal(size=(n, d)).astype(np.float32)}
    late_mask = np.isin(np.arange(n), late)
    return LocalResults(vectors, np.arange(1, n + 1, dtype=np.int32), np.full(n, 0.5, np.float32),
                        np.full(n, 90.0, np.float32), late_mask, np.full(n, 1500.0, np.float32),
                        np.full(n, 48.5, np.float32), np.array([True] + [False] * (n - 1)), np.full(n, np.nan),
                        np.full(n, np.nan, np.float32), np.arange(n, dtype=np.int16) + 2, np.full(n, np.nan, np.float32))


def test_work_reports_come_back_in_plan_order_and_a_silent_device_is_late():
    wire = Wire(8, 4, np.float32, ("delta_x", "delta_c"))
    plan = RoundPlan(3, np.array([1, 3, 5, 6]), np.full(4, 9, np.int32), 0.1)
    # rank A ran devices 5 and 1 (in that order), rank B ran 6 (late); device 3's rank never answered
    a, b = _results(2, 4), _results(1, 4, late=(0,))
    ra, rb = np.zeros(2, wire.work), np.zeros(1, wire.work)
    wire.pack_work(ra, 3, np.array([5, 1]), a, wait_s=np.array([0.0, 0.125]))  # device 1 waited for device 5
    wire.pack_work(rb, 3, np.array([6]), b)
    res = wire.unpack_work(plan, [ra, rb], arrivals=[0.75, 2.0])
    assert res.steps.tolist() == [2, 0, 1, 0] and res.late.tolist() == [False, True, False, True]
    assert res.finish_s[[0, 2]].tolist() == [0.75, 0.75] and np.isnan(res.finish_s[1]) and res.finish_s[3] == 2.0
    np.testing.assert_allclose(res.comm_s[[0, 2, 3]], [0.25, 0.25, 1.5])  # arrival less the work's 0.5 s
    np.testing.assert_allclose(res.link_s[[0, 2, 3]], [0.125, 0.25, 1.5])  # and less the wait on the rank
    assert res.core.tolist() == [3, -1, 2, 2]
    np.testing.assert_array_equal(res.vectors["delta_x"][0], a.vectors["delta_x"][1])
    np.testing.assert_array_equal(res.vectors["delta_c"][2], a.vectors["delta_c"][0])
    assert not res.vectors["delta_x"][[1, 3]].any()  # late and silent devices bring no update
    assert res.compiled.tolist() == [False, False, True, True]
    assert res.cpu_freq_mhz[0] == 1500.0 and math.isnan(res.elapsed_s[1]) and res.temperature_c[2] == 48.5
    couldnt_start = np.zeros(1, wire.work)
    wire.pack_work(couldnt_start, 3, np.array([3]), None)
    assert wire.unpack_work(plan, [couldnt_start]).late.tolist() == [True, True, True, True]


def test_evaluations_and_device_vectors_round_trip():
    wire = Wire(5, 3, np.float64, ("delta_x",), device=("c_clients", "h"))
    evaluated = np.zeros(2, wire.evaluation)
    wire.pack_evaluation(evaluated, Evaluation(np.array([1, 4]), np.array([1.0, 4.0]), np.array([2.0, 8.0]),
                                               np.array([3, 12]), np.full(2, 10)))
    none = np.zeros(1, wire.evaluation)  # a rank that evaluates no device still reports (its memory)
    wire.pack_evaluation(none, Evaluation(*(np.zeros(0, np.int64),) * 5))
    other = np.zeros(1, wire.evaluation)
    wire.pack_evaluation(other, Evaluation(np.array([2]), np.array([2.0]), np.array([4.0]), np.array([6]), np.full(1, 10)))
    back = wire.unpack_evaluation([evaluated, none, other])
    assert back.ids.tolist() == [1, 2, 4] and back.train_loss.tolist() == [1.0, 2.0, 4.0]
    assert back.test_correct.tolist() == [3, 6, 12] and back.n_test.tolist() == [10, 10, 10]
    assert back.rows(np.array([2, 4])).tolist() == [1, 2]
    rows = {"c_clients": np.arange(6.0).reshape(2, 3), "h": -np.arange(6.0).reshape(2, 3)}
    records = np.zeros(2, wire.rows)
    wire.pack_rows(records, np.array([3, 0]), rows)
    got = wire.unpack_rows([records], np.array([0, 3]))
    np.testing.assert_array_equal(got["c_clients"], rows["c_clients"][::-1])
    np.testing.assert_array_equal(got["h"], rows["h"][::-1])


def test_the_server_state_travels_as_rows_in_declaration_order():
    wire = Wire(2, 3, np.float32, ("delta_x",), server=("c", "m"))
    buf = wire.state_buffer()
    wire.pack_state(buf, np.ones(3, np.float32), {"m": np.full(3, 3.0, np.float32), "c": np.full(3, 2.0, np.float32)})
    x, vectors = wire.unpack_state(np.frombuffer(buf.tobytes(), np.float32).reshape(3, 3))
    assert x.tolist() == [1, 1, 1] and vectors["c"].tolist() == [2, 2, 2] and vectors["m"].tolist() == [3, 3, 3]
    wire.pack_state(buf, np.zeros(3, np.float32))  # evaluation: x alone, the rest zeroed
    assert not buf.any()


def loopback_run(cfg, path, size, on_info=None, resume_point=None):
    """A distributed run with `size` ranks as threads of this process; returns the log."""
    errors = []
    mains = {0: lambda comm: ranks.run_coordinator(comm, lambda: (cfg, resume_point, path), False, None,
                                                   on_info or (lambda line: None), errors.append)}
    mains.update({r: ranks.run_device_rank for r in range(1, size)})
    results = World(size).run(mains)
    assert not errors, errors
    assert all(results[r] == 0 for r in range(1, size))
    return read_run(path)


SMALL = {"rounds": 5, "data.clients": 7, "data.samples": "pareto", "train.clients_per_round": 4,
         "train.local_steps": 6}
SCAFFOLD = {**SMALL, "train.algorithm": "scaffold", "scaffold.option": "I", "scaffold.init": "gradient",
            "participation.mode": "trace", "participation.trace": "builtin", "participation.scheme": "C",
            "dynamics.fast_reboot": True, "dynamics.arrive": [{"device": 1, "round": 3}],
            "dynamics.depart": [{"device": 3, "round": 4}], "log.client_controls": True}


ZERO_START = {**SCAFFOLD, "scaffold.option": "II", "scaffold.init": "zero"}  # controls held sparse, arrivals too


@pytest.mark.parametrize("overrides,size", [(SMALL, 2), (SMALL, 4), (SMALL, 5), (SCAFFOLD, 3), (ZERO_START, 3)])
def test_ranks_over_the_loopback_world_write_the_simulators_bytes(tmp_path, overrides, size):
    cfg = config_with(overrides)
    runs.run(cfg, tmp_path / "sim.h5")
    lines = []
    mpi = loopback_run(cfg, tmp_path / "mpi.h5", size, lines.append)
    assert f"MPI: {size - 1} device ranks" in lines[-1]
    sim = read_run(tmp_path / "sim.h5")
    assert compared(mpi).keys() == compared(sim).keys()
    assert [k for k, v in compared(sim).items() if v.tobytes() != mpi[k].tobytes()] == []


@pytest.mark.parametrize("size,device_ranks", [(3, None), (5, [1, 1, 2, 2, 3, 3, 1])])
def test_a_run_stopped_in_one_process_resumes_across_ranks(tmp_path, size, device_ranks):
    """--resume under MPI sends every device its vectors back (rank 4 of 5 hosts none)."""
    overrides = {**SCAFFOLD, "rounds": 6}
    if device_ranks:
        overrides["mpi.device_ranks"] = device_ranks
    cfg = config_with(overrides)
    runs.run(cfg, tmp_path / "whole.h5")
    point = run_until(cfg, tmp_path / "part.h5", 3)  # stopped just after the arrival of device 1
    resumed = loopback_run(cfg, tmp_path / "part.h5", size, resume_point=point)
    assert_same_logs(read_run(tmp_path / "whole.h5"), resumed)



def test_secure_aggregation_over_the_loopback_world_sends_only_masked_inputs(tmp_path, monkeypatch):
    """OS keys, SecAgg+ with k = 2, Scheme C on traces: the simulator's bytes, and what rank 0 takes from the
    wire is masked inputs (the model's d words and a clip count), never a report vector."""
    pytest.importorskip("cryptography")
    from edgefed.runtime.mpi.coordinator import MpiTransport

    cfg = config_with({**SMALL, "secagg.enabled": True, "secagg.neighbours": 2, "participation.mode": "trace",
                       "participation.trace": "builtin", "participation.scheme": "C"})
    runs.run(cfg, tmp_path / "sim.h5")
    seen, work = [], MpiTransport.local_work
    monkeypatch.setattr(MpiTransport, "local_work", lambda self, *a: seen.append(work(self, *a)) or seen[-1])
    mpi = loopback_run(cfg, tmp_path / "mpi.h5", 4)
    sim = read_run(tmp_path / "sim.h5")
    assert [k for k, v in compared(sim).items() if v.tobytes() != mpi[k].tobytes()] == []
    assert len(seen) == 5 and all(r.vectors == {} and r.masked.shape == (4, 611) for r in seen)
    sel, survived = mpi["participation/selected"], mpi["participation/steps"] > 0
    sent = mpi["participation/secagg_bytes"]
    assert (sent[sel & survived] == 104 + 2 * 168 + 3 * 88).all()  # keys, 2 sealed shares, 3 reveals
    assert (sent[sel & ~survived] == 104 + 2 * 168).all() and (sel & ~survived).any()  # a dropout reveals none
