"""``engine plugins``: what is installed, what runs here, and what ``--device auto`` picks."""

from __future__ import annotations

import json
from typing import Any

import click

from engine.core.plugins import PluginRegistry, PluginStatus, get_plugin_registry
from engine.core.plugins.registry import contributions_by_name


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
                "components": _components(registry, p),
            }
        )
    auto = registry.auto_platform()
    errors: list[str] = []
    contributions = _contributions(registry, errors)
    return {
        "quantization_formats": contributions["quant_methods"],
        "contributions": contributions,
        "contribution_errors": errors,
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
        "transformers_backend": _transformers_backend(),
        "allowlist": registry.allowlist,
        "warnings": list(registry.warnings),
    }


def _transformers_backend() -> dict[str, Any]:
    """The Transformers modeling backend (``--model-impl``): what runs an architecture
    without a registered class."""
    try:
        from importlib.metadata import version

        found = version("transformers")
    except Exception:  # noqa: BLE001 - not installed: the backend is unavailable
        found = None
    return {"available": found is not None, "transformers": found,
            "model_impls": ["auto", "engine", "transformers"]}


def _name(item: Any) -> str:
    """A contribution's name: its ``name`` attribute, else its class name."""
    name = getattr(item, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = item if isinstance(item, type) else type(item)
    return cls.__qualname__


def _safe(errors: list[str], what: str, make: Any) -> list[dict[str, Any]]:
    """``make()`` (a list of entries), or [] with the error recorded: never raises."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - a plugin's bug never breaks the listing
        errors.append(f"{what}: {type(exc).__name__}: {exc}")
        return []


def _contributions(registry: PluginRegistry, errors: list[str]) -> dict[str, Any]:
    """Every contribution of every loaded plugin, each with the plugin it came from."""
    from engine.model_executor.models.registry import ModelRegistry

    def entries(kind, pairs):
        try:  # a name two plugins claim is reported (the engine refuses to use it)
            contributions_by_name(kind, pairs)
        except ValueError as exc:
            errors.append(str(exc))
        return [{"name": _name(item), "plugin": plugin} for plugin, item in pairs]

    def models():
        return [{"name": arch, "plugin": plugin}
                for arch, plugin in ModelRegistry(plugins=registry).contributions()]

    def tool_parsers():
        from engine.structured_output.tool_calls import ToolParserRegistry

        return [{"name": name, "plugin": plugin}
                for name, plugin in ToolParserRegistry(plugins=registry).contributions()]

    return {
        "platforms": [{"name": p.name, "plugin": p.plugin, "available": p.available}
                      for p in registry.platforms()],
        "model_architectures": _safe(errors, "model architectures", models),
        "tool_parsers": _safe(errors, "tool-call parsers", tool_parsers),
        "attention_backends": _safe(errors, "attention backends",
                                    lambda: entries("attention backend",
                                                    registry.attention_backends())),
        "quant_methods": _safe(errors, "quantization methods",
                               lambda: entries("quantization method",
                                                       registry.quant_methods())),
        "kv_connectors": _safe(errors, "KV connectors",
                               lambda: entries("KV connector",
                                                       registry.kv_connectors())),
    }


_COMPONENTS = {  # report key -> Platform method (lists of classes, or one object / None)
    "attention_backends": "attention_backends",
    "dense_gemm_kernels": "dense_gemm_kernels",
    "quantized_gemm_kernels": "quantized_gemm_kernels",
    "fused_moe_kernels": "fused_moe_kernels",
    "fused_ops": "fused_ops",
    "forward_graph_capturer": "forward_graph_capturer",
}


def _components(registry: PluginRegistry, info) -> dict[str, Any]:
    """An available platform's own components, by name (an error is reported per item)."""
    if not info.available:
        return {}
    try:
        platform = registry.instance(info)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"platform construction raised {type(exc).__name__}: {exc}"}
    result: dict[str, Any] = {}
    for key, method in _COMPONENTS.items():
        try:
            value = getattr(platform, method)()
            if isinstance(value, (list, tuple)):
                result[key] = [_name(item) for item in value]
            else:
                result[key] = None if value is None else _name(value)
        except Exception as exc:  # noqa: BLE001
            result[key] = {"error": f"{method}() raised {type(exc).__name__}: {exc}"}
    return result


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


