"""A facade: the names this module exported when it held the whole bundle container, re-exported.

The container is now one module per job: ``engine.bundle.manifest`` (format constants, limits,
``manifest.json``, member names), ``engine.bundle.zipformat`` (the zip records),
``engine.bundle.reader`` (``BundleArchive``: opening and validating bundles, mmap views),
``engine.bundle.writer`` (streaming members into either form) and ``engine.bundle.save`` (atomic
saves, the save-target check, abandoned temporaries). Nothing in this repository imports this
module, and new code should import from the owners. It stays because code outside the repository
may import from here: an engine-onnx built before the split imports ``check_save_target`` from it
(and its requirement, ``engine>=0.1,<0.2``, lets it meet this engine), and scripts written against
the former module may import any of the rest.

The constants are the owners' values, bound at import: lowering a limit (as tests do) means setting
it on ``engine.bundle.manifest``, where the reader and the writer look it up when called.
"""

from __future__ import annotations

from engine.bundle.manifest import (FORMAT_NAME, FORMAT_VERSION, MAX_MANIFEST_BYTES, MAX_MEMBERS, Manifest,
                                    ManifestEntry)
from engine.bundle.reader import MAX_METADATA_BYTES, BundleArchive
from engine.bundle.save import check_save_target, write_bundle
from engine.bundle.writer import WEIGHTS_ALIGNMENT, MemberData, bundle_to_bytes, copy_members
from engine.bundle.zipformat import ZIP_MAGIC

__all__ = [
    "ZIP_MAGIC",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MEMBERS",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "WEIGHTS_ALIGNMENT",
    "MemberData",
    "ManifestEntry",
    "Manifest",
    "BundleArchive",
    "write_bundle",
    "check_save_target",
    "bundle_to_bytes",
    "copy_members",
]
