"""fusionpass.cost's rules: ranges over the sizes a dynamic-shape graph can take
(`Range.check_sizes`), measured shape classes (`Measured`) and `Either`."""
import pytest

from fusionpass.cost import Either, Measured, Range, Sizes

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


@pytest.mark.parametrize("width, selected", [(1024, True), (1500, True), (3000, True), (4096, True),
                                             (4097, False), (8192, False), (896, False), (65536, False)])
def test_measured_nearest_class_decides(width, selected):
    # nearest by ratio: 4096 is as far from 2048 as from 8192, and the smaller class wins the tie;
    # outside the measured classes (896, 65536) there is nothing to stand on
    assert (MEASURED.check(width, "training") is None) == selected


def test_measured_reasons():
    assert MEASURED.check(8192, "training") == (
        "row width 8192 in training: at 8192, the nearest measured, plain / fusionpass was 0.9, "
        "under 1 (latest/rms_norm_widths.md)")
    assert MEASURED.check(896, "training") == (
        "row width 896 outside the measured 1024..8192 in training (latest/rms_norm_widths.md)")
    assert MEASURED.check(2048, "inference") == "row width 2048: not measured in inference (latest/rms_norm_widths.md)"
    assert MEASURED.check_sizes(Sizes(2, None, 8000), "training") is not None


def test_measured_least_is_a_bound():
    stricter = Measured("row width", MEASURED.speedups, MEASURED.source, least=1.2)
    assert stricter.check(2048, "training") is not None and stricter.check(1024, "training") is None
    opened = Measured("row width", MEASURED.speedups, MEASURED.source, least=0)
    assert opened.check(8192, "inference") is None and opened.check(65536, "training") is None


def test_either_selects_where_one_rule_does():
    measured = Measured("classes", {"training": {32000: 1.05, 50257: 0.8}}, "t.md")
    rule = Either(Range.always("classes", 100_000, None), measured)
    assert rule.check(128256, "inference") is None  # the first
    assert rule.check(32000, "training") is None  # the second
    assert rule.check(50257, "training") == (
        "classes 50257 < 100000; nor classes 50257 in training: at 50257, the nearest measured, plain / "
        "fusionpass was 0.8, under 1 (t.md)")
    assert rule.check(32000, "inference") is not None  # measured in training only
