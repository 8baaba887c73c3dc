"""Every `python -m eval.X ...` command in README.md and docs/*.md names a module that exists
and flags its parser takes (from `--help`), unless the text right after it says the module or
option was retired."""
import functools
import re
import subprocess
import sys
from pathlib import Path

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
def flags_of(module: str) -> frozenset:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"python -m {module} --help: {out.stderr[-2000:]}"
    return frozenset(re.findall(r"(--[\w-]+)", out.stdout))


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
