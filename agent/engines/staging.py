"""Weight syncs as the generation server receives them: checked, staged, loaded only whole.

The served model's *manifest* (tensor names and shapes from its safetensors files) is what a
sync must fit. Over the http transport, each bucket is checked when it arrives (names, shapes,
dtypes, finite values; ``agent.engines.wire.check_weights``) and staged; the total staged per sync
is capped (by default at the served model's size in float32, the largest dtype a sync sends),
and only a commit that finds every bucket loads anything. A refused bucket or commit leaves the
served weights untouched.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from agent.engines.wire import tensor_bytes
from emapg.server_input import HTTPError

log = logging.getLogger("agent.engines.server")

Manifest = dict[str, tuple[int, ...]]


def checkpoint_manifest(model_dir: str) -> Manifest | None:
    """Tensor names and shapes of a safetensors checkpoint folder (None when it has none)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    out: Manifest = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name] = tuple(fh.get_slice(name).get_shape())
    return out


def _allowed(manifest: Manifest) -> Manifest:
    """The names a sync may send: a tied lm_head is absent from the checkpoint but present in a trainer's state dict."""
    allowed = dict(manifest)
    if "lm_head.weight" not in allowed and "model.embed_tokens.weight" in allowed:
        allowed["lm_head.weight"] = allowed["model.embed_tokens.weight"]
    return allowed


def float32_bytes(manifest: Manifest) -> int:
    """Every tensor a sync may send, in float32 (the largest dtype it sends): the most a sync can legitimately stage."""
    return sum(math.prod(shape) * 4 for shape in _allowed(manifest).values())


