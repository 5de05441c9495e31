"""What the servers' connection guard (emapg.connection_guard: header deadline, idle cap) costs a request.

Two uvicorn servers on the same trivial ASGI app, each in its own process: uvicorn's own httptools protocol,
and the guarded one the retriever and the generation server run. Clients send small keep-alive GET requests
on raw sockets (so the client costs little); the variants alternate over several rounds (a shared machine is
noisy: the median round of each is compared). Prints requests/s of both and the ratio guarded / plain; writes JSON.

    python benchmarks/connection_guard.py [--requests 5000] [--clients 4] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
BODY = b'{"ok": true}'


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]})
    await send({"type": "http.response.body", "body": BODY})


def _serve(port: int, guarded: bool) -> None:
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from emapg.connection_guard import guarded_protocol

    http = guarded_protocol(10.0, 256, HttpToolsProtocol) if guarded else HttpToolsProtocol
    uvicorn.run(_app, host="127.0.0.1", port=port, http=http, lifespan="off", log_level="warning", access_log=False)


def _client(port: int, n: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(n):
            sock.sendall(REQUEST)
            data = b""
            while not data.endswith(BODY):
                data += sock.recv(4096)


def _rate(port: int, requests: int, clients: int) -> float:
    threads = [threading.Thread(target=_client, args=(port, requests // clients)) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (requests // clients) * clients / (time.perf_counter() - t0)


def main() -> int:
    from emapg.servers import free_port

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="requests per round and variant")
    p.add_argument("--clients", type=int, default=4, help="concurrent keep-alive connections")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median of each variant is compared")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "connection_guard.json"))
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    ports = {"plain": free_port(), "guarded": free_port()}
    procs = {name: ctx.Process(target=_serve, args=(port, name == "guarded"), daemon=True) for name, port in ports.items()}
    for proc in procs.values():
        proc.start()
    try:
        for port in ports.values():
            deadline = time.monotonic() + 60
            while True:
                try:
                    _client(port, 1)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        rates: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(args.rounds):
            for name, port in ports.items():
                rates[name].append(_rate(port, args.requests, args.clients))
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.join()
    median = {name: statistics.median(r) for name, r in rates.items()}
    report = {"requests_per_round": args.requests, "clients": args.clients, "rounds": args.rounds,
              "requests_per_s": rates, "median_requests_per_s": median, "guarded_over_plain": median["guarded"] / median["plain"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"median of {args.rounds} rounds: plain {median['plain']:.0f} req/s, guarded {median['guarded']:.0f} req/s: "
          f"guarded / plain = {report['guarded_over_plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
