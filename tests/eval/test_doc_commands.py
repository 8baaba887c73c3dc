"""Every `python -m eval.X ...` command in README.md and docs/*.md names a module that exists
and flags its parser takes (from `--help`), unless the text right after it says the module or
option was retired; every command has its section in docs/benchmarks.md, and its modules open
with a few lines."""
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RETIRED = "retired 2026-12-04"


def doc_commands():
    """(file, line, module, command text) of every eval command in the docs: the text up to the
    closing backtick of its code span, or in a code block up to its line's end (backslash
    continuations joined)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"python\s+-m\s+(eval\.[\w.]+)", text):
            rest = text[m.start():]
            end = rest.find("`")
            line_end = re.search(r"(?<!\\)\n", rest)
            if end < 0 or "\n\n" in rest[:end] or "```" in rest[:end + 3]:
                end = line_end.start() if line_end else len(rest)
            after = " ".join(text[m.start() + end:m.start() + end + 120].split())
            if RETIRED not in after:
                yield (path.name, text.count("\n", 0, m.start()) + 1, m.group(1),
                       " ".join(rest[:end].replace("\\\n", " ").split()))


@functools.cache
def help_of(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"python -m {module} --help: {out.stderr[-2000:]}"
    return out.stdout


def flags_of(module: str) -> frozenset:
    return frozenset(re.findall(r"(--[\w-]+)", help_of(module)))


def test_every_eval_command_in_the_docs_names_a_module_and_flags_that_exist():
    commands = list(doc_commands())
    assert len(commands) > 50
    bad = []
    for name, line, module, command in commands:
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.is_file() and not (path.with_suffix("") / "__main__.py").is_file():
            bad.append(f"{name}:{line}: no module {module}")
            continue
        unknown = {f.split("=")[0] for f in re.findall(r"(?<![\w-])--[\w-]+(?:=\S*)?", command)}
        unknown -= flags_of(module)
        if unknown:
            bad.append(f"{name}:{line}: {module} has no {sorted(unknown)}: {command[:120]}")
    assert not bad, "\n".join(bad)


def _commands() -> list[str]:
    """eval's commands: the modules with a `main` (a package: its __main__)."""
    return sorted(p.parent.name if p.name == "__main__.py" else p.stem
                  for p in (ROOT / "eval").rglob("*.py") if "\ndef main(" in p.read_text())


def _sections(path: Path) -> dict:
    """A page's `## ` sections by heading."""
    parts = re.split(r"^## (.+)$", path.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_eval_command_has_a_section_with_an_example_in_docs_benchmarks():
    sections = _sections(ROOT / "docs" / "benchmarks.md")
    assert len(_commands()) >= 8
    for name in _commands():
        [body] = [b for h, b in sections.items() if h.split(":")[0] == name] or [None]
        assert body, f"docs/benchmarks.md has no '## {name}: ...' section"
        assert f"python -m eval.{name}" in body, f"its section shows no example of eval.{name}"


def test_the_benchmarks_page_links_name_existing_docs_and_headings():
    from tests.test_repo import _slug

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    links = re.findall(r"\]\(([\w./-]*?\.md)?(?:#([\w-]+))?\)", text)
    assert len(links) > 10
    for path, anchor in links:
        target = ROOT / "docs" / (path or "benchmarks.md")
        assert target.is_file(), path
        headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
        assert not anchor or anchor in {_slug(h) for h in headings}, (path, anchor)


def test_eval_modules_open_with_a_few_lines_and_the_tree_stays_small():
    """An essay in a docstring goes stale: what a command measures lives in docs/benchmarks.md,
    and eval stays a small set of tools (issue 67)."""
    import ast

    files = sorted((ROOT / "eval").rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files
            if (doc := ast.get_docstring(ast.parse(p.read_text()), clean=False))
            and (n := doc.count("\n") + 1) > 5}
    assert not long, long
    assert sum(p.read_text().count("\n") for p in files) <= 4000


@pytest.mark.parametrize("module", ["eval.bench_engine", "eval.bench_serving", "eval.quality"])
def test_help_gives_every_mode_a_line(module):
    """The modes' meanings left the docstrings; --help still says each in a line."""
    text = help_of(module)
    modes = re.search(r"--only ONLY\s+comma-separated modes", text) and text.split("modes (--only):")[1]
    assert modes, text
    lines = dict(re.findall(r"^  (\S+)\s+(\S.*)$", modes, flags=re.M))
    choices = {"eval.bench_engine": ["lone", "batch", "streams", "ttft", "prefix", "itl", "grammar",
                                     "step", "census", "capacity", "images", "ready", "compiles"],
               "eval.bench_serving": ["serving", "soak", "structured"],
               "eval.quality": ["quality", "images", "scaling", "sensitivity"]}[module]
    assert all(len(lines.get(m, "")) > 20 for m in choices), lines