#: A LoRA adapter tensor as peft saves it: the adapted module's name, then A (r, in) or B (out, r).
LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def lora_rank(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The rank of a sync of LoRA adapters (every name a :data:`LORA_KEY`), None for a sync of model weights."""
    if not shapes or not all(LORA_KEY.match(n) for n in shapes):
        return None
    return min((s[0] if LORA_KEY.match(n).group(2) == "A" else s[-1]) if len(s) == 2 else 0 for n, s in shapes.items())


def _check_adapters(shapes: dict[str, tuple[int, ...]], allowed: Manifest, *, complete: bool) -> None:
    """LoRA adapters must sit on 2-D weights of the served model, with one rank r: A (r, in), B (out, r)."""
    problems: list[str] = []
    ranks: set[int] = set()
    parts: dict[str, set[str]] = {}
    for name, shape in shapes.items():
        m = LORA_KEY.match(name)
        if m is None:
            problems.append(f"{name} (a sync is either model weights or LoRA adapters)")
            continue
        module, which = m.group(1), m.group(2)
        parts.setdefault(module, set()).add(which)
        base = allowed.get(f"{module}.weight")
        if base is None or len(base) != 2:
            problems.append(f"{name} (no 2-D weight {module}.weight in the served model)")
            continue
        out_f, in_f = base
        if len(shape) != 2 or (which == "A" and shape[1] != in_f) or (which == "B" and shape[0] != out_f):
            problems.append(f"{name} shape {list(shape)} (for {module}.weight {list(base)})")
            continue
        ranks.add(shape[0] if which == "A" else shape[1])
    if len(ranks) > 1:
        problems.append(f"several LoRA ranks {sorted(ranks)}")
    if complete:
        problems += [f"{module} has lora_{''.join(sorted({'A', 'B'} - got))} missing" for module, got in parts.items() if got != {"A", "B"}]
    if problems:
        raise HTTPError(422, f"the LoRA adapters do not fit the served model: {'; '.join(problems[:5])}", "weights_mismatch")


def check_against_manifest(shapes: dict[str, tuple[int, ...]], manifest: Manifest | None, *, complete: bool) -> None:
    """Refuse tensors that do not fit the served model *before* any weight is touched.

    ``complete``: ``shapes`` is a whole sync, so every tensor of the model must be there; otherwise
    (one bucket) only unknown names and wrong shapes are errors. A tied lm_head may be left out.
    """
    if manifest is None:
        return
    allowed = _allowed(manifest)
    if any(LORA_KEY.match(n) for n in shapes):
        _check_adapters(shapes, allowed, complete=complete)
        return
    unknown = sorted(set(shapes) - set(allowed))
    missing = sorted(set(manifest) - set(shapes)) if complete else []
    wrong = sorted(n for n in shapes if n in allowed and tuple(shapes[n]) != tuple(allowed[n]))
    if unknown or missing or wrong:
        raise HTTPError(
            422,
            f"the weights do not fit the served model: unknown={unknown[:5]} missing={missing[:5]} "
            f"wrong shape={[(n, list(shapes[n]), list(allowed[n])) for n in wrong[:3]]}",
            "weights_mismatch",
        )


class WeightStaging:
    """The buckets of the one http sync in progress (a new sync id discards an older one's)."""

    def __init__(self, manifest: Manifest | None, max_bytes: int) -> None:
        self.manifest = manifest
        self.max_bytes = max_bytes
        self.sync_id: str | None = None
        self.buckets: dict[int, dict[str, torch.Tensor]] = {}
        self.nbytes = 0

    def _reset(self, sync_id: str | None) -> None:
        """Start staging ``sync_id`` (None: nothing), dropping what is staged; silent: the callers that
        end a sync (committed, refused, aborted by its client) say so in their answer."""
        self.sync_id, self.buckets, self.nbytes = sync_id, {}, 0

    def stage(self, sync_id: str, index: int, tensors: dict[str, torch.Tensor]) -> dict:
        """Stage bucket ``index`` (already checked by ``wire.check_weights``); HTTPError when it does not fit."""
        check_against_manifest({k: tuple(v.shape) for k, v in tensors.items()}, self.manifest, complete=False)
        if self.sync_id != sync_id:
            if self.buckets:  # the only way a sync is abandoned: nobody committed or aborted it
                log.warning("discarding %d staged buckets of unfinished sync %s (sync %s started)", len(self.buckets),
                            self.sync_id, sync_id)
            self._reset(sync_id)
        others = {n for i, b in self.buckets.items() if i != index for n in b}
        dup = sorted(others & set(tensors))
        if dup:
            raise HTTPError(422, f"tensor(s) {dup[:5]} of bucket {index} were already staged in another bucket of sync {sync_id!r}")
        old = self.buckets.get(index, {})
        total = self.nbytes - sum(map(tensor_bytes, old.values())) + sum(map(tensor_bytes, tensors.values()))
        if total > self.max_bytes:
            self._reset(None)
            raise HTTPError(413, f"sync {sync_id!r} would stage {total} bytes, more than the limit of {self.max_bytes} "
                                 "(--max-staged-mb; default: the served model in float32); its buckets were discarded")  # fmt: skip
        self.buckets[index] = tensors
        self.nbytes = total
        return {"sync_id": sync_id, "staged_buckets": len(self.buckets), "staged_tensors": sum(len(b) for b in self.buckets.values())}

    def take(self, sync_id: str, n_buckets: int, n_tensors: int | None) -> dict[str, torch.Tensor]:
        """The whole state dict of a fully staged sync (and nothing staged afterwards); HTTPError 409/422 otherwise."""
        if self.sync_id != sync_id or not self.buckets:
            raise HTTPError(409, f"nothing staged for sync {sync_id!r} (a newer sync replaced it, or the server restarted); resend its buckets")
        missing = sorted(set(range(n_buckets)) - set(self.buckets))
        extra = sorted(set(self.buckets) - set(range(n_buckets)))
        if missing or extra:
            raise HTTPError(409, f"sync {sync_id!r} is incomplete: missing buckets {missing[:10]}, unexpected {extra[:10]}; nothing was loaded")
        sd: dict[str, torch.Tensor] = {}
        for i in range(n_buckets):
            sd.update(self.buckets[i])
        if n_tensors is not None and n_tensors != len(sd):
            raise HTTPError(409, f"sync {sync_id!r} staged {len(sd)} tensors, the client sent {n_tensors}; nothing was loaded")
        check_against_manifest({k: tuple(v.shape) for k, v in sd.items()}, self.manifest, complete=True)
        self._reset(None)
        return sd

    def discard(self, sync_id: str) -> bool:
        if self.sync_id == sync_id and self.buckets:
            self._reset(None)
            return True
        return False
