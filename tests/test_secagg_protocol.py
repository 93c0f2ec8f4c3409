"""The secure-aggregation protocol by itself: masks cancel, dropouts are recovered from shares up to the
threshold, one more is refused, tampering is found, and what the server sees says nothing of an update."""

import numpy as np
import pytest

pytest.importorskip("cryptography")

from edgefed.config.schema import SecAggConfig  # noqa: E402
from edgefed.errors import SecAggError, Unrecoverable  # noqa: E402
from edgefed.runtime.secure import SecureDevices  # noqa: E402
from edgefed.secagg import fixedpoint  # noqa: E402
from edgefed.secagg.protocol import KEYS, REVEAL, Client, Randomness, decode, round_setup, unmask  # noqa: E402


def clients_of(setup, source="seeded", seed=0):
    return {int(k): Client(setup, k, Randomness(source, seed, setup.round_idx, int(k))) for k in setup.selected}


def exchange(clients):
    """Phases 1-3: keys out, shares out, shares in; returns every device's KEYS record."""
    keys = np.concatenate([c.advertise() for c in clients.values()])
    shares = np.concatenate([c.share(keys) for c in clients.values()])
    for c in clients.values():
        c.receive(shares)
    return keys, shares


def aggregate(setup, values, dropped=(), source="seeded", tamper=None):
    """The decoded sum of the survivors' values as the protocol computes it, and their plain sum."""
    clients = clients_of(setup, source)
    keys, shares = exchange(clients)
    survivors = [k for k in setup.selected.tolist() if k not in dropped]
    total = np.zeros(setup.words, setup.word)
    for k in survivors:
        total += clients[k].masked_input(values[k])
    reveals = np.concatenate([clients[k].reveal(survivors) for k in survivors])
    if tamper is not None:
        tamper(reveals)
    got, clipped = decode(setup, unmask(setup, keys, total, survivors, reveals))
    assert clipped == sum(int(np.count_nonzero(np.abs(values[k]) > setup.clip)) for k in survivors)
    return got, sum(np.clip(values[k], -setup.clip, setup.clip) for k in survivors)


def setup_of(n=8, k=None, t=None, dim=64, bits=32, clip=4.0, round_idx=3):
    return round_setup(0, round_idx, np.arange(n) * 3, k, t, bits, clip, dim)


def values_for(setup, seed=1):
    rng = np.random.default_rng(seed)
    return {int(k): rng.uniform(-5, 5, setup.dim) for k in setup.selected}  # some beyond the clip of 4


@pytest.mark.parametrize("dropped", [(), (3,), (3, 12), (0, 6, 12, 21)])
def test_dropouts_up_to_the_threshold_are_recovered(dropped):
    setup = setup_of(t=4)  # 8 devices all linked: 8 shares each, any 4 rebuild a secret
    values = values_for(setup)
    got, plain = aggregate(setup, values, dropped)
    assert np.max(np.abs(got - plain)) <= fixedpoint.rounding_bound(setup.n, setup.clip, setup.bits)


def test_one_dropout_more_than_the_threshold_allows_is_refused():
    setup = setup_of(t=4)
    with pytest.raises(Unrecoverable, match=r"round 3: 3 of 8 devices survived .* 3 of the 4 shares .*aborted"):
        aggregate(setup, values_for(setup), (0, 6, 12, 15, 21))


def test_sparse_neighbourhoods_recover_dropouts():
    setup = setup_of(n=12, k=4, t=3)  # SecAgg+: each device linked to 4 of the other 11
    assert all(v.size == 4 for v in setup.neighbours.values())
    assert all(int(i) in setup.neighbours[int(j)] for i in setup.selected for j in setup.neighbours[int(i)])
    got, plain = aggregate(setup, values_for(setup), dropped=(9,))
    assert np.max(np.abs(got - plain)) <= fixedpoint.rounding_bound(setup.n, setup.clip, setup.bits)


def test_default_threshold_and_small_rounds():
    assert setup_of(n=7).threshold == 5  # ceil(2 * 6 / 3) + 1 of 7 shares
    small = setup_of(n=2, k=6, t=5)  # fewer devices than the neighbourhood: all linked, t shrinks to the shares
    assert small.neighbours[0].tolist() == [3] and small.threshold == 2


def test_os_keys_give_other_masks_and_the_same_sum():
    setup = setup_of(n=4)
    values = values_for(setup)
    runs = []
    for source in ("seeded", "seeded", "os"):
        clients = clients_of(setup, source)
        exchange(clients)
        runs.append(clients[0].masked_input(values[0]))
    assert np.array_equal(runs[0], runs[1]) and not np.array_equal(runs[0], runs[2])
    seeded, _ = aggregate(setup, values)
    drawn, _ = aggregate(setup, values, source="os")
    assert np.array_equal(seeded, drawn)  # the masks cancel exactly: the sum never depends on the keys


def test_a_changed_share_in_transit_is_found():
    setup = setup_of(n=4)
    clients = clients_of(setup)
    keys = np.concatenate([c.advertise() for c in clients.values()])
    shares = np.concatenate([c.share(keys) for c in clients.values()])
    shares[2]["sealed"][5] ^= 1
    receiver, sender = int(shares[2]["receiver"]), int(shares[2]["sender"])
    for c in clients.values():
        c.receive(shares)
    with pytest.raises(SecAggError, match=f"share device {sender} sent device {receiver} fails its authentication"):
        clients[receiver].reveal(setup.selected)


