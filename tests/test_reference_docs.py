"""The README's fusion and settings tables and docs/fusions.md are generated from the fusions'
declarations; the committed copies must be what the code generates now."""
import pathlib
import re

from fusionpass import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_tables_are_generated():
    text = (ROOT / "README.md").read_text()
    begin, end = text.index(reference.README_BEGIN), text.index(reference.README_END)
    assert text[begin:end + len(reference.README_END)] == reference.readme_section(), (
        "README.md is out of date: replace its generated section with `fusionpass list --markdown`")


def test_fusion_reference_is_generated():
    assert (ROOT / "docs" / "fusions.md").read_text() == reference.reference_page() + "\n", (
        "docs/fusions.md is out of date: `fusionpass list --reference > docs/fusions.md`")


def test_a_pipe_in_a_cell_is_escaped():
    assert reference._table(("a",), [("[B|1, H|1]",)])[-1] == "| [B\\|1, H\\|1] |"


def test_readme_table_cells_are_short():
    """Each cell of the README's tables fits reference.CELL_MAX characters; long rules link to
    docs/fusions.md."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line)[1:-1]:
                assert len(cell.strip()) <= reference.CELL_MAX, cell[:200]
