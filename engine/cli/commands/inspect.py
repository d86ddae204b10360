"""``engine inspect BUNDLE``: what a bundle holds and whether this machine can run it.

Reads the bundle without loading any kernel (no native code runs): the manifest, the metadata and
the kernel binaries are hash-checked on the way, the weights are not (``engine verify`` does). For
every kernel candidate it asks the local plugin of the kernel's kind whether one of the
candidate's binaries can be loaded here (``Backend.loadable``), which answers "can my machine run
this bundle?" before anything is executed.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from engine.cli.args import CheckFailed
from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.loading import bundle_size, check_bundle_path, input_names, output_names, read_contents
from engine.cli.render import compress_values, emit_json, format_bytes, key_text, plural, table

EXAMPLES = """
  engine inspect mlp.cgb                  inputs, outputs, weights, kernels, dispatch keys, manifest
  engine inspect mlp.cgb --weights        list every weight too
  engine inspect mlp.cgb --graph          print the graph listing stored in the bundle
  engine inspect model.cgb --check        exit 1 if this machine cannot run every kernel
  engine inspect mlp.cgb --json | jq '.kernels[].candidates[].runs_on'
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "inspect", help="show what a bundle holds and which local devices can run it",
                    description="Show a bundle's inputs and outputs (with symbolic shapes), weights (count, bytes, "
                                "dtypes), kernels with their candidates, binary formats and targets and which local "
                                "device can run each, the dispatch table's keys, and the manifest check. No kernel "
                                "is loaded.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("bundle", metavar="BUNDLE", help="a .cgb file or a bundle directory")
    p.add_argument("--weights", action="store_true", help="list every weight (name, dtype, shape, bytes)")
    p.add_argument("--graph", action="store_true", help="print the graph listing (graph_string.txt)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when some kernel cannot run on this machine (for scripts and CI)")
    p.set_defaults(func=run)


def _local_devices(registry) -> dict[str, dict]:
    """kind -> {"device": "cpu:0" | None, "reason": str | None} for every kind this machine knows."""
    out: dict[str, dict] = {}
    for row in registry.devices():
        if row.kind in out and out[row.kind]["device"] is not None:
            continue
        if row.available and row.device_count > 0:
            out[row.kind] = {"device": f"{row.kind}:0", "reason": None}
        else:
            out[row.kind] = {"device": None, "reason": row.reason or "no device"}
    return out


def _missing_kind(kind: str) -> str:
    from engine.plugins import KNOWN_DISTRIBUTIONS

    hint = KNOWN_DISTRIBUTIONS.get(kind)
    return f"no plugin for {kind!r} here" + (f" (install '{hint}')" if hint else "")


def _candidate_here(kind: str, binaries: list[dict], local: dict[str, dict], registry) -> tuple[str | None, str | None,
                                                                                                 str | None]:
    """(device, binary "format/target", reason): the first binary of the candidate loadable here."""
    where = local.get(kind)
    if where is None:
        return None, None, _missing_kind(kind)
    if where["device"] is None:
        return None, None, f"{kind} unavailable: {where['reason']}"
    backend = registry.backend(kind)
    reasons = []
    for b in binaries:
        reason = backend.loadable(b["format"], b["target"])
        if reason is None:
            return where["device"], f"{b['format']}/{b['target']}", None
        reasons.append(f"{b['format']}/{b['target']}: {reason}")
    return None, None, "; ".join(reasons) or "no binaries"


