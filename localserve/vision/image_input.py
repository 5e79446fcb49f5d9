"""Images as clients send them, checked before anything is decoded.

OpenAI's ``image_url`` carries a data URL, Ollama's ``images`` and Anthropic's ``source``
a base64 string. Each becomes an ImageInput: the encoded bytes as received, their sha256
(the key of the encoder cache and of the prefix cache), and the size and format read
from the header. Every limit is checked before the costly step it protects: the size
of the base64 text before decoding it, the encoded size before Pillow sees the bytes,
the pixel count from the header before the pixels are allocated. The file is then
decoded once, so a truncated or corrupt image is refused with the request, not later
in the engine. Each refusal is a LocalserveError (a 400) with a one-line message.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import struct
import warnings
from dataclasses import dataclass, field

from PIL import Image

from ..errors import LocalserveError

# What the models' processors are known to see; the other formats Pillow reads (TIFF,
# ICO, PSD, ...) are refused rather than sent through less-exercised parsers.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_ACCEPTED_NAMES = "PNG, JPEG, WebP, GIF or BMP"
_DATA_URL_SHAPE = "data:image/png;base64,..."

# What Pillow raises on a broken or hostile file (the set its own fuzz tests allow).
# UnidentifiedImageError is an OSError.
_PILLOW_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error,
                  Image.DecompressionBombError, Image.DecompressionBombWarning)
_BOMB_ERRORS = (Image.DecompressionBombError, Image.DecompressionBombWarning)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded size of one image
    max_pixels: int = 33_177_600  # width * height of one image (8K), checked from the header before decoding
    max_images: int = 16  # images in one request


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One checked image. Make it with image_from_bytes / _base64 / _data_url: they read
    width, height and format from ``data`` and check them against the request's limits."""

    data: bytes = field(repr=False)  # the encoded file as received (out of repr: megabytes in a log line)
    digest: bytes  # sha256 of data (32 bytes): the key of the encoder cache and the prefix cache
    width: int
    height: int
    format: str  # Pillow's format name: "PNG", "JPEG", "WEBP", "GIF" or "BMP"

    def rgb(self) -> Image.Image:
        """The first frame, decoded and converted to RGB as transformers' convert_to_rgb
        does (transparency composited on white), so the pixels match the reference
        processors'. The header must still say width x height: that is the pixel count
        checked when this was made, so the same bomb protection holds here."""
        image = _decode(self.data, self.width * self.height, expected_size=(self.width, self.height))
        try:
            return _to_rgb(image)
        except _PILLOW_ERRORS as exc:
            raise LocalserveError(f"the {self.format} image (mode {image.mode}) cannot be converted to RGB: "
                                  f"{_one_line(exc)}") from None


