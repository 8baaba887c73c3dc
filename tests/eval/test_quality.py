"""eval.quality: metrics on known logits, the corpus, the naive strawman, and each mode on a
tiny random model: the reference against itself is exact, the others' errors are what they
should be (naive worse than EQuARX; images cost int8 nothing in kind; the emulated axis exact
with the f32 psum and int8's error growing with N; noise errs by the size asked, measured
against the sum as the reference delivers it)."""
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from eval import corpus, quality
from eval.quality import naive_all_reduce


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


def test_tiny_quality_run(tmp_path):
    # The tile codec's quality at real size: tests/models/test_parity.py (int8 at tp=4).
    modes = ["f32", "int8", "naive"]
    out = tmp_path / "quality.json"
    report = quality.main(["--model", "random:tiny", "--tp", "2", "--modes", ",".join(modes),
                           "--tokens", "126", "--window", "64", "--prompts", "2",
                           "--prompt-tokens", "8", "--new-tokens", "3", "--out", str(out)])
    assert out.is_file()
    rows = {r["mode"]: r for r in report["quality"]["rows"]}
    assert set(rows) == set(modes) and all(r["tokens"] == 126 for r in rows.values())
    for r in rows.values():
        assert np.isfinite(r["perplexity"]) and r["perplexity"] > 1 and 0 <= r["greedy_prefix"] <= 3
    assert report["reference"] == "f32" and rows["f32"]["allreduce"]["method"] == "f32"
    assert rows["f32"]["kl_to_f32"] == 0 and rows["f32"]["greedy_exact_match"] == 1
    assert rows["int8"]["allreduce"]["blocks"] == "group"
    assert 0 < rows["int8"]["kl_to_f32"] < rows["naive"]["kl_to_f32"]


def test_images_f32_exact_int8_close():
    report = quality.main(["--only", "images", "--tp", "2", "--modes", "f32,int8", "--prompts", "1",
                           "--tokens", "8"])
    rows = {(r["mode"], r["images"]): r for r in report["images"]["rows"]}
    assert set(rows) == {(m, n) for m in ("f32", "int8") for n in (0, 1, 2)}
    for n in (0, 1, 2):
        assert rows["f32", n]["kl_to_f32"] == 0 and rows["f32", n]["top1_agree_f32"] == 1
        assert 0 < rows["int8", n]["kl_to_f32"] < 1e-3
    assert rows["int8", 2]["positions"] == 1 + 8 + 2 * (2 + 8)  # soft tokens left out


def test_split_parts_sum_to_the_partials_with_a_part_rms_of_one_over_sqrt_k():
    partials = jax.random.normal(jax.random.PRNGKey(0), (4, 64, 256), jnp.float32)
    partials = partials * jnp.arange(1, 65, dtype=jnp.float32)[None, :, None]  # row scales
    assert quality.split_parts(partials, 1, jax.random.PRNGKey(1)) is partials
    parts = np.asarray(quality.split_parts(partials, 4, jax.random.PRNGKey(1)))
    assert parts.shape == (16, 64, 256)
    np.testing.assert_allclose(parts.reshape(4, 4, 64, 256).sum(1), partials, rtol=0, atol=2e-4 * 64)
    ratio = (np.sqrt((parts.reshape(4, 4, 64, 256) ** 2).mean((1, 3)))
             / np.sqrt((np.asarray(partials) ** 2).mean(-1)))
    assert np.all(np.abs(ratio - 0.5) < 0.1), ratio
    with pytest.raises(ValueError, match="multiple of 4"):
        quality.emulated_reduction(AllReduceConfig("int8"), 6)


