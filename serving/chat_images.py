"""Images in chat requests: which content parts are images, their checks and preprocessing (on a
thread, off the event loop), and the prompt ids with each image's soft tokens laid out.

A message with images renders as transformers' Gemma 3 template renders it. Each image is marked by
a sentinel unique to the request and replaced at the id level, so typed text never becomes an image.
Pan-and-scan is vLLM's `mm_processor_kwargs`. See docs/vision.md, "Serving images"."""
from __future__ import annotations

import dataclasses
import urllib.error
import urllib.parse
import urllib.request
import uuid

from serving import media

FETCH_SECONDS = 10.0


class ImageRequestError(ValueError):
    """A request whose images this server cannot take (a 400 with this message)."""


# The processor settings a request or the server may give, as transformers'
# Gemma3ImageProcessor names them, and media.PanAndScan's field each sets.
PROCESSOR_KWARGS = {"pan_and_scan_min_crop_size": "min_crop_size",
                    "pan_and_scan_max_num_crops": "max_num_crops",
                    "pan_and_scan_min_ratio_to_activate": "min_ratio_to_activate"}


def pan_and_scan(*kwargs: dict | None) -> media.PanAndScan | None:
    """The pan-and-scan settings of mm_processor_kwargs dicts (later ones win: the server's,
    then the request's), or None when `do_pan_and_scan` ends up off. Raises
    ImageRequestError naming an unknown or ill-typed key."""
    merged: dict = {}
    for kw in kwargs:
        if kw is None:
            continue
        if not isinstance(kw, dict):
            raise ImageRequestError("mm_processor_kwargs must be an object")
        merged.update(kw)
    unknown = sorted(set(merged) - set(PROCESSOR_KWARGS) - {"do_pan_and_scan"})
    if unknown:
        raise ImageRequestError(f"mm_processor_kwargs: unknown key(s) {', '.join(unknown)}; this "
                                f"server reads do_pan_and_scan and {', '.join(PROCESSOR_KWARGS)}")
    on = merged.get("do_pan_and_scan", False)
    if not isinstance(on, bool):
        raise ImageRequestError("mm_processor_kwargs.do_pan_and_scan must be true or false")
    settings = {}
    for key, field in PROCESSOR_KWARGS.items():
        if key in merged:
            v = merged[key]
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                  and (field == "min_ratio_to_activate" or float(v).is_integer()))
            if not ok:
                raise ImageRequestError(f"mm_processor_kwargs.{key} must be a positive "
                                        f"{'number' if field == 'min_ratio_to_activate' else 'integer'}")
            settings[field] = v if field == "min_ratio_to_activate" else int(v)
    return media.PanAndScan(**settings) if on else None


def with_crops(turns: list[tuple[str, str]], sentinel: str, crops: list[int]):
    """The turns with the i-th image (`sentinel`) that has crops[i] > 0 pan-and-scan crops
    written as the reference processor writes it: the original, then its crops, each one image
    (`multimodal.expand_image_placeholders`' text, with the sentinel for each image)."""
    from models.gemma3 import multimodal

    it = iter(crops)
    out = []
    for role, text in turns:
        first, *rests = text.split(sentinel)
        for rest, k in zip(rests, it):  # (rests first: zip then takes no count past them)
            first += multimodal.with_crops(sentinel, k) + rest
        out.append((role, first))
    return out


def image_parts(messages) -> list[dict]:
    """The image_url parts of chat messages, in prompt order."""
    out = []
    for m in messages:
        if isinstance(m.content, list):
            out += [p for p in m.content if isinstance(p, dict) and p.get("type") == "image_url"]
    return out


def vision_of(engine):
    """The engine's model's vision tower (a placed VisionModel), or None."""
    return getattr(getattr(engine, "model", None), "vision", None)


def check_allowed(engine, count: int, limit: int) -> None:
    """Raises ImageRequestError unless this engine can take `count` images in one prompt."""
    if vision_of(engine) is None:
        raise ImageRequestError("this model takes no images: it has no vision tower (a text-only "
                                "checkpoint); send text only, or serve a multimodal checkpoint")
    if count > limit:
        raise ImageRequestError(f"the request has {count} images; this server takes at most "
                                f"{limit} per prompt (--limit-mm-per-prompt)")


def _fetch(url: str, domains: frozenset[str], max_bytes: int) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in domains:
        raise media.RemoteImageError(
            f"remote image URLs are not allowed for host {host!r} on this server; send the image "
            "inline as a data: URL (data:image/png;base64,...), or the operator lists the host "
            "in --allowed-media-domains")

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        # A redirect could lead to a host the operator did not allow.
        def redirect_request(self, *args, **kwargs):
            raise media.RemoteImageError("the image URL redirects; give the final URL")

    opener = urllib.request.build_opener(NoRedirects)
    try:
        with opener.open(url, timeout=FETCH_SECONDS) as r:
            data = r.read(max_bytes + 1)
    except media.MediaError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise media.RemoteImageError(f"could not fetch the image URL: {e}") from None
    if len(data) > max_bytes:
        raise media.TooLargeError(f"image is larger than {max_bytes} bytes")
    return data


def prepare(parts: list[dict], image_size: int, domains: frozenset[str],
            crops: media.PanAndScan | None = None) -> list[media.PreparedImage]:
    """Decode and preprocess every image part (blocking: run it on a thread), with pan-and-scan
    crops when `crops` is given. Raises MediaError subclasses, each message naming the part."""
    out = []
    for i, part in enumerate(parts):
        try:
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if isinstance(url, str) and url[:8].lower().startswith(("http://", "https://")):
                out.append(media.prepare_image(_fetch(url, domains, media.MAX_BYTES),
                                               size=image_size, pan_and_scan=crops))
            else:
                out.append(media.image_from_content_part(part, size=image_size,
                                                         pan_and_scan=crops))
        except media.MediaError as e:
            raise type(e)(f"image {i + 1}: {e}") from None
    return out


@dataclasses.dataclass
class ImageTokenizer:
    """The model's tokenizer with each `sentinel` in a text becoming one image's ids (module
    docstring); every other attribute is the tokenizer's."""

    tok: object
    start: int
    end: int
    soft: int
    tokens_per_image: int
    sentinel: str = dataclasses.field(default_factory=lambda: f"\ue000{uuid.uuid4().hex}\ue000")

    def __getattr__(self, name):
        return getattr(self.__dict__["tok"], name)

    def encode(self, text: str) -> list[int]:
        pieces = text.replace(self.sentinel, f"\n\n{self.sentinel}\n\n").split(self.sentinel)
        ids = list(self.tok.encode(pieces[0])) if pieces[0] else []
        for rest in pieces[1:]:
            ids += [self.start, *[self.soft] * self.tokens_per_image, self.end]
            ids += self.tok.encode(rest) if rest else []
        return ids


def message_text(content, sentinel: str) -> str:
    """A message's content with images as `sentinel` (transformers' Gemma 3 template: parts
    concatenated, text trimmed)."""
    out = []
    for part in content:
        if part.get("type") == "image_url":
            out.append(sentinel)
        else:
            out.append(part["text"].strip())
    return "".join(out)


def soft_spans(ids, soft: int) -> list[tuple[int, int]]:
    from models.gemma3.multimodal import IMAGE_SOFT_TOKEN_ID, image_spans
    import numpy as np

    arr = np.asarray(ids)
    return list(image_spans(np.where(arr == soft, IMAGE_SOFT_TOKEN_ID, 0)))
