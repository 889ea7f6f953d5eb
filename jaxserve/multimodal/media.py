"""Images from URLs and bytes, within bounds: ``data:`` URLs, http(s) URLs (a timeout, a byte limit and an
optional domain allow-list: ``--allowed-media-domains``) and ``file://`` paths under
``--allowed-local-media-path`` only. An image's pixel count is read from its header and checked before it is
decoded (a decompression bomb is refused, not decoded). Every refusal is an ``InvalidRequestError`` naming
the problem (a 400 in the server). Blocking: the front end calls it on worker threads.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.error
import urllib.parse
import urllib.request
import warnings

from PIL import Image

from jaxserve.errors import InvalidRequestError

DEFAULT_MAX_PIXELS = 64 * 1024 * 1024        # 8192 x 8192
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allowed_domains: tuple[str, ...] | None = None     # None: any host
    allowed_local_path: str | None = None              # None: file:// refused


def decode_image(data: bytes, limits: MediaLimits, param: str = "image_url") -> Image.Image:
    """An RGB image of ``data``; refuses bytes that are not an image and images over ``limits.max_pixels``
    (checked on the header's size, before any pixel is decoded)."""
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"the image has {len(data)} bytes, more than the limit of {limits.max_bytes}",
                                  param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))          # reads the header only
            width, height = img.size
            if width * height > limits.max_pixels:
                raise InvalidRequestError(f"the image is {width}x{height} = {width * height} pixels, more than "
                                          f"the limit of {limits.max_pixels}", param=param)
            img.load()
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError("the image is larger than the pixel limit", param=param) from None
    except Exception as e:      # PIL raises many types for bytes that are not an image (or a broken one)
        raise InvalidRequestError(f"the data is not a readable image ({type(e).__name__}: {e})",
                                  param=param) from None
    return img.convert("RGB") if img.mode != "RGB" else img


def load_image_url(url: str, limits: MediaLimits, param: str = "image_url") -> Image.Image:
    """The image a ``data:``, ``http(s)://`` or ``file://`` URL names (see the module docstring)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("image_url.url must be a non-empty string", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, param), limits, param)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, limits, param), limits, param)
    if scheme == "file":
        return decode_image(_read_local(url, limits, param), limits, param)
    raise InvalidRequestError(f"image URL scheme {scheme or '(none)'!r} is not supported: use data:, http(s): or "
                              "file: (with --allowed-local-media-path)", param=param)


def _data_url_bytes(url: str, param: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().startswith("data:"):
        raise InvalidRequestError("the data URL is malformed: expected data:<type>;base64,<data>", param=param)
    if not head.lower().endswith(";base64"):
        raise InvalidRequestError("the data URL is not base64-encoded (data:<type>;base64,<data>)", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"the data URL's base64 payload is broken ({e})", param=param) from None


def _check_domain(url: str, limits: MediaLimits, param: str) -> None:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if limits.allowed_domains is not None and host not in limits.allowed_domains:
        raise InvalidRequestError(f"the image URL's domain {host!r} is not allowed (--allowed-media-domains)",
                                  param=param)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed domain (a redirect must not escape --allowed-media-domains)."""

    def __init__(self, limits: MediaLimits, param: str):
        self.limits, self.param = limits, param

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_domain(newurl, self.limits, self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, limits: MediaLimits, param: str) -> bytes:
    _check_domain(url, limits, param)
    opener = urllib.request.build_opener(_CheckedRedirects(limits, param))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "jaxserve"}),
                         timeout=limits.fetch_timeout_s) as resp:
            data = resp.read(limits.max_bytes + 1)
    except InvalidRequestError:
        raise
    except urllib.error.HTTPError as e:
        raise InvalidRequestError(f"fetching the image URL failed: HTTP {e.code}", param=param) from None
    except Exception as e:      # unreachable host, refused connection, timeout, bad TLS
        raise InvalidRequestError(f"the image URL could not be fetched ({type(e).__name__}: {e})",
                                  param=param) from None
    if len(data) > limits.max_bytes:
        raise InvalidRequestError(f"the image at the URL is larger than the limit of {limits.max_bytes} bytes",
                                  param=param)
    return data


def _read_local(url: str, limits: MediaLimits, param: str) -> bytes:
    if limits.allowed_local_path is None:
        raise InvalidRequestError("file:// image URLs are refused: the server allows local media only under "
                                  "--allowed-local-media-path", param=param)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(limits.allowed_local_path)
    if os.path.commonpath([path, root]) != root:
        raise InvalidRequestError("the file:// path is outside --allowed-local-media-path", param=param)
    try:
        if os.path.getsize(path) > limits.max_bytes:
            raise InvalidRequestError(f"the image file is larger than the limit of {limits.max_bytes} bytes",
                                      param=param)
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidRequestError(f"the image file cannot be read ({e.strerror})", param=param) from None
