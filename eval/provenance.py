"""What an evaluation's numbers depend on, and whether two runs' numbers may be compared.

``results.json`` carries ``fingerprint`` (the index fingerprint of the retriever the run searched,
:mod:`retriever.fingerprint`; ``None`` for math), ``retriever_fingerprints`` (per server URL) and
``protocol_card`` (:func:`provision.provenance.protocol_card`: sampling and rollout settings, the
template's hash, each dataset's file hash and a hash of the exact questions, the model's hash,
package versions).

:func:`run_differences` splits the differences between two runs into the ones that make their
numbers incomparable -- another index, or another protocol (settings, template, datasets) -- and
the ones a comparison is usually about (the model, package versions), which are listed but allowed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from provision.provenance import dataset_card, differences, model_card, protocol_card

#: Parts of the protocol card that are expected to differ between compared runs (listed, not refused).
INFORMATIONAL = ("model", "packages")


def eval_protocol_card(cfg: Any, examples: Mapping[str, Sequence[Any]], model_path: str | None) -> dict[str, Any]:
    """The protocol card of an ``emapg eval`` run (``cfg``: its :class:`eval.runner.EvalConfig`)."""
    from eval.protocols import protocol_dict

    settings = {k: v for k, v in protocol_dict(cfg.protocol).items() if k != "name"}  # the name is a label
    settings.update(limit=cfg.limit, data_seed=cfg.data_seed)
    datasets = {ds: dataset_card(ds, exs, path=cfg.data_paths.get(ds)) for ds, exs in examples.items()}
    return protocol_card(settings, template=cfg.protocol.template, datasets=datasets, model=model_card(cfg.model, model_path))


@dataclass
class RunDifferences:
    """How one run differs from a reference run."""

    blocking: list[str]  # another index or protocol: the numbers are not comparable
    informational: list[str]  # the model, package versions


def run_differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> RunDifferences:
    """Differences between two ``results.json`` contents (runs written before provenance existed have
    no fingerprint or card; their ``protocol`` is compared instead)."""
    def comparable(r: Mapping[str, Any]) -> dict[str, Any]:
        card = dict(r.get("protocol_card") or {})
        view = {"fingerprint": r.get("fingerprint"), **{k: v for k, v in card.items() if k not in INFORMATIONAL}}
        excluded = (r.get("contamination") or {}).get("excluded_ids")
        if excluded:  # questions scored apart as trained on (eval.contamination): the metrics cover other questions
            view["trained_on_excluded"] = {ds: f"{len(ids)} question(s) left out (ids sha256 "
                                               f"{hashlib.sha256(chr(10).join(ids).encode()).hexdigest()[:12]})"
                                           for ds, ids in excluded.items()}
        if not card:
            view["settings"] = {k: v for k, v in (r.get("protocol") or {}).items() if k != "name"}
        return view

    def informational(r: Mapping[str, Any]) -> dict[str, Any]:
        card = r.get("protocol_card") or {}
        return {"model": card.get("model", {"name": r.get("model")}), "packages": card.get("packages")}

    return RunDifferences(differences(comparable(reference), comparable(other)),
                          differences(informational(reference), informational(other)))
