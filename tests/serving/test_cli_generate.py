"""`gemma3-generate` end to end (in this process): on a tiny random model (on 2 of the session's
virtual devices) the label-spelled AllReduce reaches the model and the prompt is generated, and
its seeded text is the engine's."""
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


def _engine_text(prompt: str, params) -> str:
    """The prompt through the engine `gemma3-generate` builds (random:tiny in float32 at the
    default context, one sequence, no prefix cache), driven in this process."""
    import threading

    from models.gemma3 import load_model
    from serving.config import ServerConfig
    from serving.engine_core import EngineCore
    from serving.paged_runner import PagedRunner

    context = ServerConfig().max_seq_len
    model = load_model("random:tiny", tp=1, dtype="float32", max_seq_len=context)
    core = EngineCore(PagedRunner(model, max_num_seqs=1, max_seq_len=context,
                                  prefix_caching=False)).start()
    text, done = [], threading.Event()
    try:
        core.submit([([model.tokenizer.bos_id] + model.tokenizer.encode(prompt), params,
                      lambda e: (text.append(e.text), e.finish_reason and done.set()))])
        assert done.wait(300)
    finally:
        core.shutdown()
    return "".join(text)


def test_generate_prints_the_engines_text(capsys):
    """What it prints: the engine's text for the same prompt and sampling settings (sampled
    with a seed), built here in the test process. The server's own answers on the real 270M:
    tests/serving/test_server_e2e.py."""
    from serving.sampling import SamplingParams

    prompt = "The capital of France is"
    with pytest.raises(SystemExit) as e:
        generate_main([prompt, "--model", "random:tiny", "--dtype", "float32", "--max-tokens", "16",
                       "--compile-cache-dir", "", "--temperature", "0.8", "--top-k", "40",
                       "--seed", "5"])
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    assert "[16 tokens in" in out.err
    want = _engine_text(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=5))
    assert len(want) >= 8  # text, not a stop at once
    assert out.out == want + "\n"
