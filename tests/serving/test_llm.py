"""Offline generation (`serving.LLM`) is the server's engine: a request's settings and seed give
the tokens the HTTP server answers with; greedy tokens are the argmax of `Gemma3Model.score` of
the text so far (one forward pass); stop ids end a sequence as they end a request."""
import httpx
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving import LLM, PagedRunner, SamplingParams, ServerConfig
from testkit import ServerThread

TINY = "random:tiny"  # 3 layers, window 8, vocabulary 512


@pytest.fixture(scope="module")
def model():
    return load_model(TINY, dtype="float32", allreduce=AllReduceConfig("f32"))


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[2] + rng.integers(4, 512, n - 1).tolist() for n in lengths]


def test_generate_with_a_seed_gives_the_servers_answer(model):
    prompts = _prompts([9, 30])
    settings = dict(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, ignore_eos=True)
    server = ServerThread(ServerConfig(model=TINY, dtype="float32", allreduce="f32"),
                          PagedRunner(model, max_num_seqs=4, max_seq_len=64))
    try:
        served = [httpx.post(f"{server.url}/generate", timeout=120,
                             json={"prompt_ids": p, "seed": 5 + i, **settings}).json()["token_ids"]
                  for i, p in enumerate(prompts)]
    finally:
        server.stop()
    with LLM(model, max_num_seqs=4, max_seq_len=64) as llm:
        mine = llm.generate(prompts, [SamplingParams(seed=5 + i, **settings)
                                      for i in range(len(prompts))])
        again = llm.generate(prompts[:1], SamplingParams(seed=5, **settings))
        other = llm.generate(prompts[:1], SamplingParams(seed=6, **settings))
    assert mine == served and again == mine[:1] and other != again
    assert all(len(ids) == 12 for ids in mine)


def test_greedy_tokens_are_the_argmax_of_the_scored_text(model):
    prompts = _prompts([5, 40, 17], seed=1)
    with LLM(model, max_num_seqs=2, max_seq_len=64) as llm:
        out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, new in zip(prompts, out):
        logits = model.score([prompt + new])[0]
        np.testing.assert_array_equal(logits[len(prompt) - 1:-1].argmax(-1), new)


def test_a_stop_id_ends_its_sequence(model):
    prompt = _prompts([6], seed=2)
    with LLM(model, max_num_seqs=2, max_seq_len=64) as llm:
        free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        stop = free[3]
        cut = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                  stop_token_ids=(stop,)))[0]
    assert cut == free[:free.index(stop)]  # as a request's: the stop id itself is not output
