"""Capture time and a counter drawn into a frame as black/white blocks, and read back from its pixels.

Three rows of 32 blocks (:data:`BLOCK` pixels square) at the top-left: the capture time's low 32 bits in
milliseconds, the counter, and the time's bits inverted (a check that the read is not a torn or smeared
frame). Pure Python for drawing (the rig runs on the system Python, without numpy); reading takes a numpy
BGR image. Frames must be at least 32 * BLOCK pixels wide.
"""

BLOCK = 12
BITS = 32
GREY = 96


def _row(value, width):
    white, black = b"\xff" * 3 * BLOCK, b"\x00" * 3 * BLOCK
    pixels = b"".join(white if (value >> (BITS - 1 - i)) & 1 else black for i in range(BITS))
    return (pixels + bytes([GREY]) * 3 * (width - BITS * BLOCK)) * BLOCK


def body_level(counter):
    """The grey of the frame's body below the code rows when it follows the counter (``draw(..., moving=True)``):
    every frame differs from the one before, so a decoder's concealment (last frame's pixels) shows."""
    return 48 + 48 * (counter % 4)


def draw(width, height, time_ms, counter, moving=False):
    """One BGR frame (bytes, row-major) carrying ``time_ms`` (wall clock) and ``counter``; its body is
    :data:`GREY`, or :func:`body_level` of the counter when ``moving``."""
    low = time_ms & 0xFFFFFFFF
    rows = _row(low, width) + _row(counter & 0xFFFFFFFF, width) + _row(~low & 0xFFFFFFFF, width)
    return rows + bytes([body_level(counter) if moving else GREY]) * 3 * width * (height - 3 * BLOCK)


def read(image, now_ms):
    """(capture time in ms, counter) read from a BGR numpy image, or None when the check row disagrees.

    The time's high bits come from ``now_ms`` (the reader's clock): the value nearest to it with the same low
    32 bits (unambiguous for ages under 24 days).
    """
    centre = BLOCK // 2
    values = []
    for r in range(3):
        y = r * BLOCK + centre
        bits = [int(image[y, i * BLOCK + centre - 2:i * BLOCK + centre + 3].mean() > 127) for i in range(BITS)]
        values.append(sum(b << (BITS - 1 - i) for i, b in enumerate(bits)))
    low, counter, check = values
    if check != (~low & 0xFFFFFFFF):
        return None
    full = (now_ms & ~0xFFFFFFFF) | low
    candidates = (full - (1 << 32), full, full + (1 << 32))
    return min(candidates, key=lambda t: abs(now_ms - t)), counter
