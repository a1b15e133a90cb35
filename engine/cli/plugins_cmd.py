"""``engine plugins``: what is installed, what runs here, and what ``--device auto`` picks."""

from __future__ import annotations

import json
from typing import Any

import click

from engine.core.plugins import PluginRegistry, PluginStatus, get_plugin_registry


def plugins_report(registry: PluginRegistry) -> dict[str, Any]:
    """The machine-readable report (what ``--json`` prints)."""
    platforms_by_plugin: dict[str, list[dict[str, Any]]] = {}
    for p in registry.platforms():
        platforms_by_plugin.setdefault(p.plugin, []).append(
            {
                "name": p.name,
                "device_type": p.device_type,
                "priority": p.priority,
                "available": p.available,
                "reason": p.probe.reason,
            }
        )
    auto = registry.auto_platform()
    return {
        "plugins": [
            {
                "name": info.name,
                "module": info.module,
                "distribution": info.distribution,
                "version": info.version,
                "status": info.status.value,
                "reason": info.reason,
                "api_version": info.api_version,
                "platforms": platforms_by_plugin.get(info.name, []),
            }
            for info in registry.plugins()
        ],
        "auto": auto.name if auto is not None else None,
        "allowlist": registry.allowlist,
        "warnings": list(registry.warnings),
    }


def _table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for plugin in report["plugins"]:
        dist = (
            f"{plugin['distribution']}=={plugin['version']}"
            if plugin["distribution"]
            else "(unknown distribution)"
        )
        if plugin["status"] != PluginStatus.OK.value:
            rows.append((plugin["name"], dist, "-", "-", f"{plugin['status']}: {plugin['reason']}"))
            continue
        if not plugin["platforms"]:
            rows.append((plugin["name"], dist, "-", "-", "ok (no platforms)"))
        for p in plugin["platforms"]:
            state = "available" if p["available"] else "unavailable"
            status = f"{state}: {p['reason']}" if p["reason"] else state
            rows.append((plugin["name"], dist, p["name"], str(p["priority"]), status))
    return rows


def render_table(report: dict[str, Any]) -> str:
    header = ("PLUGIN", "DISTRIBUTION", "PLATFORM", "PRIORITY", "STATUS")
    rows = [header, *_table_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip()
        for row in rows
    ]
    if len(rows) == 1:
        lines.append("(no plugins installed in entry-point group engine.plugins)")
    lines.append("")
    lines.append(f"--device auto -> {report['auto'] or '(no platform available)'}")
    if report["allowlist"] is not None:
        lines.append(f"ENGINE_PLUGINS limits loading to: {', '.join(report['allowlist'])}")
    lines.extend(f"warning: {w}" for w in report["warnings"])
    return "\n".join(lines)


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def plugins(as_json: bool) -> None:
    """List installed plugins and platforms, and what --device auto would pick."""
    report = plugins_report(get_plugin_registry())
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_table(report))
