"""The zip records (PKWARE's APPNOTE.TXT) that the bundle reader and writer both work on.

Neither side leaves the format to ``zipfile`` alone: the writer lays out every byte itself (padding
that aligns ``weights.bin``, fixed timestamps for reproducible output), and the reader checks what
``zipfile`` lets pass (data offsets from the local headers, end records that end the file). The
record layouts and flag bits live here once, so the two sides cannot drift apart.
"""

from __future__ import annotations

import struct

__all__ = [
    "ZIP_MAGIC",
    "LOCAL_HEADER",
    "CENTRAL_HEADER",
    "EOCD",
    "EOCD64",
    "EOCD64_LOCATOR",
    "LOCAL_SIG",
    "CENTRAL_SIG",
    "EOCD_SIG",
    "EOCD64_SIG",
    "EOCD64_LOCATOR_SIG",
    "ZIP64_EXTRA_ID",
    "FLAG_ENCRYPTED",
    "FLAG_UTF8",
    "FLAG_DESCRIPTOR",
    "FLAGS_ENCRYPTION",
]

#: How a zip archive (a file bundle) starts: a local file header, or the end record of an empty one.
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes + name + extra
CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes + name + extra + comment
EOCD = struct.Struct("<IHHHHIIH")
EOCD64 = struct.Struct("<IQHHIIQQQQ")
EOCD64_LOCATOR = struct.Struct("<IIQI")
LOCAL_SIG, CENTRAL_SIG, EOCD_SIG = 0x04034B50, 0x02014B50, 0x06054B50
EOCD64_SIG, EOCD64_LOCATOR_SIG = 0x06064B50, 0x07064B50
ZIP64_EXTRA_ID = 0x0001
FLAG_ENCRYPTED, FLAG_UTF8 = 0x0001, 0x0800

# Reading: what a zip entry may carry (§1.2). Bit 3 means sizes and CRC follow the data in a
# descriptor instead of the local header; bits 0, 6 and 13 are the encryption variants.
FLAG_DESCRIPTOR = 0x0008
FLAGS_ENCRYPTION = FLAG_ENCRYPTED | 0x0040 | 0x2000
