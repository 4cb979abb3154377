"""The README's fusion and settings tables and docs/fusions.md are generated from the fusions'
declarations; the committed copies must be what the code generates now."""
import pathlib
import re
import subprocess

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


_CITED = re.compile(r"benchmarks/(?:results|probes)/[\w./-]*\w\.(?:md|json|py)")
_IN_HISTORY = re.compile(r"(?:as of|removed in|history as of) ([0-9a-f]{7,40})")


def _citations():
    """(file, path, the text after the citation) of every benchmarks/results or probes path that
    the code, the benchmarks and the docs cite ("NAME" in a path is a placeholder, not a file)."""
    sources = [*ROOT.glob("fusionpass/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("benchmarks/**/*.md"),
               *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    for source in sources:
        text = source.read_text()
        for m in _CITED.finditer(text):
            if "NAME" not in m.group(0):
                yield source.relative_to(ROOT), m.group(0), text[m.end():m.end() + 160]


def _in_git(commit: str, path: str) -> bool | None:
    """Whether `path` exists at `commit`; None where this checkout has no history to ask."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return None
        return subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT, capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None


def test_every_cited_result_file_exists():
    """A cited result or probe exists in the tree, or its citation names the commit that has it
    ("as of <commit>", "removed in <commit>") and that commit does."""
    missing = []
    for source, path, after in _citations():
        if (ROOT / path).exists():
            continue
        history = _IN_HISTORY.search(after)
        if history is None:
            missing.append(f"{source}: {path} (no such file, and no commit named for it)")
            continue
        commit = history.group(1)
        if path.endswith(".md") and "removed in" in history.group(0):
            commit += "^"  # the file is in the commit before the one that removed it
        if _in_git(commit, path) is False:
            missing.append(f"{source}: {path} is not in {commit}")
    assert not missing, "\n".join(missing)
