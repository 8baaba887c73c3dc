"""Image input for Gemma 3: decoding, preprocessing and OpenAI `image_url` parts, in the HTTP
process.

`image_from_content_part` decodes a data: URL with Pillow and preprocesses as transformers'
Gemma3ImageProcessor does; bad input raises a `MediaError` (a 400). Remote URLs are refused here
(`RemoteImageError`): fetching them is the API layer's choice. See docs/vision.md, "The flow the
engine and API follow"."""
from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
import re
import warnings

import numpy as np

IMAGE_SIZE = 896
# Decoded pixels (width x height) above which an image is refused before it is decoded: a
# 50-megapixel RGBA image is 200 MB of memory in the HTTP process.
MAX_PIXELS = 50_000_000
# Encoded bytes of one image (before base64).
MAX_BYTES = 20 << 20
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MEAN = STD = 0.5


class MediaError(ValueError):
    """An image input the server cannot use; the message is safe to return to the client."""


class NotAnImageError(MediaError):
    """Bytes that Pillow cannot read as an image, or of a format not accepted here."""


class Base64Error(MediaError):
    """A data: URL whose base64 payload is malformed or truncated."""


class TooManyPixelsError(MediaError):
    """An image larger than the pixel limit."""


class TooLargeError(MediaError):
    """Encoded image bytes over the size limit."""


class BadImageURLError(MediaError):
    """An image_url part that is not a well-formed data: URL with an image type."""


class RemoteImageError(MediaError):
    """An http(s) image URL (not fetched by this module)."""


@dataclasses.dataclass(frozen=True)
class PanAndScan:
    """The reference processor's pan-and-scan settings (its defaults)."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    """One image ready for the encoder.

    pixels: float32 [1 + crops, size, size, 3], normalized, channels last; the original image
    first, then its pan-and-scan crops (each is one "image" of 256 soft tokens).
    content_hash: sha256 of the decoded RGB pixels and the settings, the key of an encoder
    feature cache (two encodings of one picture hash alike)."""

    pixels: np.ndarray
    crops: int
    content_hash: str
    original_size: tuple[int, int]  # (width, height)


# ---------------------------------------------------------------------------------------------
# data: URLs

_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)$", re.S)


def parse_data_url(url: str, max_bytes: int = MAX_BYTES) -> tuple[str, bytes]:
    """(media type, decoded bytes) of a base64 image data: URL."""
    if not isinstance(url, str):
        raise BadImageURLError("image_url.url must be a string")
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise RemoteImageError("remote image URLs are not enabled on this server; send the image "
                               "inline as a data: URL (data:image/png;base64,...)")
    m = _DATA_URL.match(url)
    if not m:
        raise BadImageURLError("image_url.url must be a data: URL (data:image/png;base64,...)")
    mime = m.group("mime").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if mime and not mime.startswith("image/"):
        raise BadImageURLError(f"data: URL has media type {mime!r}, expected image/*")
    if "base64" not in params:
        raise BadImageURLError("data: URL must be base64-encoded (data:image/...;base64,...)")
    data = re.sub(r"\s+", "", m.group("data"))
    if len(data) * 3 // 4 > max_bytes + 3:
        raise TooLargeError(f"image is larger than {max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        hint = " (truncated?)" if len(data) % 4 else ""
        raise Base64Error(f"image data is not valid base64{hint}: {e}") from None
    if not raw:
        raise NotAnImageError("image data is empty")
    return mime or "image/*", raw


# ---------------------------------------------------------------------------------------------
# Decoding


def decode_image(data: bytes, max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES):
    """A fully loaded RGB PIL image from encoded bytes (gif: its first frame)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise TooLargeError(f"image is larger than {max_bytes} bytes")
    with warnings.catch_warnings():
        # Pillow's own bomb check warns at a lower count than ours and raises at 2x; ours rules.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError:
            raise NotAnImageError("the data is not an image in a supported format "
                                  f"({', '.join(f.lower() for f in FORMATS)})") from None
        except Image.DecompressionBombError:
            raise TooManyPixelsError(f"image has more than {max_pixels} pixels") from None
        w, h = img.size
        if w * h > max_pixels:
            raise TooManyPixelsError(f"image is {w}x{h} = {w * h} pixels, more than the limit "
                                     f"of {max_pixels}")
        if w < 1 or h < 1:
            raise NotAnImageError(f"image has no pixels ({w}x{h})")
        try:
            img.seek(0)
            img.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise NotAnImageError(f"the image data is corrupt or truncated: {e}") from None
    return to_rgb(img)


