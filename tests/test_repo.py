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
    assert len((ROOT / "README.md").read_bytes()) <= 13_600, "long write-ups belong in docs/"


def test_pyflakes_finds_nothing():
    """Unused imports and variables, undefined names, redefinitions: in every package and test."""
    import io

    from pyflakes.api import checkRecursive
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    paths = [str(ROOT / p) for p in ("jax_platform", "equarx", "models", "serving", "eval", "tests")]
    count = checkRecursive(paths, Reporter(out, err))
    assert count == 0 and not err.getvalue(), out.getvalue() + err.getvalue()


PACKAGES = ("equarx", "models", "serving", "eval")
MAX_FUNCTION_LINES = 120


def _functions(path: pathlib.Path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_is_over_120_lines():
    """A function a reader cannot hold at once is several jobs."""
    long = {(str(p.relative_to(ROOT)), name): n for pkg in PACKAGES
            for p in sorted((ROOT / pkg).rglob("*.py")) for name, n in _functions(p)
            if n > MAX_FUNCTION_LINES}
    assert not long, long


def _imports(path: pathlib.Path):
    """(module, name) of every import in a file; name is None for `import module`."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield from ((node.module, a.name) for a in node.names)


def test_eval_uses_public_apis_only():
    """The benchmarks use what a user of the packages would: serving's public names (its
    __all__), and no underscored name of equarx, models, serving or jax_platform."""
    import serving

    bad = []
    for p in sorted((ROOT / "eval").rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        for module, name in _imports(p):
            top = module.split(".")[0]
            if top in ("equarx", "models", "serving", "jax_platform") and name and name.startswith("_"):
                bad.append(f"{rel}: {module}.{name}")
            if top == "serving" and (
                    module != "serving" or name not in serving.__all__):
                bad.append(f"{rel}: {module}{'.' + name if name else ''}")
    assert not bad, bad


def test_platform_set_up_comes_from_jax_platform():
    """Nothing in eval/ or tests/ takes a platform set-up name (devices, XLA flags, allocator,
    caches) from serving: it lives below every package, in jax_platform."""
    import jax_platform

    platform_names = {n for n in dir(jax_platform) if not n.startswith("_")}
    bad = [f"{p.relative_to(ROOT)}: {module}.{name}"
           for d in ("eval", "tests") for p in sorted((ROOT / d).rglob("*.py"))
           for module, name in _imports(p)
           if module.split(".")[0] == "serving" and name in platform_names]
    assert not bad, bad
