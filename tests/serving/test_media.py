"""Image decoding and preprocessing (serving/media.py): real PNG/JPEG/WebP/GIF bytes made with
Pillow here, every conversion mode, the reference processor's numbers, every bad input."""
import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serving import media

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "gemma3_vision_tiny_hf.npz"


def encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_formats_decode_to_normalized_pixels(picture, fmt, mime):
    prepared = media.image_from_content_part(part(data_url(encoded(picture, fmt), mime)), size=16)
    assert prepared.pixels.shape == (1, 16, 16, 3) and prepared.pixels.dtype == np.float32
    assert prepared.crops == 0 and prepared.original_size == (40, 30)
    assert -1.0 <= prepared.pixels.min() and prepared.pixels.max() <= 1.0


def test_lossless_pixels_are_the_reference_formula(picture):
    got = media.prepare_image(encoded(picture, "PNG"), size=40).pixels[0]
    # A 40-wide image resized to 40x40 is only resampled vertically; compare to Pillow's own.
    want = np.asarray(picture.resize((40, 40), Image.Resampling.BILINEAR), np.float64) / 255
    np.testing.assert_allclose(got, (want - 0.5) / 0.5, atol=1e-6)


def test_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    px = media.prepare_image(buf.getvalue(), size=8).pixels[0]
    np.testing.assert_allclose(px[..., 0], 1.0, atol=1e-6)  # red, not the blue second frame
    np.testing.assert_allclose(px[..., 2], -1.0, atol=1e-6)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "PA", "1", "I;16", "CMYK"])
def test_conversion_modes(mode):
    img = Image.new("RGBA", (6, 4), (255, 0, 0, 0)).convert(mode) if mode != "P" else None
    if mode == "P":
        img = Image.new("P", (6, 4), 1)
        img.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    fmt = {"CMYK": "JPEG", "I;16": "PNG"}.get(mode, "PNG" if mode != "PA" else "PNG")
    if mode == "PA":
        fmt = "WEBP"
        img = Image.new("RGBA", (6, 4), (0, 255, 0, 0))
    rgb = media.decode_image(encoded(img, fmt))
    assert rgb.mode == "RGB" and rgb.size == (6, 4)
    if mode == "P":
        assert rgb.getpixel((0, 0)) == (0, 255, 0)


def test_transparency_composites_onto_white():
    img = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    img.putpixel((0, 0), (255, 0, 0, 255))
    rgb = media.decode_image(encoded(img, "PNG"))
    assert rgb.getpixel((1, 1)) == (255, 255, 255) and rgb.getpixel((0, 0)) == (255, 0, 0)
    pal = Image.new("P", (2, 1), 0)
    pal.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 0
    rgb = media.decode_image(encoded(pal, "PNG", transparency=0))
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((1, 0)) == (200, 100, 50)


def test_matches_transformers_preprocessing_with_pan_and_scan():
    golden = np.load(GOLDEN)
    settings = media.PanAndScan(min_crop_size=16, max_num_crops=4, min_ratio_to_activate=1.2)
    for j in range(4):
        mode = str(golden[f"pre_mode_{j}"])
        img = Image.fromarray(golden[f"pre_src_{j}"], mode)
        if mode == "P":
            img.putpalette(golden[f"pre_palette_{j}"].tolist())
        got = media.preprocess(media.to_rgb(img), size=32, pan_and_scan=settings)
        want = golden[f"pre_out_{j}"]
        assert got.shape == want.shape, mode
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=mode)


def test_pan_and_scan_off_by_default_and_hash():
    wide = Image.new("RGB", (1200, 400), (1, 2, 3))  # 3 crops of 400x400
    data = encoded(wide, "PNG")
    assert media.prepare_image(data, size=8).crops == 0
    on = media.prepare_image(data, size=8, pan_and_scan=media.PanAndScan())
    assert on.crops == 3 and on.pixels.shape == (4, 8, 8, 3)
    again = media.prepare_image(encoded(wide, "WEBP", lossless=True), size=8)
    assert again.content_hash == media.prepare_image(data, size=8).content_hash
    assert on.content_hash != again.content_hash


# ---------------------------------------------------------------------------------------------
# Bad input


def test_not_an_image():
    with pytest.raises(media.NotAnImageError, match="not an image"):
        media.image_from_content_part(part(data_url(b"hello, world")))
    bmp = encoded(Image.new("RGB", (2, 2)), "BMP")  # an image, but not an accepted format
    with pytest.raises(media.NotAnImageError):
        media.prepare_image(bmp)


def test_truncated_base64(picture):
    url = data_url(encoded(picture, "PNG"))
    with pytest.raises(media.Base64Error, match="truncated"):
        media.image_from_content_part(part(url[:-3]))
    with pytest.raises(media.Base64Error):
        media.parse_data_url("data:image/png;base64,ab$d")


def test_truncated_image_bytes(picture):
    data = encoded(picture, "PNG")
    with pytest.raises(media.NotAnImageError, match="corrupt or truncated"):
        media.prepare_image(data[: len(data) // 2])


def test_too_many_pixels():
    big = encoded(Image.new("L", (400, 300)), "PNG")
    with pytest.raises(media.TooManyPixelsError, match="400x300"):
        media.prepare_image(big, max_pixels=100_000)
    media.prepare_image(big, max_pixels=120_000, size=4)


def test_too_many_bytes(picture):
    with pytest.raises(media.TooLargeError):
        media.image_from_content_part(part(data_url(encoded(picture, "PNG"))), max_bytes=100)


@pytest.mark.parametrize("url,error", [
    ("https://example.com/cat.png", media.RemoteImageError),
    ("HTTP://example.com/cat.png", media.RemoteImageError),
    ("file:///etc/passwd", media.BadImageURLError),
    ("data:text/plain;base64,aGVsbG8=", media.BadImageURLError),
    ("data:image/png,rawbytes", media.BadImageURLError),
    ("data:image/png;base64,", media.NotAnImageError),
    ("", media.BadImageURLError),
])
def test_bad_urls(url, error):
    with pytest.raises(error):
        media.image_from_content_part(part(url))


def test_bad_parts():
    with pytest.raises(media.BadImageURLError):
        media.image_from_content_part({"type": "text", "text": "hi"})
    with pytest.raises(media.BadImageURLError):
        media.image_from_content_part({"type": "image_url", "image_url": {}})
    assert issubclass(media.MediaError, ValueError)


def test_url_as_plain_string(picture):
    prepared = media.image_from_content_part(
        {"type": "image_url", "image_url": data_url(encoded(picture, "PNG"))}, size=4)
    assert prepared.pixels.shape == (1, 4, 4, 3)
