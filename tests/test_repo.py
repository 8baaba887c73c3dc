"""The repository promises a newcomer two set-up commands; CI must run the same test command;
the code has no unused imports or undefined names (pyflakes)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds), "each set-up step is one command line"
    assert cmds[0].rstrip().endswith("gemma3-serve")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' dropped, spaces
    to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_links_name_existing_docs_and_headings():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#([\w-]+))?\)", text)
    assert links
    for path, anchor in links:
        target = ROOT / path
        assert target.is_file(), f"README links to missing {path}"
        if anchor:
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)}
            assert anchor in slugs, f"README links to {path}#{anchor}, which has no such heading"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_bytes()) <= 12_800, "long write-ups belong in docs/"


def test_pyflakes_finds_nothing():
    """Unused imports and variables, undefined names, redefinitions: in every package and test."""
    import io

    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    paths = [str(ROOT / p) for p in ("jax_platform", "equarx", "models", "serving", "eval", "tests")]
    count = checkRecursive(paths, Reporter(out, err))
    assert count == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
