"""``engine verify BUNDLE``: hash every member, weights included, then check the plan.

The archive's own ``verify()`` hashes a member in one call, which gives no progress on a
multi-gigabyte ``weights.bin``. Here each member is hashed in slices of its memory map, so the
progress bar moves by bytes; the expected sizes and digests come from the manifest, exactly as the
archive checks them. Once every hash matches, the bundle is read as the loader reads it (schema and
plan consistency), still without loading any kernel.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from engine.cli.args import CheckFailed
from engine.cli.commands import add_command
from engine.cli.loading import check_bundle_path, read_contents
from engine.cli.progress import Progress
from engine.cli.render import emit_json, format_bytes, one_line, plural

EXAMPLES = """
  engine verify mlp.cgb              exit 0 when every member matches the manifest, else 1
  engine verify mlp.cgb --verbose    list every member with its size and result
  engine verify model/ --json        a directory bundle; the result for scripts
"""

_SLICE = 16 * 1024 * 1024


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "verify", help="check every member's sha256 (weights included) and the plan",
                    description="Check a bundle's integrity: the container and manifest, the sha256 and size of "
                                "every member (weights included), then the metadata and the plan's consistency. "
                                "Exits 1 on any mismatch, naming the member. No kernel is loaded.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("-v", "--verbose", action="store_true", help="list every member and its result")
    p.set_defaults(func=run)


def _hash_member(archive, name: str, bar: Progress) -> str | None:
    """None when the member matches the manifest, else what is wrong."""
    from engine.errors import BundleError

    expected = archive.manifest.files[name]
    try:
        view = archive.map(name)
    except (BundleError, OSError, ValueError) as exc:
        return one_line(exc)
    if len(view) != expected.size:
        return f"size {len(view)} bytes, the manifest says {expected.size}"
    digest = hashlib.sha256()
    try:
        for start in range(0, len(view), _SLICE):
            digest.update(view[start:start + _SLICE])
            bar.advance(min(_SLICE, len(view) - start))
    finally:
        view.release()
    if digest.hexdigest() != expected.sha256:
        return "sha256 mismatch: the member is corrupted or was modified"
    return None


def collect(path: Path) -> dict:
    from engine.bundle.reader import BundleArchive
    from engine.errors import BundleError

    doc: dict = {"path": str(path), "ok": False, "members": [], "bad": [], "problems": []}
    try:
        archive = BundleArchive.open(path)
    except BundleError as exc:
        doc["problems"].append(one_line(exc))
        doc["structure"] = "refused"
        return doc
    try:
        files = archive.manifest.files
        doc["form"] = archive.form
        doc["identity"] = archive.identity
        doc["size_bytes"] = sum(e.size for e in files.values())
        with Progress(doc["size_bytes"], "verifying", unit="B") as bar:
            for name in archive.names():
                problem = _hash_member(archive, name, bar)
                doc["members"].append({"name": name, "size": files[name].size, "sha256": files[name].sha256,
                                       "ok": problem is None, "problem": problem})
                if problem is not None:
                    doc["bad"].append(name)
                    doc["problems"].append(f"{name}: {problem}")
    finally:
        archive.close()
    if doc["bad"]:
        doc["structure"] = "not checked (hash mismatch)"
        return doc
    try:
        contents = read_contents(path)
    except BundleError as exc:
        doc["structure"] = "invalid"
        doc["problems"].append(one_line(exc))
        if exc.member:
            doc["bad"].append(exc.member)
        return doc
    contents.archive.close()
    doc["structure"] = "ok"
    doc["ok"] = True
    return doc


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    doc = collect(path)
    if args.json:
        emit_json(doc)
    else:
        if args.verbose:
            for m in doc["members"]:
                print(f"{'ok' if m['ok'] else 'FAILED':<7} {m['size']:>12,}  {m['name']}"
                      + ("" if m["ok"] else f"  ({m['problem']})"))
        elif doc["members"]:
            for m in doc["members"]:
                if not m["ok"]:
                    print(f"FAILED  {m['name']}: {m['problem']}")
        if doc["ok"]:
            print(f"ok: {plural(len(doc['members']), 'member')} ({format_bytes(doc['size_bytes'])}) match their "
                  f"sha256, weights included; plan consistent; identity {doc['identity']}")
    if doc["ok"]:
        return 0
    if doc["bad"]:
        raise CheckFailed(f"{path}: {plural(len(doc['bad']), 'member')} failed: {'; '.join(doc['problems'])}")
    raise CheckFailed(f"{path}: {'; '.join(doc['problems'])}")
