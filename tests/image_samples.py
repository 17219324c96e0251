"""Generated test images as data URIs: gradients, EXIF-rotated photos, and PNG headers that declare huge sizes."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def gradient(width: int, height: int, shift: int = 0) -> Image.Image:
    """A deterministic RGB gradient, different for each shift."""
    img = Image.new("RGB", (width, height))
    img.putdata(
        [
            ((x * 3 + shift) % 256, (y * 4 + 2 * shift) % 256, (x * y + shift) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    return img


def encode(img: Image.Image, fmt: str = "PNG", **save) -> bytes:
    """The image file bytes in the given format."""
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    return buf.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    """A data URI with a canonical header."""
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def png_uri(img: Image.Image) -> str:
    """An image as a PNG data URI."""
    return data_uri(encode(img, "PNG"))


def _chunk(kind: bytes, body: bytes) -> bytes:
    """One PNG chunk with its length and CRC."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def declared_png(width: int, height: int) -> bytes:
    """A tiny PNG file whose header declares width x height 1-bit gray pixels (a decompression bomb's header)."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def exif_rotated_jpeg(width: int, height: int, orientation: int) -> bytes:
    """A JPEG whose top half is red and bottom half blue, tagged with an EXIF orientation."""
    img = Image.new("RGB", (width, height), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, width, height // 2))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())
