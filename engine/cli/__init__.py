"""The ``engine`` command line: a click group whose subcommands load on demand.

Each subcommand lives in its own module and is imported only when it runs (or when
``--help`` lists it), so ``engine plugins`` never pays for the server's imports.
Adding a command is one line in ``_COMMANDS``: ``"name": "module:click_command"``.
"""

from __future__ import annotations

import importlib

import click

_COMMANDS: dict[str, str] = {
    "plugins": "engine.cli.plugins_cmd:plugins",
    "bench": "engine.cli.bench:bench_cmd",
    "generate": "engine.cli.generate:generate_cmd",
    "chat": "engine.cli.chat:chat_cmd",
    "serve": "engine.cli.serve:serve_cmd",
    "proxy": "engine.cli.proxy_cmd:proxy_cmd",
}


class _LazyGroup(click.Group):
    """A click group that imports a subcommand's module the first time it is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in _COMMANDS:
            module_name, _, attr = _COMMANDS[cmd_name].partition(":")
            command = getattr(importlib.import_module(module_name), attr)
            self.add_command(command, cmd_name)
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="engine", prog_name="engine")
def main() -> None:
    """engine: a hardware-agnostic LLM inference and serving engine."""


__all__ = ["main"]
