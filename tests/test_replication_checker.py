"""tests/replication_checker.py judges histories: each kind of problem is found, and only those."""

from __future__ import annotations

import pytest

from tests.replication_checker import Op, check

OPS = [Op("m1", 0.0, "ok"), Op("m2", 1.0, "fail"), Op("m3", 2.0, "info"), Op("m4", 3.0, "ok")]
LOG = [(0, b"m1"), (10, b"m3"), (20, b"m4")]


def test_a_clean_history_is_valid_and_counted() -> None:
    report = check(OPS, ["m1", "m4"], {"a": LOG, "b": LOG}, 30)
    assert report.valid, report.summary()
    assert (report.ok, report.fail, report.info, report.duplicates) == (2, 1, 1, 0)
    assert report.summary().startswith("valid ok=2 fail=1 info=1 duplicates=0")


def test_an_info_op_may_or_may_not_be_delivered() -> None:
    assert check(OPS, ["m1", "m3", "m4"], {"a": LOG}, 30).valid
    assert check(OPS, ["m1", "m4"], {"a": LOG}, 30).valid


def test_an_ok_op_never_delivered_is_lost() -> None:
    report = check(OPS, ["m1", "m3"], {"a": LOG}, 30)
    assert not report.valid
    assert report.lost == ["m4"]
    assert "lost=1 [m4]" in report.summary()


@pytest.mark.parametrize("delivered", ["m2", "m9"])
def test_a_failed_or_unknown_id_delivered_is_unexpected(delivered: str) -> None:
    report = check(OPS, ["m1", "m4", delivered], {"a": LOG}, 30)
    assert not report.valid
    assert report.unexpected == [delivered]


def test_duplicates_are_counted_not_failed() -> None:
    report = check(OPS, ["m1", "m1", "m4", "m1", "m3", "m3"], {"a": LOG}, 30)
    assert report.valid, report.summary()
    assert report.duplicates == 3


def test_replicas_differing_below_the_hwm_are_divergent() -> None:
    other = [(0, b"m1"), (10, b"mX"), (20, b"m4")]
    report = check(OPS, ["m1", "m4"], {"a": LOG, "b": other}, 30)
    assert not report.valid
    assert [item.split(":")[0] for item in report.divergent] == ["10"]


def test_a_record_missing_on_one_replica_below_the_hwm_is_divergent() -> None:
    report = check(OPS, ["m1", "m4"], {"a": LOG, "b": LOG[:2], "c": []}, 30)
    assert [item.split(":")[0] for item in report.divergent] == ["0", "10", "20"]
    assert "c=-" in report.divergent[0] and "b=-" in report.divergent[2]


def test_above_the_hwm_and_below_a_replicas_first_record_replicas_may_differ() -> None:
    # b's tail past the HWM is not committed yet; c's retention removed its first record
    assert check(OPS, ["m1", "m4"], {"a": LOG, "b": [*LOG[:2], (20, b"mY")], "c": LOG[1:]}, 20).valid


def test_an_ops_result_is_one_of_three() -> None:
    with pytest.raises(ValueError):
        Op("m1", 0.0, "maybe")
