"""eval.quality_scaling: the random split sums to the real partials; the emulated axis runs the
real all_reduce; a tiny run on a random model reports the error's growth with N."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from equarx import AllReduceConfig
from eval import quality_scaling as qs


def test_split_parts_sum_to_the_partials_with_a_part_rms_of_one_over_sqrt_k():
    partials = jax.random.normal(jax.random.PRNGKey(0), (4, 64, 256), jnp.float32)
    partials = partials * jnp.arange(1, 65, dtype=jnp.float32)[None, :, None]  # row scales
    assert qs.split_parts(partials, 1, jax.random.PRNGKey(1)) is partials
    parts = np.asarray(qs.split_parts(partials, 4, jax.random.PRNGKey(1)))
    assert parts.shape == (16, 64, 256)
    np.testing.assert_allclose(parts.reshape(4, 4, 64, 256).sum(1), partials, rtol=0, atol=2e-4 * 64)
    # Per row, a part's rms is about its partial's / sqrt(k).
    ratio = (np.sqrt((parts.reshape(4, 4, 64, 256) ** 2).mean((1, 3)))
             / np.sqrt((np.asarray(partials) ** 2).mean(-1)))
    assert np.all(np.abs(ratio - 0.5) < 0.1), ratio


def test_an_exact_emulated_reduction_leaves_the_model_exact_and_int8_grows_with_n():
    """The float32 psum over 8 emulated devices gives the reference's logits up to float32
    rounding (the split and the vmapped axis lose nothing else); int8 on the full-loop ring
    errs more at 8 than at 4."""
    report = qs.run("random:tiny", [4, 8], ["f32", "int8-full"], n_tokens=47, window=48,
                    dtype="float32", log=lambda *a: None)
    rows = {(r["mode"], r["devices"]): r for r in report["rows"]}
    # The random parts sum to the partials up to float32 rounding: KL at the rounding's level.
    assert rows["f32", 8]["kl_to_f32"] < 1e-6 and rows["f32", 8]["top1_agree_f32"] >= 0.98
    assert rows["int8-full", 8]["kl_to_f32"] > 10 * rows["f32", 8]["kl_to_f32"]
    assert rows["int8-full", 8]["variant"] == "full"
    assert rows["int8-full", 8]["kl_to_f32"] > rows["int8-full", 4]["kl_to_f32"] > 0
    assert not rows["int8-full", 4]["emulated"] and rows["int8-full", 8]["emulated"]
    assert "int8-full" in qs.format_table(report["rows"])


def test_axis_sizes_must_be_multiples_of_the_real_tp():
    with pytest.raises(ValueError, match="multiple of 4"):
        qs.emulated_reduction(AllReduceConfig("int8"), 6)
