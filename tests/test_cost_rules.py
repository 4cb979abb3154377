"""fusionpass.cost's ranges over the sizes a dynamic-shape graph can take (`Range.check_sizes`)."""
import pytest

from fusionpass.cost import Range, Sizes

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