def test_a_relayed_key_swapped_by_the_server_is_found():
    setup = setup_of(n=3)
    clients = clients_of(setup)
    keys = np.concatenate([c.advertise() for c in clients.values()])
    forged = keys.copy()
    forged[0]["c_pk"] = Client(setup, 0, Randomness("os", 0, 3, 0)).advertise()["c_pk"][0]  # the server's own key
    shares = np.concatenate([clients[0].share(keys)] + [c.share(forged) for k, c in clients.items() if k != 0])
    clients[0].receive(shares)
    with pytest.raises(SecAggError, match="fails its authentication"):
        clients[0].reveal(setup.selected)


def test_a_changed_revealed_share_is_found():
    setup = setup_of(n=5, t=3)
    values = values_for(setup)

    def flip_self(reveals):
        reveals[0]["y"][0] ^= 1

    with pytest.raises(SecAggError, match="self-mask seed rebuilt .* does not match its commitment"):
        aggregate(setup, values, tamper=flip_self)

    def flip_key(reveals):
        reveals[np.flatnonzero(reveals["kind"] == 1)[0]]["y"][0] ^= 1

    with pytest.raises(SecAggError, match="mask key rebuilt .* (does not match its public key|is not 32 bytes)"):
        aggregate(setup, values, dropped=(6,), tamper=flip_key)


def test_what_the_server_receives_is_independent_of_the_update():
    """Over many rounds device 0 sends a value drawn anew each round; its masked input's correlation with it
    is what independent noise gives, and its words are uniform over Z_2^16."""
    rounds, dim = 400, 4
    values, sent = [], []
    rng = np.random.default_rng(7)
    for r in range(1, rounds + 1):
        setup = round_setup(5, r, np.arange(3), None, None, 16, 4.0, dim)
        clients = clients_of(setup, "os")
        exchange(clients)
        v = rng.uniform(-4, 4, dim)
        values.append(v)
        sent.append(clients[0].masked_input(v)[:-1].astype(np.float64))
    values, sent = np.concatenate(values), np.concatenate(sent)
    r = np.corrcoef(values, sent)[0, 1]
    assert abs(r) < 4 / np.sqrt(values.size)  # 4 sigma of the null
    counts = np.histogram(sent, bins=16, range=(0, 2**16))[0]
    expected = sent.size / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7  # the 0.999 quantile of chi-square with 15 degrees of freedom
    encoded = np.array([fixedpoint.encode(v, 3, 4.0, 16) for v in values.reshape(rounds, dim)]).ravel()
    assert abs(np.corrcoef(values, encoded.view(np.int16))[0, 1]) > 0.99  # without the mask it would tell all


def test_keys_records_carry_the_public_keys():
    setup = setup_of(n=2)
    rec = clients_of(setup)[0].advertise()
    assert rec.dtype == KEYS and rec["device"][0] == 0 and rec["c_pk"].any() and rec["b_commit"].any()


def test_an_odd_neighbourhood_counts_as_the_even_one_the_ring_links():
    setup = setup_of(n=10, k=3)  # ceil(3/2) = 2 either way
    assert {v.size for v in setup.neighbours.values()} == {4} and setup.threshold == 4  # ceil(8/3) + 1


def test_survivors_reveal_one_kind_per_device_and_only_once():
    setup = setup_of(n=6, t=3)
    clients = clients_of(setup)
    exchange(clients)
    survivors = [0, 3, 9, 12]  # 6 and 15 dropped
    reveals = np.concatenate([clients[k].reveal(survivors) for k in survivors])
    assert reveals.dtype == REVEAL
    kinds = {}
    for rec in reveals:
        kinds.setdefault(int(rec["owner"]), set()).add(int(rec["kind"]))
    assert kinds == {**{k: {0} for k in survivors}, 6: {1}, 15: {1}}  # b of survivors, s^SK of dropouts
    with pytest.raises(SecAggError, match="device 0 was asked to reveal shares twice"):
        clients[0].reveal([0, 3])


def test_a_lone_survivor_is_never_unmasked():
    setup = setup_of(n=4, t=1)
    with pytest.raises(Unrecoverable, match="1 of 4 devices survived, and the sum of fewer than 2 would show"):
        aggregate(setup, values_for(setup), dropped=(3, 6, 9))


def test_a_device_still_on_an_older_round_gets_no_client_of_the_new_one():
    devices = SecureDevices(SecAggConfig(enabled=True, key_source="seeded"), 0, "B", 8, np.arange(4))
    devices.keys(1, np.arange(4))
    old = devices.client(1, 2)
    devices.keys(2, np.arange(4))
    assert devices.client(1, 2) is None and devices.client(2, 2) is not old and devices.client(2, 2).setup.round_idx == 2


def test_a_second_masked_input_under_one_mask_is_refused():
    setup = setup_of(n=3)
    clients = clients_of(setup)
    exchange(clients)
    clients[0].masked_input(np.zeros(setup.dim))
    with pytest.raises(SecAggError, match="device 0 was asked for a second masked input"):
        clients[0].masked_input(np.ones(setup.dim))
