"""``engine plugins``: the table, --json, and a third-party plugin installed by pip.

The third-party packages are real setuptools projects (pyproject.toml with an
``engine.plugins`` entry point) installed with ``pip install --target`` into a temp
directory, which the CLI subprocess sees through PYTHONPATH.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine.cli import main
from engine.core.interfaces import PLUGIN_API_VERSION
from engine.core.plugins import ALLOWLIST_ENV, reset_plugin_registry, resolve_platform

ACCELERATOR_PRESENT = torch.cuda.is_available() or (
    hasattr(torch, "xpu") and torch.xpu.is_available()
)
no_accelerator = pytest.mark.skipif(ACCELERATOR_PRESENT, reason="an accelerator is present")

PLUGIN_MODULE = """
from engine.core.interfaces import Platform, ProbeResult
from engine.core.plugins import hookimpl


class {cls}(Platform):
    name = "{platform}"
    device_type = "cpu"
    priority = {priority}
    description = "a third-party test platform"

    @classmethod
    def probe(cls):
        return ProbeResult.ok("{platform} test device")

    def supported_dtypes(self):
        import torch
        return [torch.float32]

    def total_memory_bytes(self):
        return 1 << 30

    def available_memory_bytes(self):
        return 1 << 30

    def kv_cache_bytes(self, cache_config, weights_bytes):
        return 1 << 20

    def attention_backends(self):
        return []

    def communicator_cls(self):
        from engine.distributed import GlooCommunicator
        return GlooCommunicator


@hookimpl
def engine_plugin_api_version():
    return {api_version}


@hookimpl
def engine_register_platforms():
    return [{cls}]
"""

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"

[project.entry-points."engine.plugins"]
{ep} = "{module}"

[tool.setuptools]
py-modules = ["{module}"]
"""


def _write_project(root: Path, dist: str, version: str, ep: str, platform: str, **kw) -> Path:
    module = dist.replace("-", "_")
    project = root / dist
    project.mkdir()
    (project / "pyproject.toml").write_text(
        textwrap.dedent(PYPROJECT.format(dist=dist, version=version, ep=ep, module=module))
    )
    source = PLUGIN_MODULE.format(cls=f"{platform.capitalize()}Platform", platform=platform, **kw)
    (project / f"{module}.py").write_text(source)
    return project