def _component_lines(report: dict[str, Any]) -> list[str]:
    """One line per available platform: its own attention backends, kernels and ops."""
    lines = []
    for plugin in report["plugins"]:
        for p in plugin["platforms"]:
            if p.get("components"):
                parts = []
                for key, v in p["components"].items():
                    if isinstance(v, list):
                        v = ", ".join(v) or "-"
                    parts.append(f"{key}: {'-' if v is None else v}")
                lines.append(f"{p['name']} components: " + "; ".join(parts))
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
    lines.extend(_component_lines(report))
    if report["quantization_formats"]:
        lines.append("quantization formats: " + ", ".join(
            f"{f['name']} ({f['plugin']})" for f in report["quantization_formats"]))
    contributions = report.get("contributions", {})
    for key, label in (("model_architectures", "model architectures"),
                       ("tool_parsers", "tool-call parsers"),
                       ("attention_backends", "plugin attention backends"),
                       ("kv_connectors", "KV connectors")):
        if contributions.get(key):
            lines.append(f"{label}: " + ", ".join(
                f"{c['name']} ({c['plugin']})" for c in contributions[key]))
    backend = report.get("transformers_backend") or {}
    if backend.get("available"):
        lines.append(f"transformers backend: transformers {backend['transformers']} runs any "
                     "other decoder (--model-impl auto | transformers)")
    lines.extend(f"error: {e}" for e in report.get("contribution_errors", []))
    lines.append(f"--device auto -> {report['auto'] or '(no platform available)'}")
    if report["allowlist"] is not None:
        lines.append(f"ENGINE_PLUGINS limits loading to: {', '.join(report['allowlist'])}")
    lines.extend(f"warning: {w}" for w in report["warnings"])
    return "\n".join(lines)


def model_kernels_report(model: str, device: str, quantization: str | None,
                         dtype: str, model_impl: str = "auto") -> dict[str, Any]:
    """Load ``model`` on the platform of ``device`` as the engine would and report which
    GEMM kernel each layer type got (and the quantization scheme and weight bytes)."""
    from engine.core.engine_args import EngineArgs
    from engine.core.plugins import resolve_platform
    from engine.model_executor import kernel_report
    from engine.model_executor.models.transformers_backend.support import implementation_of
    from engine.model_executor.worker import load_platform_model

    config = EngineArgs(model=model, device=device, quantization=quantization,
                        dtype=dtype, model_impl=model_impl).create_engine_config()
    platform = resolve_platform(config.device.device)
    platform.check_and_update_config(config)
    net, backend = load_platform_model(config, platform)
    return {"model": model, "platform": platform.name, "model_impl": implementation_of(net),
            "attention_backend": backend.name,
            "weight_dtype": config.model.dtype,
            "activation_dtype": config.model.activation_dtype or config.model.dtype,
            **kernel_report.report(net)}


def render_model_kernels(report: dict[str, Any]) -> str:
    weights = (f"{report['quantization']} quantized" if report["quantization"]
               else report["weight_dtype"])
    lines = [(f"{report['model']} on {report['platform']}: {weights} weights "
              f"({report['weights_mib']} MiB), {report['activation_dtype']} activations, "
              f"attention {report['attention_backend']}, "
              f"model implementation {report.get('model_impl', 'engine')}")]
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
@click.option("--model-impl", "model_impl", type=click.Choice(["auto", "engine", "transformers"]),
              default="auto", show_default=True, help="As engine serve, for --model.")
def plugins(as_json: bool, model: str | None, device: str, quantization: str | None,
            dtype: str, model_impl: str) -> None:
    """List installed plugins and platforms, and what --device auto would pick."""
    report = plugins_report(get_plugin_registry())
    if model is not None:
        try:
            report["model"] = model_kernels_report(model, device, quantization, dtype,
                                                   model_impl)
        except (ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_table(report))
        if model is not None:
            click.echo(render_model_kernels(report["model"]))
