"""Image inputs: files made here with Pillow, checked against Pillow's own decode and
transformers' convert_to_rgb; every limit refused before the work it guards."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from localserve.errors import LocalserveError
from localserve.vision.image_input import (ImageInput, ImageLimits, check_image_count, image_from_base64,
                                           image_from_bytes, image_from_data_url)


def refused(call, *args) -> str:
    """The message of the LocalserveError ``call(*args)`` raises, which must be one line."""
    with pytest.raises(LocalserveError) as caught:
        call(*args)
    message = str(caught.value)
    assert message and "\n" not in message and "\r" not in message, message
    return message


def pattern(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """Deterministic, varied pixels (a flat image would hide a wrong conversion)."""
    bands = len(mode)
    rng = random.Random(f"{width}x{height}{mode}")
    return Image.frombytes(mode, (width, height), rng.randbytes(width * height * bands))


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def pillow_decode(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image


def png_claiming(width: int, height: int) -> bytes:
    """A small valid PNG whose IHDR says width x height (CRC recomputed): a decompression bomb."""
    data = bytearray(encode(pattern(4, 4), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


PNG = encode(pattern(10, 7), "PNG")


# Round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, options", [("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {}),
                                          ("WEBP", {"lossless": True}), ("BMP", {})])
def test_rgb_formats_round_trip(fmt, options):
    data = encode(pattern(33, 17), fmt, **options)
    image = image_from_bytes(data)
    assert (image.width, image.height, image.format) == (33, 17, fmt)
    assert image.data == data
    assert image.digest == hashlib.sha256(data).digest()
    rgb = image.rgb()
    assert rgb.mode == "RGB" and rgb.size == (33, 17)
    assert rgb.tobytes() == pillow_decode(data).convert("RGB").tobytes()


def test_lossless_formats_keep_the_pixels():
    source = pattern(9, 5)
    for fmt in ("PNG", "BMP"):
        assert image_from_bytes(encode(source, fmt)).rgb().tobytes() == source.tobytes()


def test_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (12, 8), color) for color in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert pillow_decode(data).n_frames == 3
    image = image_from_bytes(data)
    assert (image.width, image.height, image.format) == (12, 8, "GIF")
    assert image.rgb().tobytes() == frames[0].tobytes()


def test_animated_png_gives_its_first_frame():
    frames = [Image.new("RGB", (6, 6), color) for color in ((10, 20, 30), (200, 100, 0))]
    data = encode(frames[0], "PNG", save_all=True, append_images=frames[1:])
    assert image_from_bytes(data).rgb().tobytes() == frames[0].tobytes()


def test_repr_leaves_out_the_bytes():
    assert "data=" not in repr(image_from_bytes(PNG))


# Conversion to RGB, against transformers ---------------------------------------------------

def rgba_with_partial_transparency() -> Image.Image:
    image = pattern(16, 11, "RGBA")
    alpha = Image.frombytes("L", image.size, bytes((i * 37) % 256 for i in range(16 * 11)))  # 0 to 255
    image.putalpha(alpha)
    return image


def palette_with_a_transparent_index() -> Image.Image:
    image = pattern(15, 9).quantize(colors=16)
    image.info["transparency"] = 3
    return image


@pytest.mark.parametrize("fmt, make", [
    ("PNG", rgba_with_partial_transparency),
    ("WEBP", rgba_with_partial_transparency),
    ("PNG", lambda: pattern(13, 7, "L")),
    ("PNG", lambda: pattern(13, 7, "LA")),
    ("PNG", lambda: pattern(14, 6).quantize(colors=8)),
    ("PNG", palette_with_a_transparent_index),
    ("GIF", palette_with_a_transparent_index),
    ("BMP", lambda: pattern(13, 7, "L")),
])
def test_rgb_matches_transformers_convert_to_rgb(fmt, make):
    from transformers.image_transforms import convert_to_rgb

    options = {"lossless": True} if fmt == "WEBP" else {}
    source = make()
    data = encode(source, fmt, **options, **({"transparency": 3} if "transparency" in source.info else {}))
    expected = convert_to_rgb(pillow_decode(data), return_numpy=True)
    ours = np.asarray(image_from_bytes(data).rgb())
    assert ours.shape == expected.shape == (source.height, source.width, 3)
    assert np.array_equal(ours, expected)


def test_transparency_goes_on_white():
    clear = Image.new("RGBA", (3, 3), (0, 0, 0, 0))
    assert image_from_bytes(encode(clear, "PNG")).rgb().getpixel((1, 1)) == (255, 255, 255)


# base64 and data URLs ----------------------------------------------------------------------

def test_base64_round_trip_with_whitespace_around():
    text = base64.b64encode(PNG).decode()
    for sent in (text, f"\n  {text}\t \r\n"):
        image = image_from_base64(sent)
        assert image.data == PNG and image.digest == hashlib.sha256(PNG).digest()
        assert (image.width, image.height, image.format) == (10, 7, "PNG")


@pytest.mark.parametrize("prefix", ["data:image/png;base64,",
                                    "data:image/jpeg;base64,",  # mislabelled: the bytes decide
                                    "DATA:Image/PNG;BASE64,", "data:image/png;name=cat.png;base64,"])
def test_data_url_round_trip(prefix):
    url = prefix + base64.b64encode(PNG).decode()
    for image in (image_from_data_url(url), image_from_data_url(f" {url}\n"), image_from_base64(url)):
        assert image.data == PNG and (image.width, image.height, image.format) == (10, 7, "PNG")


@pytest.mark.parametrize("spoil", [
    lambda text: text[:8] + "*" + text[9:],  # not in the alphabet
    lambda text: text[:8] + "-" + text[9:],  # URL-safe alphabet
    lambda text: text[:8] + "é" + text[9:],  # not ASCII
    lambda text: text[:40] + "\n" + text[40:-1],  # a line break inside (strict)
    lambda text: text[:-4] + "=A==",  # padding in the middle
])
def test_invalid_base64_refused(spoil):
    text = spoil(base64.b64encode(PNG).decode())
    assert "not valid base64" in refused(image_from_base64, text)
    assert "not valid base64" in refused(image_from_data_url, "data:image/png;base64," + text)


def test_base64_without_padding_refused():
    text = base64.b64encode(PNG[:-1]).decode().rstrip("=")
    assert len(text) % 4
    assert "multiple of 4" in refused(image_from_base64, text)


@pytest.mark.parametrize("url", ["data:text/plain;base64,aGVsbG8=", "data:;base64,aGVsbG8=",
                                 "data:application/pdf;base64,aGVsbG8="])
def test_data_url_of_another_media_type_refused(url):
    assert "not an image" in refused(image_from_data_url, url)


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1:8080/cat.png",
                                 "HTTPS://example.com/cat.png"])
def test_http_urls_refused_without_fetching(url):
    for call in (image_from_data_url, image_from_base64):
        message = refused(call, url)
        assert "not fetched" in message and "inline as a data: URL" in message


@pytest.mark.parametrize("url", ["/tmp/cat.png", "file:///tmp/cat.png", r"C:\cat.png", "ftp://host/cat.png"])
def test_paths_and_other_schemes_refused(url):
    message = refused(image_from_data_url, url)
    assert "data: URL" in message and "not fetched" in message


def test_data_url_not_base64_refused():
    assert "base64-encoded" in refused(image_from_data_url, "data:image/png,%89PNG%0D%0A")
    assert "base64-encoded" in refused(image_from_data_url, "data:image/png;charset=utf-8,abcd")


def test_data_url_without_a_comma_refused():
    assert "','" in refused(image_from_data_url, "data:image/png;base64")


# Limits -------------------------------------------------------------------------------------

def test_over_max_bytes_refused():
    assert image_from_bytes(PNG, ImageLimits(max_bytes=len(PNG))).data == PNG
    message = refused(image_from_bytes, PNG, ImageLimits(max_bytes=len(PNG) - 1))
    assert message == f"the image is {len(PNG):,} bytes, over the limit of {len(PNG) - 1:,} bytes"


def test_default_max_bytes_is_20_mib():
    assert ImageLimits().max_bytes == 20 * 1024 * 1024
    assert "over the limit of 20,971,520 bytes" in refused(image_from_bytes, bytes((20 << 20) + 1))


def test_base64_over_max_bytes_refused_before_decoding(monkeypatch):
    text = base64.b64encode(PNG).decode()
    assert image_from_base64(text, ImageLimits(max_bytes=len(PNG))).data == PNG
    assert "once decoded from base64" in refused(image_from_base64, text, ImageLimits(max_bytes=len(PNG) - 1))

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the size was checked")

    monkeypatch.setattr(base64, "b64decode", no_decoding)
    # Not even valid base64: only a check of the length can give this message.
    message = refused(image_from_base64, "!" * 4000, ImageLimits(max_bytes=1000))
    assert message == "the image is 3,000 bytes once decoded from base64, over the limit of 1,000 bytes"
    assert "over the limit" in refused(image_from_data_url, "data:image/png;base64," + "A" * 4000,
                                       ImageLimits(max_bytes=1000))


@pytest.mark.parametrize("size", [30, 31, 32])  # two, one and no "=" of padding
def test_decoded_size_from_the_length_is_exact(size):
    text = base64.b64encode(bytes(size)).decode()
    assert f"is {size:,} bytes once decoded" in refused(image_from_base64, text, ImageLimits(max_bytes=size - 1))
    assert "not an image" in refused(image_from_base64, text, ImageLimits(max_bytes=size))


@pytest.mark.parametrize("width, height, message", [
    (100_000, 100_000, "an image of 10,000,000,000 pixels is over the limit of 33,177,600 pixels"),  # Pillow's error
    (10_000, 10_000, "an image of 100,000,000 pixels is over the limit of 33,177,600 pixels"),  # Pillow's warning
    (8_000, 8_000, "an image of 8,000 x 8,000 pixels is over the limit of 33,177,600 pixels"),  # ours alone
    (7_681, 4_320, "an image of 7,681 x 4,320 pixels is over the limit of 33,177,600 pixels"),
])
def test_decompression_bomb_refused_from_the_header(monkeypatch, width, height, message):
    data = png_claiming(width, height)
    assert len(data) < 200

    def no_decoding(self):
        raise AssertionError("pixels decoded before the header's size was checked")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    limit_before = Image.MAX_IMAGE_PIXELS
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert refused(image_from_bytes, data) == message
    assert time.perf_counter() - start < 2.0
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]  # refused, not printed
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_8k_is_within_the_pixel_limit():
    assert 7_680 * 4_320 == ImageLimits().max_pixels
    with Image.open(io.BytesIO(png_claiming(7_680, 4_320))) as claimed:
        assert claimed.size == (7_680, 4_320)  # the header passes; decoding then finds the data short
    assert "truncated or corrupt" in refused(image_from_bytes, png_claiming(7_680, 4_320))


def test_max_pixels_is_width_times_height():
    data = encode(pattern(10, 10), "PNG")
    assert image_from_bytes(data, ImageLimits(max_pixels=100)).width == 10
    assert refused(image_from_bytes, data, ImageLimits(max_pixels=99)) == \
        "an image of 10 x 10 pixels is over the limit of 99 pixels"


def test_rgb_refuses_bytes_whose_header_disagrees_with_the_checked_size(monkeypatch):
    bomb = png_claiming(100_000, 100_000)
    forged = ImageInput(data=bomb, digest=hashlib.sha256(bomb).digest(), width=4, height=4, format="PNG")
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded"))
    assert "over the limit of 16 pixels" in refused(forged.rgb)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_truncated_file_refused(fmt):
    data = encode(pattern(64, 48), fmt)
    message = refused(image_from_bytes, data[:len(data) // 2])
    assert "truncated" in message or "corrupt" in message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_png_and_jpeg_fail_on_decoding(fmt):
    data = encode(pattern(64, 48), fmt)
    assert refused(image_from_bytes, data[:len(data) // 2]).startswith(f"the {fmt} image is truncated or corrupt: ")


def test_random_bytes_refused():
    noise = random.Random(0).randbytes(4096)
    assert refused(image_from_bytes, noise) == \
        "the data is not an image Pillow can read (send PNG, JPEG, WebP, GIF or BMP)"
    assert "not an image" in refused(image_from_base64, base64.b64encode(noise).decode())


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM"])
def test_other_formats_refused_by_name(fmt):
    data = encode(pattern(16, 16), fmt)
    assert refused(image_from_bytes, data) == f"{fmt} images are not accepted: send PNG, JPEG, WebP, GIF or BMP"


def test_empty_refused():
    for call, empty in ((image_from_bytes, b""), (image_from_base64, ""), (image_from_base64, " \n "),
                        (image_from_data_url, "data:image/png;base64,")):
        assert refused(call, empty) == "the image is empty"


def test_image_count():
    check_image_count(0)
    check_image_count(16)
    assert refused(check_image_count, 17) == "17 images in one request are over the limit of 16 images"
    check_image_count(2, ImageLimits(max_images=2))
    assert "over the limit of 2 images" in refused(check_image_count, 3, ImageLimits(max_images=2))