def collect(path: Path, registry) -> dict:
    contents = read_contents(path)
    try:
        archive = contents.archive
        meta, ex = contents.meta, contents.execution
        files = archive.manifest.files
        total = sum(e.size for e in files.values())
        local = _local_devices(registry)

        def sig_doc(name: str, sig) -> dict:
            return {"name": name, "dtype": sig.dtype.name, "shape": [e.source for e in sig.shape],
                    "device": sig.device}

        entries = contents.weight_entries or ()
        dtypes = Counter(e.dtype.name for e in entries)
        params = 0
        for e in entries:
            n = 1
            for d in e.shape:
                n *= d
            params += n
        stored = ("weights.bin" if contents.weight_blob is not None else
                  "weights.npz" if contents.npz_weights is not None else None)

        kernels: list[dict[str, Any]] = []
        for k, km in enumerate(contents.kernels):
            cands = []
            for c, cand in enumerate(km.candidates):
                binaries = [{"format": b.format, "target": b.target, "path": b.path,
                             "size": files[f"kernels/{k}/{b.path}"].size} for b in cand.binaries]
                device, used, reason = _candidate_here(km.device, binaries, local, registry)
                cands.append({"index": c, "entry": cand.entry, "binaries": binaries, "runs_on": device,
                              "binary": used, "reason": reason})
            doc = {"index": k, "name": km.name, "device": km.device, "symbols": list(km.symbols),
                   "workspace": km.workspace.source, "builtin": km.builtin, "candidates": cands}
            if km.builtin == "copy":
                srcs = {s.device for s in km.inputs} | {km.device}
                missing = [kind for kind in sorted(srcs) if (local.get(kind) or {}).get("device") is None]
                doc["runs_on"] = None if missing else (local[km.device]["device"])
                doc["reason"] = None if not missing else "; ".join(_missing_kind(m) if m not in local else
                                                                     f"{m} unavailable" for m in missing)
            kernels.append(doc)

        problems = []
        for kd in kernels:
            if kd["builtin"] == "copy":
                if kd["runs_on"] is None:
                    problems.append(f"kernel {kd['index']} ({kd['name']}): {kd['reason']}")
                continue
            bad = [c for c in kd["candidates"] if c["runs_on"] is None]
            if bad:
                problems.append(f"kernel {kd['index']} ({kd['name']}) candidate "
                                f"{', '.join(str(c['index']) for c in bad)}: {bad[0]['reason']}")
        kinds = list(contents.analysis.kinds)
        rows = sorted(contents.dispatch_rows.items())
        binaries_checked = sum(1 for n in files if n.startswith("kernels/") and not n.endswith("/meta.json"))
        return {
            "path": str(path),
            "form": archive.form,
            "size_bytes": bundle_size(path),
            "members_bytes": total,
            "members": len(files),
            "format_version": "{}.{}".format(*archive.manifest.format_version),
            "engine_version": archive.manifest.engine_version,
            "identity": archive.identity,
            "graph_hash": meta.graph_hash,
            "inputs": [sig_doc(n, s) for n, s in zip(input_names(meta), meta.inputs)],
            "outputs": [sig_doc(n, s) for n, s in zip(output_names(meta), meta.outputs)],
            "symbols": list(meta.symbols),
            "device_kinds": kinds,
            "weights": {
                "count": len(ex.weights_index),
                "bytes": sum(e.nbytes for e in entries),
                "parameters": params,
                "dtypes": dict(sorted(dtypes.items())),
                "stored": stored,
                "entries": [{"name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "nbytes": e.nbytes}
                            for e in entries],
            },
            "instructions": len(ex.instructions),
            "kernels": kernels,
            "dispatch_table": {
                "symbols": list(meta.symbols),
                "keys": [list(key) for key, _ in rows],
                "rows": [{"key": list(key), "choice": list(choice)} for key, choice in rows],
            },
            "manifest": {
                "ok": True,
                "members": len(files),
                "hash_checked": ["manifest.json structure", "metadata", f"{binaries_checked} kernel binaries"],
                "weights_hashed": False,
            },
            "runnable": {"ok": not problems, "devices": {k: (local.get(k) or {}).get("device") for k in kinds},
                         "problems": problems},
            "graph_string": contents.graph_string,
        }
    finally:
        contents.archive.close()


def _dispatch_summary(doc: dict) -> str:
    keys = doc["dispatch_table"]["keys"]
    symbols = doc["dispatch_table"]["symbols"]
    if not keys:
        return "dispatch table: no rows (each new key is tuned at its first run, or per the dispatch policy)"
    if len(symbols) == 1:
        return (f"dispatch table: {plural(len(keys), 'key')}: {symbols[0]} = "
                f"{compress_values([k[0] for k in keys])}")
    shown = [key_text(dict(zip(symbols, k))) for k in keys[:12]]
    more = f"; ... ({len(keys) - 12} more)" if len(keys) > 12 else ""
    return f"dispatch table: {plural(len(keys), 'key')}: " + "; ".join(f"({s})" for s in shown) + more


def render(doc: dict, *, weights: bool, graph: bool) -> str:
    w = doc["weights"]
    lines = [
        f"bundle    {doc['path']} ({doc['form']}, {format_bytes(doc['size_bytes'])} on disk, "
        f"{plural(doc['members'], 'member')} of {format_bytes(doc['members_bytes'])})",
        f"format    engine.bundle {doc['format_version']}, written by engine {doc['engine_version']}",
        f"identity  {doc['identity']}",
        "manifest  ok: every member listed; metadata and kernel binaries match their sha256 "
        "(weights are not hashed here: 'engine verify' does)",
        "",
        table(["kind", "name", "dtype", "shape", "device"],
              [["input", s["name"], s["dtype"], "[" + ", ".join(s["shape"]) + "]", s["device"]] for s in doc["inputs"]]
              + [["output", s["name"], s["dtype"], "[" + ", ".join(s["shape"]) + "]", s["device"]]
                 for s in doc["outputs"]]),
        f"symbols: {', '.join(doc['symbols']) or '(static graph)'}",
        "",
    ]
    dtypes = ", ".join(f"{k} x{v}" for k, v in w["dtypes"].items()) or "-"
    where = {"weights.bin": "stored in weights.bin", "weights.npz": "stored in weights.npz (reference format)",
             None: "not stored (saved without weights: set_weights is needed)"}[w["stored"]]
    if w["count"] == 0:
        lines.append("weights: none")
    else:
        lines.append(f"weights: {plural(w['count'], 'tensor')}, {format_bytes(w['bytes'])} ({w['bytes']:,} bytes), "
                     f"{w['parameters']:,} parameters; dtypes: {dtypes}; {where}")
    if weights and w["entries"]:
        lines.append(table(["name", "dtype", "shape", "bytes"],
                           [[e["name"], e["dtype"], str(e["shape"]), f"{e['nbytes']:,}"] for e in w["entries"]],
                           right=(3,), indent="  "))
    lines.append("")
    n_cands = sum(len(k["candidates"]) for k in doc["kernels"])
    lines.append(f"kernels: {plural(len(doc['kernels']), 'task')}, {plural(n_cands, 'candidate')}, "
                 f"{plural(doc['instructions'], 'instruction')}")
    rows = []
    for k in doc["kernels"]:
        if k["builtin"] == "copy":
            rows.append([k["index"], k["name"], k["device"], "-", "(builtin copy)", "-",
                         k["runs_on"] or f"no: {k['reason']}"])
            continue
        for c in k["candidates"]:
            first = c["index"] == 0
            formats = ", ".join(f"{b['format']}/{b['target']}" for b in c["binaries"])
            here = f"{c['runs_on']} ({c['binary']})" if c["runs_on"] else f"no: {c['reason']}"
            rows.append([k["index"] if first else "", k["name"] if first else "", k["device"] if first else "",
                         c["index"], c["entry"], formats, here])
    lines.append(table(["#", "kernel", "kind", "cand", "entry", "binaries (format/target)", "runs here"], rows))
    lines.append("")
    lines.append(_dispatch_summary(doc))
    run = doc["runnable"]
    if run["ok"]:
        lines.append("runs here: yes, on " + ", ".join(v for v in run["devices"].values() if v))
    else:
        lines.append(f"runs here: NO ({plural(len(run['problems']), 'problem')})")
        lines.extend(f"  {p}" for p in run["problems"])
    if graph:
        lines.append("")
        lines.append(doc["graph_string"].rstrip() or "(the bundle has no graph listing)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = check_bundle_path(args.bundle)
    doc = collect(path, registry_of(args))
    if args.json:
        if not args.graph:
            doc.pop("graph_string")
        emit_json(doc)
    else:
        print(render(doc, weights=args.weights, graph=args.graph))
    if args.check and not doc["runnable"]["ok"]:
        raise CheckFailed(f"{path} cannot run on this machine: {doc['runnable']['problems'][0]}"
                          + (f" (and {len(doc['runnable']['problems']) - 1} more)"
                             if len(doc["runnable"]["problems"]) > 1 else ""))
    return 0
