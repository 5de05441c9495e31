"""Wire format of the generation server (agent/engines/server.py) and its client (remote.py).

JSON for requests and outputs: token ids and log-probs are JSON numbers (Python writes floats
with ``repr``, which round-trips exactly, so a remote engine returns bit-identical log-probs).
Weights travel as safetensors (never pickle): :func:`plan_buckets` cuts a state dict into
size-bounded buckets that are sent as one safetensors body each (http transport) or one flat
buffer per bucket (collective transport, agent/engines/collective.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from agent.engines.base import GenerationOutput, SamplingParams
from emapg.server_input import HTTPError, as_bool, as_int, as_list, as_text, check_fields, show

PARAM_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "allowed_token_ids", "ignore_eos")

# Ranges every engine handles (checked before a request is batched with others; outside them a request
# passed validation once and then failed inside the engine step for its whole batch):
# a temperature below 1e-5 makes logits / temperature overflow float32 (vLLM treats < 1e-5 as greedy);
# torch generators take seeds below 2**63 (and a single params' seed s becomes s + i for prompt i).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0
MAX_SEED = 2**63 - 1
MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1000

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def params_to_json(p: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_tokens": p.max_tokens, "stop": list(p.stop),
        "seed": p.seed, "allowed_token_ids": list(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
        "ignore_eos": p.ignore_eos,
    }  # fmt: skip


def params_from_json(data: Any, where: str = "params") -> SamplingParams:
    """A JSON object -> SamplingParams, strictly typed and in the ranges above; HTTPError 422 naming the field.

    A field that is absent or null takes SamplingParams' default.
    """
    check_fields(data, where, PARAM_FIELDS)
    kw: dict[str, Any] = {}
    if data.get("temperature") is not None:
        t = data["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise HTTPError(422, f"{where}.temperature must be >= 0: 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
                                 f"got {show(t)}")  # fmt: skip
        kw["temperature"] = float(t)
    if data.get("top_p") is not None:
        p = data["top_p"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise HTTPError(422, f"{where}.top_p must be in (0, 1], got {show(p)}")
        kw["top_p"] = float(p)
    if data.get("top_k") is not None:
        kw["top_k"] = as_int(data["top_k"], f"{where}.top_k", -1, MAX_INT32)
    if data.get("max_tokens") is not None:
        kw["max_tokens"] = as_int(data["max_tokens"], f"{where}.max_tokens", 1, MAX_INT32)
    if data.get("seed") is not None:
        kw["seed"] = as_int(data["seed"], f"{where}.seed", 0, MAX_SEED)
    if data.get("ignore_eos") is not None:
        kw["ignore_eos"] = as_bool(data["ignore_eos"], f"{where}.ignore_eos")
    # null means absent; any other non-list (0, "", false, {}) is an error, not "no stop strings"
    stop = [] if data.get("stop") is None else as_list(data["stop"], f"{where}.stop", max_len=MAX_STOP_STRINGS)
    kw["stop"] = tuple(as_text(s, f"{where}.stop[{i}]", max_chars=MAX_STOP_CHARS, nonempty=False) for i, s in enumerate(stop))
    allowed = data.get("allowed_token_ids")
    if allowed is not None:
        allowed = as_list(allowed, f"{where}.allowed_token_ids", max_len=1 << 20)
        kw["allowed_token_ids"] = [as_int(t, f"{where}.allowed_token_ids[{i}]", 0, MAX_INT32) for i, t in enumerate(allowed)]
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise HTTPError(422, f"{where}: {e}") from None


def check_seeds(params: list[SamplingParams]) -> None:
    """Per-prompt seeds (``s + i`` from one params object) stay in range."""
    for i, p in enumerate(params):
        if p.seed is not None and p.seed > MAX_SEED:
            raise HTTPError(422, f"prompt {i}'s seed {p.seed} (the request's seed + {i}) exceeds {MAX_SEED}")


def finite_or_none(values: list[float]) -> list[float | None]:
    """JSON has no NaN or infinity: a non-finite log-prob travels as null (read back as NaN)."""
    if math.isfinite(sum(values)):  # the common case in one pass (the sum of [] is 0)
        return values  # type: ignore[return-value]
    return [v if math.isfinite(v) else None for v in values]


def floats_from_json(values: list[Any]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def output_to_json(o: GenerationOutput) -> dict[str, Any]:
    return {"token_ids": o.token_ids, "logprobs": finite_or_none(o.logprobs), "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}


def output_from_json(d: dict[str, Any]) -> GenerationOutput:
    return GenerationOutput(list(d["token_ids"]), floats_from_json(d["logprobs"]), d["finish_reason"], d.get("stop_reason"))


def parse_prompts(data: Any, max_prompts: int, where: str = "prompts") -> list[list[int]]:
    """``prompts``: a non-empty list of lists of ints (range checks: base.check_prompts); HTTPError 422/413."""
    if not isinstance(data, list) or not data:
        raise HTTPError(422, f"'{where}' must be a non-empty list of token-id lists")
    if len(data) > max_prompts:
        raise HTTPError(413, f"too many prompts: {len(data)} > {max_prompts} per request; split them over several requests")
    for i, ids in enumerate(data):
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):  # not bool (a subclass of int)
            raise HTTPError(422, f"{where}[{i}] must be a list of integer token ids")
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


def check_bucket_meta(meta: Any, max_buckets: int = 100_000) -> list[dict[str, Any]]:
    """Validate bucket metadata received over HTTP (collective transport); ValueError naming the entry."""
    if not isinstance(meta, list) or not meta:
        raise ValueError("'buckets' must be a non-empty list of {dtype, tensors}")
    if len(meta) > max_buckets:
        raise ValueError(f"'buckets' has {len(meta)} entries, more than {max_buckets}")
    for i, b in enumerate(meta):
        if not isinstance(b, dict) or set(b) != {"dtype", "tensors"} or b["dtype"] not in DTYPES or not isinstance(b["tensors"], list) or not b["tensors"]:
            raise ValueError(f"buckets[{i}] must be {{'dtype': one of {sorted(DTYPES)}, 'tensors': [[name, shape], ...]}}")
        for entry in b["tensors"]:
            ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and 0 < len(entry[0]) <= 1000 and isinstance(entry[1], list)
            if not ok or len(entry[1]) > 8 or not all(type(d) is int and 0 <= d <= MAX_INT32 for d in entry[1]):
                raise ValueError(f"buckets[{i}]: every tensor entry must be [name, [dims...]] (at most 8 dims), got {show(entry)}")
            as_text(entry[0], f"buckets[{i}] tensor name", max_chars=1000)
    return meta


def meta_bytes(meta: list[dict[str, Any]]) -> int:
    """Bytes the tensors described by (checked) bucket metadata take."""
    return sum(math.prod(shape) * DTYPES[b["dtype"]].itemsize for b in meta for _, shape in b["tensors"])


def check_weights(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse tensors no served model can take: a dtype outside :data:`DTYPES` or a non-finite value (ValueError naming it)."""
    for name, t in tensors.items():
        if t.dtype not in DTYPES.values():
            raise ValueError(f"tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}; weights must be one of {sorted(DTYPES)}")
        if t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"tensor {name!r} has {bad} non-finite value(s) (NaN or infinity); nothing was loaded")
