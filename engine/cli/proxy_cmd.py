"""`engine proxy`: the OpenAI-compatible router for disaggregated prefill/decode.

It loads no model and no torch: it only forwards HTTP, so it starts in well under a second
and can run on any host that reaches the servers.
"""

from __future__ import annotations

import logging

import click


@click.command("proxy")
@click.option("--prefill", "prefill_urls", multiple=True, required=True, metavar="URL",
              help="Base URL of a prefill server (http://host:port); repeat for several "
                   "(used round-robin).")
@click.option("--decode", "decode_urls", multiple=True, required=True, metavar="URL",
              help="Base URL of a decode server (http://host:port); repeat for several "
                   "(used round-robin). /v1/models is answered by the first.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def proxy_cmd(prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], host: str,
              port: int, log_level: str) -> None:
    """Route each completion / chat completion to a prefill server (max_tokens=1, KV kept
    for a remote decoder), then to a decode server with the prefill server's
    kv_transfer_params; the decode server's answer (streamed or not) goes to the client."""
    import uvicorn

    from engine.kv_transfer.proxy import build_proxy_app

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_proxy_app(prefill_urls, decode_urls)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    # uvicorn handles SIGINT / SIGTERM and runs the app's lifespan shutdown, which closes
    # the shared httpx client.
    uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="on")
