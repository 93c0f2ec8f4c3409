"""Bits identical across CPUs: this CPU's short runs of every model against hashes made on 64-bit ARM."""

import json
from pathlib import Path

import pytest

import golden

RECORD = json.loads((Path(__file__).parent / "golden_hashes.json").read_text())


def test_the_golden_hashes_were_made_on_arm_for_every_case():
    assert RECORD["machine"] == "aarch64"
    assert RECORD["hashes"].keys() == golden.CASES.keys()


@pytest.fixture(scope="module")
def hashes():
    return golden.all_hashes()


@pytest.mark.parametrize("case", list(golden.CASES))
def test_trajectory_bytes_equal_those_made_on_aarch64(hashes, case):
    """Fails when a kernel change makes this CPU and ARM disagree, or changes the bits on purpose without
    new hashes: regenerate them with `GOLDEN_WRITE=1 sudo launch/check-aarch64.sh` and say so in the commit."""
    assert hashes[case] == RECORD["hashes"][case]