def image_from_bytes(data: bytes, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """The image in ``data`` (an encoded file), checked and decoded once."""
    _check_byte_count(len(data), limits, "")
    data = bytes(data)  # a bytearray or memoryview would let the caller change it under the digest
    image = _decode(data, limits.max_pixels)
    return ImageInput(data=data, digest=hashlib.sha256(data).digest(), width=image.width, height=image.height,
                      format=_format_name(image))


def image_from_base64(text: str, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """The image in a base64 string (Ollama's ``images``, Anthropic's ``source.data``);
    a data URL is taken too, as some Ollama clients send one."""
    text = text.strip()
    if _URL_SCHEME.match(text):  # base64 has no ':', so this is a URL or a Windows path
        return image_from_data_url(text, limits)
    return image_from_bytes(_decode_base64(text, limits), limits)


def image_from_data_url(url: str, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """The image in an OpenAI ``image_url``: ``data:image/<type>;base64,<data>`` only.
    Nothing is fetched, so a daemon never reaches out to hosts (or reads files) that a
    client names."""
    url = url.strip()
    scheme, colon, rest = url.partition(":")
    scheme = scheme.lower()
    if colon and scheme in ("http", "https"):
        raise LocalserveError(f"image URLs are not fetched: send the image inline as a data: URL ({_DATA_URL_SHAPE}), "
                              "or start the daemon with --allow-image-urls")
    if not colon or scheme != "data":
        raise LocalserveError(f"the image must be a data: URL ({_DATA_URL_SHAPE}); image URLs and file paths "
                              "are not fetched")
    header, comma, payload = rest.partition(",")
    if not comma:
        raise LocalserveError(f"the image data URL has no ',' before its data ({_DATA_URL_SHAPE})")
    media_type, *parameters = (part.strip().lower() for part in header.split(";"))
    if not media_type.startswith("image/"):
        # RFC 2397: no media type means text/plain.
        raise LocalserveError(f"the data URL is of type {_quoted(media_type or 'text/plain')}, not an image "
                              f"({_DATA_URL_SHAPE})")
    # The declared subtype is not trusted either way: clients mislabel, and the format is
    # read from the bytes.
    if parameters[-1:] != ["base64"]:
        raise LocalserveError(f"the image data URL must be base64-encoded ({_DATA_URL_SHAPE})")
    return image_from_bytes(_decode_base64(payload.strip(), limits), limits)


def check_image_count(count: int, limits: ImageLimits = ImageLimits()) -> None:
    if count > limits.max_images:
        raise LocalserveError(f"{count:,} images in one request are over the limit of {limits.max_images:,} images")


_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def _decode_base64(text: str, limits: ImageLimits) -> bytes:
    """Strict base64 (the standard alphabet, padded, no whitespace inside), its decoded
    size checked from the length before anything is decoded."""
    if not text:
        raise LocalserveError("the image is empty")
    if len(text) % 4:
        raise LocalserveError(f"the image is not valid base64: {len(text):,} characters is not a multiple of 4")
    _check_byte_count(len(text) // 4 * 3 - text[-2:].count("="), limits, " once decoded from base64")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error, or a non-ASCII character
        raise LocalserveError(f"the image is not valid base64: {_one_line(exc)}") from None


def _check_byte_count(size: int, limits: ImageLimits, how: str) -> None:
    if size == 0:
        raise LocalserveError("the image is empty")
    if size > limits.max_bytes:
        raise LocalserveError(f"the image is {size:,} bytes{how}, over the limit of {limits.max_bytes:,} bytes")


def _decode(data: bytes, max_pixels: int, expected_size: tuple[int, int] | None = None) -> Image.Image:
    """The first frame of ``data``, decoded, after the header's size was checked."""
    with warnings.catch_warnings():
        # Pillow only warns between its limit and twice it; as an error the warning
        # cannot reach a log (or be missed) instead of refusing. Our own check below is
        # what holds when threads race on the (process-wide) warning filters, and when
        # max_pixels is above Pillow's limit the warning is ours to ignore.
        pillow_limit = Image.MAX_IMAGE_PIXELS
        escalate = pillow_limit is not None and max_pixels <= pillow_limit
        warnings.simplefilter("error" if escalate else "ignore", Image.DecompressionBombWarning)
        image = _open(data, max_pixels)
        with image:
            _check_header(image, max_pixels, expected_size)
            try:
                image.load()  # allocates width x height, reads every byte
            except _BOMB_ERRORS as exc:
                raise _bomb_refusal(exc, max_pixels) from None
            except _PILLOW_ERRORS as exc:
                raise LocalserveError(f"the {_format_name(image)} image is truncated or corrupt: "
                                      f"{_one_line(exc)}") from None
    return image


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Pillow's lazy open: it identifies the file and reads its header, no pixels."""
    try:
        return Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except _BOMB_ERRORS as exc:
        raise _bomb_refusal(exc, max_pixels) from None
    except Image.UnidentifiedImageError:
        raise LocalserveError(_unaccepted(data)) from None
    except _PILLOW_ERRORS as exc:  # identified, but its header is broken
        raise LocalserveError(f"the image is corrupt: {_one_line(exc)}") from None


def _check_header(image: Image.Image, max_pixels: int, expected_size: tuple[int, int] | None) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise LocalserveError(f"the {_format_name(image)} image is {width:,} x {height:,} pixels: it has no pixels")
    if width * height > max_pixels:
        raise LocalserveError(f"an image of {width:,} x {height:,} pixels is over the limit of {max_pixels:,} pixels")
    if expected_size is not None and image.size != expected_size:
        raise LocalserveError(f"the image is {width:,} x {height:,} pixels, not the {expected_size[0]:,} x "
                              f"{expected_size[1]:,} it was checked at")


def _bomb_refusal(exc: Exception, max_pixels: int) -> LocalserveError:
    """Pillow's own decompression-bomb check (in Image.open, before ours can run) names
    the pixel count only; say it as our limit's refusal where it is one."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    if found is None:
        return LocalserveError(f"the image is over the limit of {max_pixels:,} pixels ({_one_line(exc)})")
    pixels = int(found.group(1))
    if pixels > max_pixels:
        return LocalserveError(f"an image of {pixels:,} pixels is over the limit of {max_pixels:,} pixels")
    return LocalserveError(f"an image of {pixels:,} pixels is over Pillow's decompression-bomb limit "
                           f"({_one_line(exc)})")


def _unaccepted(data: bytes) -> str:
    """Why bytes that none of the accepted formats' plugins took are refused: named, if
    another of Pillow's formats reads its header (nothing more is read)."""
    name = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # only a name is wanted here
            with Image.open(io.BytesIO(data)) as image:
                name = image.format
    except Exception:  # noqa: BLE001 - any failure means "not an image Pillow can read"; only the message depends on it
        pass
    if name:
        return f"{name} images are not accepted: send {_ACCEPTED_NAMES}"
    return f"the data is not an image Pillow can read (send {_ACCEPTED_NAMES})"


def _format_name(image: Image.Image) -> str:
    # A JPEG with extra pictures in it (MPO, as phone cameras write) is opened by the JPEG
    # plugin; its first picture is an ordinary JPEG.
    return "JPEG" if image.format == "MPO" else str(image.format)


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers.image_transforms.convert_to_rgb for a PIL image, without importing
    transformers: alpha, or a palette / colour key marked transparent, is composited on
    white; anything else is Pillow's plain conversion."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _quoted(text: str, limit: int = 40) -> str:
    """Text from a client, short and on one line (repr escapes newlines)."""
    return repr(text[:limit] + "..." if len(text) > limit else text)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return " ".join(line.strip() for line in lines)[:200] or type(exc).__name__
