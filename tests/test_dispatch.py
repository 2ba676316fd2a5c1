"""Round-robin dispatch, transfer lowering and the schedule validator."""

import itertools

import pytest

from lightning_roundpipe.schedule import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    StagePlan,
    add_transfers,
    pack_parts,
    round_robin,
    validate,
)


def _slots(schedule: Schedule) -> list[list[str]]:
    """Each worker's slots in order, as 'round:OPslot'."""
    out = []
    for actions in schedule.workers:
        row: list[str] = []
        for a in actions:
            cell = f"{a.round}:{a.op.value}{a.slot}"
            if not row or row[-1] != cell:
                row.append(cell)
        out.append(row)
    return out


def test_round_robin_pinned_across_rounds_and_batches():
    # 3 workers, 4 slots per round (F0 L1 B2 B3), 2 rounds: slot i of round r runs on worker
    # (g0 + 4r + i) mod 3, and the next batch starts where this one ended.
    plan = StagePlan.parse("2|1,1,1")
    first = round_robin(plan, num_workers=3, microbatches_per_round=3, num_rounds=2, first_worker=0)
    assert _slots(first) == [
        ["0:F0", "0:B3", "1:B2"],
        ["0:L1", "1:F0", "1:B3"],
        ["0:B2", "1:L1"],
    ]
    assert first.next_first_worker == 2
    second = round_robin(plan, 3, 3, 2, first_worker=first.next_first_worker)
    assert _slots(second) == [
        ["0:L1", "1:F0", "1:B3"],
        ["0:B2", "1:L1"],
        ["0:F0", "0:B3", "1:B2"],
    ]
    assert second.next_first_worker == 1


def test_each_worker_runs_all_microbatches_of_its_slot_in_order():
    s = round_robin(StagePlan.parse("1|1,1"), num_workers=2, microbatches_per_round=3, num_rounds=2)
    assert [str(a) for a in s.workers[0][:3]] == ["0:F0.0", "0:F0.1", "0:F0.2"]
    assert [str(a) for a in s.workers[0][3:6]] == ["0:B2.0", "0:B2.1", "0:B2.2"]
    assert [a.microbatch for a in s.workers[1] if a.round == 1 and a.slot == 0] == [3, 4, 5]


@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        ("none", "0:W0 0:F0.0 0:F0.1 0:G0 0:W2 0:B2.0 0:B2.1 0:G2"),
        ("simple", "0:W0 0:W2 0:F0.0 0:F0.1 0:G0 0:B2.0 0:B2.1 0:G2"),
        # the next slot's upload is cut into one part per window of the current slot
        ("priority", "0:W0 0:F0.0 0:W2~0/2 0:F0.1 0:W2~1/2 0:G0 0:B2.0 0:B2.1 0:G2"),
    ],
)
def test_transfer_placement(overlap, expected):
    s = add_transfers(round_robin(StagePlan.parse("1|1,1"), 2, 2), overlap)
    assert " ".join(map(str, s.workers[0])) == expected
    validate(s)


def test_priority_gradient_downloads_ride_in_the_next_slot_windows():
    s = add_transfers(round_robin(StagePlan.parse("1|1,1"), 1, 3), "priority")
    assert " ".join(map(str, s.workers[0])) == (
        "0:W0 0:F0.0 0:W1~0/3 0:F0.1 0:W1~1/3 0:F0.2 0:W1~2/3 0:G0 "
        "0:L1.0 0:W2~0/3 0:L1.1 0:W2~1/3 0:L1.2 0:W2~2/3 "
        "0:B2.0 0:G1~0/3 0:B2.1 0:G1~1/3 0:B2.2 0:G1~2/3 0:G2"
    )


def test_pack_parts_balances_bytes_and_cuts_large_tensors():
    # an LM-head-sized tensor and a few small ones into 4 parts
    sizes = [(0, 1000, 2), (1, 100, 2), (2, 60, 4), (3, 10, 2)]
    parts = pack_parts(sizes, 4)
    total = sum(n * b for _, n, b in sizes)
    loads = [sum((stop - start) * dict((k, b) for k, _, b in sizes)[k] for k, start, stop in p) for p in parts]
    assert sum(loads) == total
    assert max(loads) <= -(-total // 4) + 2 * 60 * 4  # within one small piece of an even share
    covered = sorted((k, a, b) for p in parts for k, a, b in p)
    for key, numel, _ in sizes:  # every element exactly once
        ranges = [(a, b) for k, a, b in covered if k == key]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(ranges))


def test_validator_refuses_an_upload_after_compute_started():
    s = add_transfers(round_robin(StagePlan.parse("1|1,1"), 1, 2), "none")
    w = list(s.workers[0])
    w[0], w[1] = w[1], w[0]  # F0.0 before W0
    with pytest.raises(ScheduleError, match="uploads weights after the slot started computing"):
        validate(Schedule(s.plan, 1, 2, 1, 0, (tuple(w),)))


def test_action_printed_form_parses_back():
    for text in ["0:F2.3", "12:B4.17", "1:W4", "3:G0", "0:L1.0", "2:W5~3/4", "0:G1~0/2"]:
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError):
        Action(Op.LOAD, 0, 0, 1)
    with pytest.raises(ValueError, match=r"expected e\.g\."):
        Action.parse("F2")


@pytest.mark.parametrize("workers,mbs,rounds", [(1, 1, 1), (2, 2, 3), (3, 4, 2), (4, 5, 1)])
def test_generated_schedules_validate(workers, mbs, rounds):
    for plan in ["3,3|1,2,2,2", "|7", "6|1,6", "1,1,1,1,1,1|1,1,1,1,1,1,1"]:
        for g0 in range(workers):
            for overlap in ("none", "simple", "priority"):
                validate(add_transfers(round_robin(StagePlan.parse(plan), workers, mbs, rounds, g0), overlap))


def test_rounds_of_fewer_microbatches_than_workers_are_complete_and_deadlock_free():
    """A batch smaller than the workers (batch size 1 on 3 GPUs) runs a round of fewer micro-batches: some
    workers idle, none waits forever."""
    for plan in ["1|1,1", "3,3|1,2,2,2"]:
        for mbs, rounds in [(1, 1), (2, 1), (1, 3)]:
            for g0 in range(3):
                validate(add_transfers(round_robin(StagePlan.parse(plan), 3, mbs, rounds, g0), "priority"))
    with pytest.raises(ValueError, match=r"at least one micro-batch per round"):
        round_robin(StagePlan.parse("1|1,1"), num_workers=3, microbatches_per_round=0)


def test_validator_marks_a_deadlocked_action():
    good = round_robin(StagePlan.parse("1|1,1"), 2, 2)
    w0, w1 = good.workers
    # worker 1 runs the fused stage before... nothing: put a backward first on worker 0 so it waits
    # for a gradient that only worker 0 itself would produce later
    bad = Schedule(good.plan, 2, 2, 1, 0, (tuple(reversed(w0)), w1))
    with pytest.raises(ScheduleError, match=r"worker 0, step 0, action 0:B2.1: waits forever") as info:
        validate(bad)
    assert ">>0:B2.1<<" in str(info.value)


def test_validator_catches_missing_microbatches():
    good = round_robin(StagePlan.parse("1|1,1"), 2, 2)
    bad = Schedule(good.plan, 2, 2, 1, 0, (good.workers[0][:-1], good.workers[1]))
    with pytest.raises(ScheduleError, match="exactly once"):
        validate(bad)
