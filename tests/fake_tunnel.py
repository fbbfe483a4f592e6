"""A stand-in for ``cloudflared tunnel --url http://127.0.0.1:PORT`` in tests: this machine has no
tunnel binary (and no network to Cloudflare's edge). Like the real one it is a separate process
that opens its own loopback connections to the server and prints a trycloudflare.com URL; its
public side is a plain TCP listener on 127.0.0.1 whose port it prints as ``listening on PORT``.
Bytes pass through unchanged, so a test writes the CF-Connecting-IP header the edge would add.

    python tests/fake_tunnel.py tunnel --no-autoupdate --url http://127.0.0.1:8765

Tests call ``start(folder, port)``: serve.py's own Tunnel runs it. Reads no env.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def start(folder: Path, port: int) -> tuple[Any, int]:
    """(serve.Tunnel running this script as ``cloudflared`` towards 127.0.0.1:``port``, the port
    of its public side). The caller ends ``tunnel.proc``."""
    import threading

    import serve
    from helpers import fake_binary
    binary = fake_binary(folder, "cloudflared", f'exec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    tunnel = serve.Tunnel("cloudflare", str(binary), port)
    assert tunnel.wait_for_host(15, threading.Event()) == "fake-door-test.trycloudflare.com"
    listening = next(line for line in tunnel.lines if line.startswith("listening on "))
    return tunnel, int(listening.rsplit(" ", 1)[1])


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main() -> None:
    target = urlparse(sys.argv[sys.argv.index("--url") + 1])

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(forward, "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    print("INF |  https://fake-door-test.trycloudflare.com  |", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
