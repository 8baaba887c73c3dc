"""Clients of the HTTP tests' server: each module sets up its own `server` fixture (a
testkit.ServerThread over the engine it tests); these talk to it."""
import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    """An httpx client of the module's server; the timeout only bounds a hang."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    """The OpenAI client of the module's server, never retrying (a retry would hide an error)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