@pytest.fixture(scope="module")
def pip_target(tmp_path_factory: pytest.TempPathFactory):
    """Two plugin packages pip-installed into one --target directory (removed after)."""
    root = tmp_path_factory.mktemp("plugin_projects")
    projects = [
        _write_project(
            root,
            "acme-accel",
            "0.3.0",
            "acme",
            "acme",
            priority=500,
            api_version=PLUGIN_API_VERSION,
        ),
        _write_project(
            root,
            "stale-accel",
            "0.1.0",
            "stale",
            "stale",
            priority=600,
            api_version=PLUGIN_API_VERSION + 41,
        ),
    ]
    target = root / "target"
    env = {**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(target),
            *map(str, projects),
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    yield target
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    yield
    reset_plugin_registry()


def _invoke(*args: str, env: dict[str, str] | None = None) -> str:
    result = CliRunner().invoke(main, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


def _row(output: str, plugin: str) -> list[str]:
    """The table row of ``plugin``, split into its five columns."""
    for line in output.splitlines():
        cells = line.split(None, 4)
        if cells and cells[0] == plugin:
            return cells
    raise AssertionError(f"no row for {plugin!r} in:\n{output}")


def test_version() -> None:
    assert _invoke("--version").strip() == f"engine, version {importlib.metadata.version('engine')}"


@no_accelerator
def test_table_lists_in_tree_plugins_and_auto_choice() -> None:
    out = _invoke("plugins")
    assert out.splitlines()[0].split() == [
        "PLUGIN",
        "DISTRIBUTION",
        "PLATFORM",
        "PRIORITY",
        "STATUS",
    ]
    dist = f"engine=={importlib.metadata.version('engine')}"
    cpu = _row(out, "cpu")
    assert cpu[:4] == ["cpu", dist, "cpu", "0"] and cpu[4].startswith("available: ")
    for name in ("cuda", "rocm", "xpu"):
        row = _row(out, name)
        assert row[:3] == [name, dist, name] and row[4].startswith("unavailable: ")
    if torch.version.cuda is None:
        assert (
            _row(out, "cuda")[4] == f"unavailable: torch {torch.__version__} was built without CUDA"
        )
    assert out.rstrip().endswith("--device auto -> cpu")
    assert any(line.startswith("cpu kernels: isa_level: ") for line in out.splitlines())


@no_accelerator
def test_json_report() -> None:
    report = json.loads(_invoke("plugins", "--json"))
    plugins = {p["name"]: p for p in report["plugins"]}
    assert set(plugins) >= {"cpu", "cuda", "rocm", "xpu"}
    assert report["auto"] == "cpu" and report["allowlist"] is None
    cpu = plugins["cpu"]
    assert (cpu["status"], cpu["distribution"], cpu["api_version"]) == ("ok", "engine", 1)
    (platform,) = cpu["platforms"]
    assert platform["name"] == "cpu" and platform["available"] is True
    from engine.plugins.cpu import kernel_build

    kernels = platform["kernels"]  # the CPU's ISA level, every level it runs, the GEMM order
    assert kernels["isa_level"] == kernel_build.select_level().name
    assert kernels["isa_levels_runnable"] == [lv.name for lv in kernel_build.runnable_levels()]
    assert kernels["gemm_order"][0] in ("cpu_packed", "onednn_packed")
    rocm = plugins["rocm"]["platforms"][0]
    assert rocm["kernels"] == {}  # unavailable platforms are not asked
    assert rocm["device_type"] == "cuda" and rocm["available"] is False and rocm["reason"]


def test_allowlist_is_reported() -> None:
    out = _invoke("plugins", env={ALLOWLIST_ENV: "cpu,cdua"})
    assert [line.split()[0] for line in out.splitlines()[1:] if line.strip()][:1] == ["cpu"]
    assert "ENGINE_PLUGINS limits loading to: cpu, cdua" in out
    assert "warning: ENGINE_PLUGINS names 'cdua', which is not installed" in out
    with pytest.raises(AssertionError):
        _row(out, "cuda")


def test_pip_installed_plugin_listed_by_cli_subprocess(pip_target: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(pip_target), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    env.pop(ALLOWLIST_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "plugins", "--json"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in report["plugins"]}
    acme = plugins["acme"]
    assert (acme["distribution"], acme["version"], acme["status"]) == ("acme-accel", "0.3.0", "ok")
    assert [(p["name"], p["priority"], p["available"]) for p in acme["platforms"]] == [
        ("acme", 500, True)
    ]
    assert report["auto"] == "acme"
    stale = plugins["stale"]
    assert stale["status"] == "refused" and stale["platforms"] == []
    assert stale["reason"].startswith(
        f"plugin 'stale' (distribution stale-accel==0.1.0) declares plugin API version "
        f"{PLUGIN_API_VERSION + 41}, but this engine supports plugin API version "
        f"{PLUGIN_API_VERSION}"
    )
    assert "is refused" in proc.stderr  # the refusal is also logged


def test_pip_installed_plugin_selectable(pip_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(pip_target))
    reset_plugin_registry()
    try:
        auto = resolve_platform("auto")
        assert type(auto).__name__ == "AcmePlatform"
        assert resolve_platform("acme") is auto
        out = _invoke("plugins")
        assert _row(out, "acme") == [
            "acme",
            "acme-accel==0.3.0",
            "acme",
            "500",
            "available: acme test device",
        ]
        assert _row(out, "stale")[:4] == ["stale", "stale-accel==0.1.0", "-", "-"]
        assert _row(out, "stale")[4].startswith("refused: plugin 'stale'")
        assert out.rstrip().endswith("--device auto -> acme")
        with pytest.raises(ValueError, match=r"(?s)unknown device 'stale'.*stale \(stale-accel"):
            resolve_platform("stale")
    finally:
        for module in ("acme_accel", "stale_accel"):
            sys.modules.pop(module, None)


def test_plugins_lists_the_quantization_formats_and_a_models_layer_kernels(monkeypatch) -> None:
    """The built-in formats arrive through the plugin hook like a third party's; with
    --model, the kernel every layer type of that checkpoint gets on the chosen platform."""
    from tests.quantization.refs import FIXTURES

    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    reset_plugin_registry()
    report = json.loads(_invoke("plugins", "--json", "--model",
                                str(FIXTURES / "gptq-desc-act-g64"), "--device", "cpu"))
    assert {"name": "gptq", "plugin": "quantization"} in report["quantization_formats"]
    model = report["model"]
    assert model["platform"] == "cpu" and model["quantization"] == "gptq"
    assert model["layer_kernels"]["qkv_proj"].startswith("cpu_qgemm (") and (
        model["layer_kernels"]["qkv_proj"].endswith("[gptq]"))
    assert model["layer_kernels"]["lm_head"].startswith("cpu_packed")
    text = _invoke("plugins", "--model", str(FIXTURES / "gptq-desc-act-g64"), "--device", "cpu")
    formats = re.search(r"^quantization formats: (.*)$", text, re.M)
    assert formats, text
    listed = formats.group(1).split(", ")
    assert {"compressed-tensors (quantization)", "gptq (quantization)"} <= set(listed)
    assert re.search(r"^  down_proj +cpu_qgemm \(\w+(, [\w ]+)?\) \[gptq\]$", text, re.M)


def test_plugins_model_errors_are_clean() -> None:
    result = CliRunner().invoke(main, ["plugins", "--model", "/nonexistent/model"])
    assert result.exit_code == 1 and "Error:" in result.output and "Traceback" not in result.output
