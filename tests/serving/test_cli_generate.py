"""`gemma3-generate` end to end on a tiny random model (in this process, on 2 of the session's
virtual devices): the label-spelled AllReduce reaches the model and the prompt is generated."""
import pytest

from serving.cli import generate_main


def test_generate_streams_a_continuation(capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["The capital of France is", "--model", "random:tiny", "--tp", "2",
                       "--allreduce", "int8-semi+hadamard", "--max-tokens", "4",
                       "--compile-cache-dir", ""])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "allreduce=int8-semi+hadamard" in err
    assert "[4 tokens in" in err and "finish: length" in err


def test_generate_refuses_a_bad_label_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["hello", "--allreduce", "int8-diagonal"])
    assert e.value.code == 2 and "AllReduce label" in capsys.readouterr().err


def _png(path, color):
    from PIL import Image
    Image.new("RGB", (40, 30), color).save(path)
    return str(path)


def test_generate_with_an_image(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        generate_main(["What is in the picture?", "--model", "random:tiny?vision=tiny",
                       "--dtype", "float32", "--image", _png(tmp_path / "a.png", "red"),
                       "--image", _png(tmp_path / "b.png", "blue"), "--max-tokens", "4",
                       "--compile-cache-dir", ""])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "[4 tokens in" in err and "finish: length" in err


@pytest.mark.parametrize("model,content,message", [
    ("random:tiny", None, "takes no images"),
    ("random:tiny?vision=tiny", b"not an image", "not an image"),
])
def test_generate_refuses_an_image_it_cannot_take(capsys, tmp_path, model, content, message):
    path = tmp_path / "x.png"
    if content is None:
        _png(path, "red")
    else:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        generate_main(["hi", "--model", model, "--image", str(path), "--compile-cache-dir", ""])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
