"""fusionpass.cost's ranges over the sizes a dynamic-shape graph can take (`Range.check_sizes`)."""
import pytest

from fusionpass.cost import Measured, Range, Sizes

RULE = Range("positions", training=(64, 4096), inference=None)


@pytest.mark.parametrize("sizes, why", [
    (Sizes.static(100), None),
    (Sizes.static(7), "positions 7 outside 64..4096 in training"),
    (Sizes(64, 4096, 100), None),  # every size inside: selected
    (Sizes(5000, None, 6000), "positions 5000.. (symbolic) outside 64..4096 in training"),  # none inside
    (Sizes(2, 63, 10), "positions 2..63 (symbolic) outside 64..4096 in training"),
    (Sizes(2, None, 100), None),  # straddles: decided at the hint
    (Sizes(2, None, 7), "positions 7 outside 64..4096 in training (at the size hint; symbolic, 2..)"),
    (Sizes(2, None, None), "positions 2.. (symbolic, no size hint) not within 64..4096 in training"),
])
def test_symbolic_sizes(sizes, why):
    assert RULE.check_sizes(sizes, "training") == why


def test_a_mode_not_selected_stays_out_at_every_size():
    assert RULE.check_sizes(Sizes(64, 100, 80), "inference") == "not selected in inference"


MEASURED = Measured("row width", {"training": {1024: 1.3, 2048: 1.1, 8192: 0.9}}, "latest/rms_norm_widths.md")


@pytest.mark.parametrize("width, selected", [(1024, True), (896, True), (1500, True), (3000, True),
                                             (4096, True), (4097, False), (8192, False), (65536, False)])
def test_measured_nearest_class_decides(width, selected):
    # nearest by ratio: 4096 is as far from 2048 as from 8192, and the smaller class wins the tie
    assert (MEASURED.check(width, "training") is None) == selected


def test_measured_reason_and_unmeasured_mode():
    assert MEASURED.check(8192, "training") == (
        "row width 8192 in training: at 8192, the nearest measured, plain compile was faster "
        "(0.9x; latest/rms_norm_widths.md)")
    assert MEASURED.check(8192, "inference") is None  # not measured: the other rules decide
    assert MEASURED.check_sizes(Sizes(2, None, 8000), "training") is not None