def test_scaling_exact_with_the_f32_psum_and_int8_full_grows_with_n():
    report = quality.main(["--only", "scaling", "--model", "random:tiny", "--devices", "4,8",
                           "--modes", "f32,int8-full", "--tokens", "47", "--window", "48"])
    rows = {(r["mode"], r["devices"]): r for r in report["scaling"]["rows"]}
    # The random parts sum to the partials up to float32 rounding: KL at the rounding's level.
    assert abs(rows["f32", 8]["kl_to_f32"]) < 1e-6 and rows["f32", 8]["top1_agree_f32"] >= 0.98
    assert rows["int8-full", 8]["kl_to_f32"] > rows["int8-full", 4]["kl_to_f32"] > 0
    assert rows["int8-full", 8]["variant"] == "full" and rows["int8-full", 8]["emulated"]
    assert not rows["int8-full", 4]["emulated"]


def _sensitivity(dtype, modes, noise):
    report = quality.main(["--only", "sensitivity", "--model", "random:tiny", "--tp", "2",
                           "--dtype", dtype, "--modes", modes, "--noise", noise, "--tokens", "63",
                           "--window", "64"])
    return {r["variant"]: r for r in report["sensitivity"]["rows"]}


def test_float32_model_noise_errs_as_asked_and_kl_grows_with_its_square():
    rows = _sensitivity("float32", "bf16_ring", "1e-3,1e-2")
    for eps in (1e-3, 1e-2):
        assert rows[f"noise:{eps:g}"]["allreduce_rel_error"] == pytest.approx(eps, rel=0.1)
    # No floor in a float32 model: KL ~ error^2 (x100 expected for x10 the noise).
    assert rows["noise:0.01"]["kl_to_f32"] > 30 * rows["noise:0.001"]["kl_to_f32"] > 0
    # bf16_ring rounds the partials to bfloat16: an error of about one bf16 rounding.
    assert 5e-4 < rows["bf16_ring"]["allreduce_rel_error"] < 5e-3


def test_bfloat16_model_error_is_against_the_delivered_sum():
    """In a bf16 model the two-shot bf16 ring delivers the exact sum rounded once, as the
    reference does: zero error and identical logits (a comparison with the unrounded sum, or
    XLA dropping the reference's rounding, would report about 2e-3)."""
    rows = _sensitivity("bfloat16", "bf16_ring", "0,1e-2")
    for exact in ("bf16_ring", "noise:0"):
        assert rows[exact]["allreduce_rel_error"] == 0 and rows[exact]["kl_to_f32"] == 0
    assert rows["noise:0.01"]["allreduce_rel_error"] == pytest.approx(1e-2, rel=0.2)
    assert rows["noise:0.01"]["kl_to_f32"] > 0


def test_bad_arguments_are_refused_and_the_meter_loses_nothing():
    with pytest.raises(ValueError, match="not both"):
        quality.measured_reduction(quality.ErrorMeter(), AllReduceConfig("int8"), 1e-3)
    for text in ("-1e-3", "nan", "1e-3,inf"):
        with pytest.raises(ValueError, match=">= 0"):
            quality.parse_noise(text)
    assert quality.parse_noise("0, 1e-3") == [0.0, 1e-3] and quality.ErrorMeter().relative is None

    class DeviceValue:  # like a jax.Array: float() waits for the value with the GIL released
        def __init__(self, v):
            self.v = v

        def __float__(self):
            time.sleep(0)
            return self.v

    meter = quality.ErrorMeter()
    threads = [threading.Thread(target=lambda: [meter.add(DeviceValue(1.0), DeviceValue(2.0))
                                                for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (meter.err2, meter.ref2) == (8000, 16000) and meter.relative == math.sqrt(0.5)


def test_mode_suffixes_name_the_allreduce_the_rotation_and_the_storage():
    assert quality.mode_parts("int8") == ("int8", True, {})
    assert quality.mode_parts("int8:unfolded:kv-int8") == ("int8", False, {"kv_cache_dtype": "int8"})
    assert quality.mode_parts("bf16:w-fp8:kv-int8") == (
        "bf16", True, {"quantization": "fp8", "kv_cache_dtype": "int8"})
    assert quality.mode_config("naive:w-int8") is None
    with pytest.raises(ValueError, match="w-int4"):
        quality.mode_parts("bf16:w-int4")
