"""Stage plans: partitions, printed form, stage order and the inputs kept for recompute."""

import pytest

from lightning_roundpipe.schedule import StageKind, StagePlan


def test_printed_form_parses_back():
    plan = StagePlan((3, 3), (1, 2, 2, 2))
    assert str(plan) == "3,3|1,2,2,2"
    assert StagePlan.parse(str(plan)) == plan
    assert StagePlan.parse("|4") == StagePlan((), (4,))


def test_stages_in_slot_order():
    plan = StagePlan.parse("3,3|1,2,2,2")
    got = [(s.slot, s.kind, s.start, s.stop) for s in plan.stages()]
    assert got == [
        (0, StageKind.FORWARD, 0, 3),
        (1, StageKind.FORWARD, 3, 6),
        (2, StageKind.FUSED, 6, 7),
        (3, StageKind.BACKWARD, 4, 6),
        (4, StageKind.BACKWARD, 2, 4),
        (5, StageKind.BACKWARD, 0, 2),
    ]
    assert plan.num_layers == 7 and plan.num_slots == 6 and plan.fused_start == 6
    # the forward pass keeps the inputs of layers 4, 2 and 0 for the backward stages' recompute
    assert plan.saved_boundaries() == (4, 2, 0)


def test_uniform():
    assert str(StagePlan.uniform(7)) == "3,3|1,1,1,1,1,1,1"
    assert str(StagePlan.uniform(8, forward_size=3, backward_size=2)) == "3,3|2,2,2,2"
    assert str(StagePlan.uniform(1)) == "|1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3|1,1", "inconsistent"),
        ("0,3|1,3", "at least one layer"),
        ("3,3", "expected forward layer counts"),
        ("|", "expected forward layer counts"),
    ],
)
def test_bad_plans_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        StagePlan.parse(text)


def test_plan_for_another_model_names_both_sizes():
    with pytest.raises(ValueError, match=r"covers 7 layers but the model has 5.*2,2\|1,1,1,1,1|3\|"):
        StagePlan.parse("3,3|1,2,2,2").check_layers(5)


def test_a_stage_splits_in_two_and_a_one_layer_stage_does_not():
    plan = StagePlan.parse("3,3|4,3,3")
    assert str(plan.split(0)) == "2,1,3|4,3,3"  # a forward stage: two forward stages
    assert str(plan.split(2)) == "3,3,2|2,2,3,3"  # the fused stage: its lower half forward and backward
    assert str(plan.split(3)) == "3,3|4,2,1,3"  # a backward stage: two backward stages
    with pytest.raises(ValueError, match=r"stage 1 of plan 3,1\|4,4 has one layer"):
        StagePlan.parse("3,1|4,4").split(1)
