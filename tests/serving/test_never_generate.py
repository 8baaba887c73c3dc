"""Ids a model must not generate (`RunnerInfo.never_generate`: its image tokens, the ids its
checkpoint suppresses): the engine never samples them, a grammar's mask never allows them (text
a grammar forces is written in other tokens), and a request that raises their odds gets a 400."""
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving import PagedRunner, SamplingParams, ServerConfig
from testkit import ServerThread, finish_all

# A random tower's image tokens take the vocabulary's last rows: ids 500, 501, 502 of 512.
TINY_VISION = "random:tiny?vision=tiny"
IMAGE_IDS = (500, 501, 502)


@pytest.fixture(scope="module")
def model():
    return load_model(TINY_VISION, dtype="float32", allreduce=AllReduceConfig("f32"))


@pytest.fixture(scope="module")
def server(model):
    s = ServerThread(ServerConfig(model=TINY_VISION, dtype="float32", allreduce="f32",
                                  max_num_seqs=8, max_seq_len=160, compile_cache_dir=""),
                     PagedRunner(model, max_num_seqs=8, max_seq_len=160))
    yield s
    s.stop()


def test_the_engine_never_samples_them(model, server):
    """8 streams of 128 tokens drawn at temperature 2 from a random model, which without the
    ban would have drawn an image token several times (the expected count, from the model's
    own logits at every drawn position, is checked to be so)."""
    assert server.runner.info.never_generate == IMAGE_IDS
    rng = np.random.default_rng(0)
    prompts = [[2] + rng.integers(4, 500, 8).tolist() for _ in range(8)]
    done = finish_all(server.runtime.core, [
        (p, SamplingParams(max_tokens=128, temperature=2.0, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)])
    outputs = [[t.id for t in c.tokens] for c in done]
    assert all(len(o) == 128 for o in outputs)
    assert not set(IMAGE_IDS) & {t for o in outputs for t in o}
    logits = model.score([p + o for p, o in zip(prompts, outputs)])
    expected = 0.0
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        z = logits[i, len(p) - 1:len(p) + len(o) - 1, :512].astype(np.float64) / 2.0
        prob = np.exp(z - z.max(-1, keepdims=True))
        expected += (prob[:, IMAGE_IDS].sum(-1) / prob.sum(-1)).sum()
    assert expected > 3, expected


def test_a_request_may_not_raise_their_odds(client):
    """A positive logit_bias on one is refused with a 400 naming the field; a negative one (it
    changes nothing) and biases on other ids are served."""
    body = dict(prompt="x", max_tokens=2, temperature=0)
    r = client.post("/v1/completions", json=dict(body, logit_bias={"501": 5}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and "[501]" in error["message"], error
    for bias in ({"501": -100}, {"300": 100}):
        r = client.post("/v1/completions", json=dict(body, logit_bias=bias))
        assert r.status_code == 200, r.text


def test_a_grammar_mask_never_allows_them():
    """A grammar that names an image token by id: the mask sent to the sampler clears it, and
    keeps the grammar's other choice."""
    from models.gemma3.byte_tokenizer import ByteTokenizer
    from serving import structured_output as so
    from serving.sequence import Sequence

    tok = ByteTokenizer(512)
    grammar = so.build_grammar("grammar", 'start: <[501]> | "a"', "guided_grammar", tok, (1,))
    outputs = so.StructuredOutputs(512, (1,), tokenizer=tok, never_generate=IMAGE_IDS)
    outputs.add(Sequence(0, [2], SamplingParams(max_tokens=4, grammar=grammar), seed=0))
    mask = outputs.masks([0]).result()[0].view(np.uint32)
    allowed = [i for i in range(512) if mask[i // 32] >> (i % 32) & 1]
    assert allowed == tok.encode("a")


def test_text_a_grammar_forces_is_written_in_allowed_tokens():
    """Gemma's "<start_of_image>" is one of its pieces (id 255999), which the model must not
    write: a grammar that forces that text gets it in other tokens."""
    from llguidance.numpy import fill_next_token_bitmask

    from models.gemma3.gguf import default_gguf_path
    from models.gemma3.tokenizer import Tokenizer
    from serving import structured_output as so

    tok = Tokenizer.from_gguf(default_gguf_path())
    matcher = so.build_grammar("choice", ["a<start_of_image>"], "guided_choice", tok, (1,)).new_matcher()
    mask = np.zeros((1, (tok.vocab_size + 31) // 32), np.int32)
    path = []
    while len(path) < 16 and not matcher.is_stopped():
        fill_next_token_bitmask(matcher, mask)
        bits = mask[0].view(np.uint32)
        assert not bits[255999 // 32] >> (255999 % 32) & 1
        nz = int(np.flatnonzero(bits)[0])
        token = nz * 32 + (int(bits[nz]) & -int(bits[nz])).bit_length() - 1
        assert matcher.consume_token(token), matcher.get_error()
        path.append(token)
    assert matcher.is_stopped() and tok.decode(path) == "a<start_of_image>"
