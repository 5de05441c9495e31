"""Wire format of the generation server (agent/engines/server.py) and its client (remote.py).

JSON for requests and outputs: token ids and log-probs are JSON numbers (Python writes floats
with ``repr``, which round-trips exactly, so a remote engine returns bit-identical log-probs).
Weights travel as safetensors (never pickle): :func:`plan_buckets` cuts a state dict into
size-bounded buckets that are sent as one safetensors body each (http transport) or one flat
buffer per bucket (collective transport, agent/engines/collective.py).
"""

from __future__ import annotations

from typing import Any

import torch

from agent.engines.base import GenerationOutput, SamplingParams

PARAM_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "allowed_token_ids", "ignore_eos")
_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "max_tokens": (int,), "seed": (int,), "ignore_eos": (bool,),
}  # fmt: skip

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_tokens": p.max_tokens, "stop": list(p.stop),
        "seed": p.seed, "allowed_token_ids": list(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
        "ignore_eos": p.ignore_eos,
    }  # fmt: skip


def params_from_json(data: Any, where: str = "params") -> SamplingParams:
    """A JSON object -> SamplingParams; ValueError naming the bad field (SamplingParams checks the ranges)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object with fields {list(PARAM_FIELDS)}")
    unknown = sorted(set(data) - set(PARAM_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {list(PARAM_FIELDS)}")
    for name, types in _TYPES.items():
        v = data.get(name)
        if v is None:
            continue
        if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
            raise ValueError(f"{where}.{name} must be {' or '.join(t.__name__ for t in types)}, got {v!r}")
    stop = data.get("stop") or []
    if isinstance(stop, str) or not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"{where}.stop must be a list of strings")
    allowed = data.get("allowed_token_ids")
    if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in allowed)):
        raise ValueError(f"{where}.allowed_token_ids must be null or a list of integers")
    kwargs = {k: v for k, v in data.items() if v is not None and k not in ("stop", "allowed_token_ids")}
    try:
        return SamplingParams(stop=tuple(stop), allowed_token_ids=allowed, **kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def output_to_json(o: GenerationOutput) -> dict[str, Any]:
    return {"token_ids": o.token_ids, "logprobs": o.logprobs, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}


def output_from_json(d: dict[str, Any]) -> GenerationOutput:
    return GenerationOutput(list(d["token_ids"]), [float(x) for x in d["logprobs"]], d["finish_reason"], d.get("stop_reason"))


def parse_prompts(data: Any, vocab_size: int, max_prompts: int) -> list[list[int]]:
    """``prompts``: a non-empty list of non-empty lists of ints (range checks: base.check_prompts)."""
    if not isinstance(data, list) or not data:
        raise ValueError("'prompts' must be a non-empty list of token-id lists")
    if len(data) > max_prompts:
        raise ValueError(f"too many prompts: {len(data)} > {max_prompts} per request; split them over several requests")
    for i, ids in enumerate(data):
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompts[{i}] must be a list of integer token ids")
    return data


# ----------------------------------------------------------------------------- weight buckets


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, Any]]:
    """Group tensors into buckets of one dtype and at most ``max_bytes`` (a larger tensor gets its own).

    Returns JSON-able metadata: ``[{"dtype": "float32", "tensors": [[name, [shape...]], ...]}, ...]``,
    in state-dict order within each dtype, which is what both transports send.
    """
    if max_bytes < 1:
        raise ValueError("bucket size must be >= 1 byte")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in state_dict.items():
        if t.dtype not in DTYPES.values():
            raise ValueError(f"cannot sync {name}: dtype {t.dtype} (supported: {sorted(DTYPES)})")
        by_dtype.setdefault(t.dtype, []).append(name)
    names_of = {v: k for k, v in DTYPES.items()}
    buckets: list[dict[str, Any]] = []
    for dtype, names in by_dtype.items():
        cur: list[list[Any]] = []
        size = 0
        for name in names:
            n = tensor_bytes(state_dict[name])
            if cur and size + n > max_bytes:
                buckets.append({"dtype": names_of[dtype], "tensors": cur})
                cur, size = [], 0
            cur.append([name, list(state_dict[name].shape)])
            size += n
        if cur:
            buckets.append({"dtype": names_of[dtype], "tensors": cur})
    return buckets


def check_bucket_meta(meta: Any) -> list[dict[str, Any]]:
    """Validate bucket metadata received over HTTP (collective transport)."""
    if not isinstance(meta, list) or not meta:
        raise ValueError("'buckets' must be a non-empty list of {dtype, tensors}")
    for i, b in enumerate(meta):
        if not isinstance(b, dict) or b.get("dtype") not in DTYPES or not isinstance(b.get("tensors"), list) or not b["tensors"]:
            raise ValueError(f"buckets[{i}] must be {{'dtype': one of {sorted(DTYPES)}, 'tensors': [[name, shape], ...]}}")
        for entry in b["tensors"]:
            ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
            if not ok or not all(isinstance(d, int) and d >= 0 for d in entry[1]):
                raise ValueError(f"buckets[{i}]: every tensor entry must be [name, [dims...]], got {entry!r}"[:300])
    return meta
