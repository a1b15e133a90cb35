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
                "kernels": _kernel_info(registry, p),
            }
        )
    auto = registry.auto_platform()
    formats = [{"name": cls.name, "plugin": plugin} for plugin, cls in registry.quant_methods()]
    return {
        "quantization_formats": formats,
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


def _kernel_info(registry: PluginRegistry, info) -> dict[str, Any]:
    """An available platform's kernel_info() (a failing one is reported, not raised)."""
    if not info.available:
        return {}
    try:
        return dict(registry.instance(info).kernel_info())
    except Exception as exc:  # noqa: BLE001 - a plugin's report never breaks the listing
        return {"error": f"kernel_info() raised {type(exc).__name__}: {exc}"}


def _kernel_lines(report: dict[str, Any]) -> list[str]:
    """One line per platform that reports its kernels: ``key: value`` pairs."""
    lines = []
    for plugin in report["plugins"]:
        for p in plugin["platforms"]:
            if p.get("kernels"):
                parts = [f"{key}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                         for key, v in p["kernels"].items()]
                lines.append(f"{p['name']} kernels: " + "; ".join(parts))
    return lines


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
    lines.extend(_kernel_lines(report))
    if report["quantization_formats"]:
        lines.append("quantization formats: " + ", ".join(
            f"{f['name']} ({f['plugin']})" for f in report["quantization_formats"]))
    lines.append(f"--device auto -> {report['auto'] or '(no platform available)'}")
    if report["allowlist"] is not None:
        lines.append(f"ENGINE_PLUGINS limits loading to: {', '.join(report['allowlist'])}")
    lines.extend(f"warning: {w}" for w in report["warnings"])
    return "\n".join(lines)


def model_kernels_report(model: str, device: str, quantization: str | None,
                         dtype: str) -> dict[str, Any]:
    """Load ``model`` on the platform of ``device`` as the engine would and report which
    GEMM kernel each layer type got (and the quantization scheme and weight bytes)."""
    from engine.core.engine_args import EngineArgs
    from engine.core.plugins import resolve_platform
    from engine.model_executor import kernel_report
    from engine.model_executor.worker import load_platform_model

    config = EngineArgs(model=model, device=device, quantization=quantization,
                        dtype=dtype).create_engine_config()
    platform = resolve_platform(config.device.device)
    platform.check_and_update_config(config)
    net, backend = load_platform_model(config, platform)
    return {"model": model, "platform": platform.name, "attention_backend": backend.name,
            "weight_dtype": config.model.dtype,
            "activation_dtype": config.model.activation_dtype or config.model.dtype,
            **kernel_report.report(net)}


def render_model_kernels(report: dict[str, Any]) -> str:
    weights = (f"{report['quantization']} quantized" if report["quantization"]
               else report["weight_dtype"])
    lines = [f"{report['model']} on {report['platform']}: {weights} weights "
             f"({report['weights_mib']} MiB), {report['activation_dtype']} activations, "
             f"attention {report['attention_backend']}"]
    width = max((len(kind) for kind in report["layer_kernels"]), default=0)
    lines += [f"  {kind.ljust(width)}  {kernel}" for kind, kernel in report["layer_kernels"].items()]
    return "\n".join(lines)


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--model", default=None, metavar="PATH",
              help="Also load this model and show the GEMM kernel each layer type gets.")
@click.option("--device", default="auto", show_default=True, help="Platform for --model.")
@click.option("--quantization", "-q", default=None, help="As engine serve, for --model.")
@click.option("--dtype", default="auto", show_default=True, help="As engine serve, for --model.")
def plugins(as_json: bool, model: str | None, device: str, quantization: str | None,
            dtype: str) -> None:
    """List installed plugins and platforms, and what --device auto would pick."""
    report = plugins_report(get_plugin_registry())
    if model is not None:
        try:
            report["model"] = model_kernels_report(model, device, quantization, dtype)
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_table(report))
        if model is not None:
            click.echo(render_model_kernels(report["model"]))