def to_rgb(img):
    """RGB, compositing any transparency (alpha band, palette or grayscale transparency) onto
    white, as the reference processor does."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


# ---------------------------------------------------------------------------------------------
# Preprocessing


def normalize(img, size: int = IMAGE_SIZE) -> np.ndarray:
    """An RGB PIL image -> float32 [size, size, 3] in [-1, 1]."""
    from PIL import Image

    resized = img.resize((size, size), resample=Image.Resampling.BILINEAR)
    x = np.asarray(resized, dtype=np.uint8).astype(np.float64) * (1 / 255)
    return ((x.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)).astype(np.float32)


def pan_and_scan_crops(img, settings: PanAndScan = PanAndScan()) -> list:
    """The reference processor's crops of an image (none for a near-square or small one)."""
    width, height = img.size
    if width >= height:
        if width / height < settings.min_ratio_to_activate:
            return []
        n_w = min(int(math.floor(width / settings.min_crop_size)), int(math.floor(width / height + 0.5)))
        n_w, n_h = min(settings.max_num_crops, max(2, n_w)), 1
    else:
        if height / width < settings.min_ratio_to_activate:
            return []
        n_h = min(int(math.floor(height / settings.min_crop_size)), int(math.floor(height / width + 0.5)))
        n_w, n_h = 1, min(settings.max_num_crops, max(2, n_h))
    crop_w, crop_h = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
    if min(crop_w, crop_h) < settings.min_crop_size:
        return []
    # numpy slicing semantics: a last crop past the edge is cut short, as the reference's is.
    return [img.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
            for y in range(0, crop_h * n_h, crop_h) for x in range(0, crop_w * n_w, crop_w)]


def preprocess(img, size: int = IMAGE_SIZE, pan_and_scan: PanAndScan | None = None) -> np.ndarray:
    """An RGB PIL image -> float32 [1 + crops, size, size, 3]."""
    crops = pan_and_scan_crops(img, pan_and_scan) if pan_and_scan is not None else []
    return np.stack([normalize(x, size) for x in [img, *crops]])


def prepare_image(data: bytes, *, size: int = IMAGE_SIZE, pan_and_scan: PanAndScan | None = None,
                  max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES) -> PreparedImage:
    """Encoded image bytes -> a PreparedImage; raises MediaError subclasses."""
    img = decode_image(data, max_pixels=max_pixels, max_bytes=max_bytes)
    pixels = preprocess(img, size, pan_and_scan)
    h = hashlib.sha256()
    h.update(repr((img.size, size, pan_and_scan)).encode())
    h.update(img.tobytes())
    return PreparedImage(pixels=pixels, crops=pixels.shape[0] - 1, content_hash=h.hexdigest(),
                         original_size=img.size)


def image_from_content_part(part: dict, **kwargs) -> PreparedImage:
    """An OpenAI chat content part {"type": "image_url", "image_url": {"url": ...}} (or the
    url given as a plain string) -> a PreparedImage; keyword arguments as `prepare_image`."""
    if not isinstance(part, dict) or part.get("type") != "image_url":
        raise BadImageURLError("expected a content part of type 'image_url'")
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise BadImageURLError("image_url.url is missing")
    _, data = parse_data_url(url, max_bytes=kwargs.get("max_bytes", MAX_BYTES))
    return prepare_image(data, **kwargs)
