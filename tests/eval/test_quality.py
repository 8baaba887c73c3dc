"""Quality evaluation: metrics on known logits, the corpus, the naive strawman, and a tiny run
on a random model (schema, the reference, naive worse than EQuARX)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from eval import corpus, quality
from eval.naive_allreduce import naive_all_reduce


def test_compare_logits_on_known_values():
    ref = np.log(np.array([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]], np.float32))
    out = np.log(np.array([[0.5, 0.5], [0.4, 0.6], [0.3, 0.7]], np.float32))
    targets = np.array([0, 1, -1])
    s = quality.compare_logits(ref, out, targets)
    assert s["count"] == 2  # the last position has no next token
    assert s["nll"] == pytest.approx(-np.log(0.5) - np.log(0.6), rel=1e-5)
    kl = 0.9 * np.log(0.9 / 0.4) + 0.1 * np.log(0.1 / 0.6)
    assert s["kl"] == pytest.approx(kl, rel=1e-4)
    assert s["agree"] == 1  # position 1: argmax 0 against argmax 1
    same = quality.compare_logits(ref, ref, targets)
    assert same["kl"] == 0.0 and same["agree"] == 2
    with pytest.raises(ValueError):
        quality.compare_logits(ref, out[:2], targets)


def test_corpus_is_real_prose_from_the_standard_library():
    paras = corpus.prose_paragraphs()
    assert len(paras) > 500 and sum(len(p) for p in paras) > 100_000
    assert any("assert" in p for p in paras[:10])
    assert not any(p.startswith(" ") for p in paras)
    tok = lambda s: list(s.encode())  # noqa: E731
    w = corpus.token_windows(tok, 1000, 100, bos_id=2)
    assert len(w) == 11 and all(x[0] == 2 and len(x) == 100 for x in w)
    assert w[0][1:] + w[1][1:] == tok("".join(p + "\n\n" for p in paras))[:198]  # contiguous
    prompts = corpus.prompt_set(tok, 5, 20)
    assert len(prompts) == 5 and all(len(p) == 20 for p in prompts)
    with pytest.raises(ValueError):
        corpus.token_windows(tok, 10**9, 100, bos_id=2)


def test_naive_strawman_is_identical_on_devices_and_worse_than_equarx_with_an_outlier():
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 64, 256)).astype(np.float32)
    x[1, 3, 7] = 200.0  # one outlier on one device sets the naive step size for everything
    exact = x.sum(0)

    def run(fn):
        f = jax.jit(jax.shard_map(lambda a: fn(a[0])[None], mesh=mesh, in_specs=P("tp"),
                                  out_specs=P("tp")))
        return np.asarray(f(jnp.asarray(x)))

    naive = run(lambda a: naive_all_reduce(a, "tp"))
    eq = run(lambda a: all_reduce(a, "tp", AllReduceConfig("int8")))
    for out in (naive, eq):
        assert all(np.array_equal(out[0], out[d]) for d in range(n))  # replicas agree
    mse_naive, mse_eq = np.mean((naive[0] - exact) ** 2), np.mean((eq[0] - exact) ** 2)
    # Each naive element is off by at most half a step of 200/127 per device.
    assert np.abs(naive[0] - exact).max() <= n * 0.5 * 200 / 127 + 1e-4
    assert mse_naive > 10 * mse_eq


def test_tiny_quality_run():
    modes = ["f32", "int8", "int8-full+tile", "naive"]
    report = quality.run("random:tiny", tps=(2,), modes=modes, n_tokens=126, window=64,
                         n_prompts=2, prompt_tokens=8, new_tokens=3, log=lambda *_: None)
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == set(modes) and report["tokens_scored"] == 126
    for r in rows.values():
        for key in ("tp", "perplexity", "kl_to_f32", "top1_agree_f32", "greedy_exact_match",
                    "greedy_prefix", "allreduce", "tokens_scored"):
            assert key in r, key
        assert np.isfinite(r["perplexity"]) and r["perplexity"] > 1
    assert report["reference"] == "f32" and rows["f32"]["allreduce"]["method"] == "f32"
    assert rows["int8"]["allreduce"]["blocks"] == "group"
    assert rows["int8"]["kl_to_f32"] > 0 and rows["int8-full+tile"]["kl_to_f32"] > 0
    assert rows["naive"]["kl_to_f32"] > max(rows["int8"]["kl_to_f32"],
                                            rows["int8-full+tile"]["kl_to_f32"])
    assert all(0 <= r["greedy_prefix"] <= 3 for r in rows.values())
    assert "naive" in quality.format_table(report["rows"])
