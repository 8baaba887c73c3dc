"""eval.quality_images on a small run: the f32 AllReduce against itself is exact (the logits of
the same ragged step, images included), the int8 one close but not equal."""
from eval.quality_images import main


def test_kl_to_f32_with_images():
    report = main(["--tp", "2", "--modes", "f32,int8", "--prompts", "1", "--tokens", "8"])
    rows = {(r["mode"], r["images"]): r for r in report["rows"]}
    assert {k for k in rows} == {(m, n) for m in ("f32", "int8") for n in (0, 1, 2)}
    for n in (0, 1, 2):
        assert rows["f32", n]["kl_to_f32"] == 0 and rows["f32", n]["top1_agree_f32"] == 1
        assert 0 < rows["int8", n]["kl_to_f32"] < 1e-3
    assert rows["int8", 2]["positions"] == 1 + 8 + 2 * (2 + 8)  # soft tokens left out
