"""``engine devices``: device kinds, their plugins, and why a plugin did not load."""

from __future__ import annotations

import argparse

from engine.cli.commands import add_command
from engine.cli.loading import registry_of
from engine.cli.render import emit_json, table, terminal_width, wrap

EXAMPLES = """
  engine devices                    the table of device kinds
  engine devices --verbose          also the traceback of each plugin that failed to load
  engine devices --json             the same, for scripts
  ENGINE_DEVICES=cuda engine devices   what a process limited to CUDA sees
"""


def register(sub, common: dict[str, argparse.ArgumentParser]) -> None:
    p = add_command(sub, "devices", help="list device kinds, their plugins and availability",
                    description="List every device kind known to this process: the plugin distribution and "
                                "version that provides it, its plugin API version, its workspace slot, how many "
                                "devices it has and their names; or, for a plugin that could not be used, the "
                                "failure and its cause.",
                    examples=EXAMPLES, parents=[common["debug"], common["json"]])
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of each failed plugin")
    p.set_defaults(func=run)


def collect(registry) -> dict:
    rows = []
    for r in registry.devices():
        rows.append({
            "kind": r.kind,
            "available": r.available,
            "device_count": r.device_count,
            "device_names": list(r.device_names),
            "distribution": r.distribution,
            "version": r.version,
            "api_version": None if r.api_version is None else f"{r.api_version[0]}.{r.api_version[1]}",
            "workspace_slot": r.workspace_slot,
            "reason": r.reason,
            "driver": r.driver,
        })
    failures = [{"plugin": f.plugin, "distribution": f.distribution, "version": f.version, "cause": f.cause,
                 "kinds": list(f.kinds), "details": f.details} for f in registry.failures()]
    return {"devices": rows, "failures": failures}


def run(args: argparse.Namespace) -> int:
    doc = collect(registry_of(args))
    if args.json:
        if not args.verbose:
            for f in doc["failures"]:
                f.pop("details", None)
        emit_json(doc)
        return 0 if doc["devices"] else 1
    if not doc["devices"]:
        from engine.cli.version import no_plugins_reason

        print("\n".join(wrap(f"no device plugins: {no_plugins_reason(registry_of(args))}", terminal_width(),
                              indent="  ")))
        return 1
    rows = []
    for r in doc["devices"]:
        plugin = f"{r['distribution'] or '?'} {r['version'] or ''}".strip()
        detail = ", ".join(r["device_names"]) if r["available"] else (r["reason"] or "unavailable")
        if r["available"] and r["reason"]:
            detail += f" ({r['reason']})"
        if r["driver"]:
            detail += f"; {r['driver']}"
        rows.append([r["kind"], "yes" if r["available"] else "no", r["device_count"],
                     "-" if r["workspace_slot"] is None else r["workspace_slot"], r["api_version"] or "-", plugin,
                     detail])
    # Causes can be long (the HIP plugin's names several libraries): the last column wraps so that
    # no line is wider than the terminal (80 columns off a terminal; issue 24).
    width = terminal_width()
    print(table(["kind", "available", "count", "slot", "api", "plugin", "devices / cause"], rows, right=(2, 3),
                width=width))
    if args.verbose:
        for f in doc["failures"]:
            head = f"plugin {f['plugin']!r} ({f['distribution'] or 'unknown distribution'}): {f['cause']}"
            print("\n" + "\n".join(wrap(head, width, indent="  ")))
            if f["details"]:
                print(f["details"].rstrip())  # a traceback, kept as Python printed it
    elif doc["failures"]:
        print("\n" + "\n".join(wrap(f"{len(doc['failures'])} plugin(s) could not be used; 'engine devices --verbose' "
                                     f"shows why in full", width)))
    return 0
