"""Dataset registry and loaders for the search (QA) and math tasks.

One entry point, :func:`load_dataset`, returns a list of :class:`Example` from

* a bundled file in ``data/`` (``load_dataset("nq")``, ``load_dataset("nq", split="train")``),
* a user file (``path=``): ``.jsonl``, ``.json`` (optionally gzipped) or ``.parquet``, in any of
  the layouts below, so the full-size sets of the paper can be dropped in,
* a Hugging Face dataset, ``load_dataset("hf:org/name[:config][@split]")``, when a hub is
  reachable (needs ``pip install datasets``).

Accepted row layouts (detected per row):

* FlashRAG: ``{"id", "question", "golden_answers": [...]}``;
* Search-R1 / verl parquet: ``question`` or a chat ``prompt``, ``reward_model.ground_truth``
  (``{"target": [...]}`` or a plain answer), ``data_source``, ``ability``;
* plain QA: ``{"question", "answer"}`` with a string or a list (MuSiQue's ``answer_aliases``
  are added when present);
* math: ``{"problem", "answer"}``.

Answers always come back as a non-empty list of strings: numbers are written without a
spurious ``.0`` (AMC's ``23.0`` -> ``"23"``) and surrounding whitespace is stripped
(Minerva's answers end in a newline upstream).

Where a bundled set is not the split the paper names, ``Example.meta["upstream_split"]`` says
what it really is (e.g. the HotpotQA "test" set is the official dev split, like FlashRAG's).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from emapg.errors import UserError
from emapg.paths import BUNDLED_CORPUS, DATA_DIR  # noqa: F401 (BUNDLED_CORPUS: re-exported)

#: A dataset's task, as the registry names it (:func:`tasks.task.get_task` maps it to the task object).
DatasetTask = Literal["qa", "math"]

QA_DATASETS: tuple[str, ...] = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
MATH_DATASETS: tuple[str, ...] = ("aime2024", "amc", "math500", "minerva", "olympiadbench")

#: The fixed held-out split of every QA set of :data:`QA_DATASETS`: question ids, recorded in the repository
#: (``data/qa/heldout.json``, written by ``scripts/build_qa_pool.py``). It is the seeded sample
#: ``load_dataset(name, limit=HELDOUT_PER_DATASET, seed=HELDOUT_SEED)`` of the test split, so every
#: ``--limit n --data-seed 0`` evaluation with ``n <= 100`` is a subset of it. No training, warm-start or
#: selection data may contain these questions (``tasks.heldout``; the training pool is disjoint from it).
HELDOUT_FILE = DATA_DIR / "qa" / "heldout.json"
HELDOUT_PER_DATASET = 100
HELDOUT_SEED = 0


class DatasetError(UserError, ValueError):
    """A dataset that cannot be loaded as asked: unknown name, missing file, malformed row."""


@dataclass
class Example:
    """One evaluation or training item; ``question`` holds the math problem for math sets."""

    id: str
    question: str
    answers: list[str]
    data_source: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetInfo:
    """A registered dataset: its task, bundled files per split, and what each split really is."""

    name: str
    task: DatasetTask
    files: dict[str, str]  # split -> path relative to data/
    upstream_split: dict[str, str]  # split -> the upstream split / sample the file holds


def _info(name: str, task: DatasetTask, **splits: tuple[str, str]) -> DatasetInfo:
    return DatasetInfo(name, task, files={s: f for s, (f, _) in splits.items()},
                       upstream_split={s: u for s, (_, u) in splits.items()})


REGISTRY: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        _info("nq", "qa",
              test=("qa/nq/test.jsonl.gz", "NQ-open test (full)"),
              train=("qa/nq/train.jsonl.gz", "NQ-open train, first 5,000 rows of Search-R1's train.parquet")),
        _info("triviaqa", "qa", test=("qa/triviaqa/test.jsonl.gz",
                                      "FlashRAG test (= unfiltered web dev), 1,000-row sample")),
        _info("popqa", "qa", test=("qa/popqa/test.jsonl.gz", "FlashRAG test, 1,000-row sample")),
        _info("hotpotqa", "qa",
              test=("qa/hotpotqa/test.jsonl.gz", "dev (distractor), full"),
              train=("qa/hotpotqa/train.jsonl.gz",
                     "100 train rows (HippoRAG) + 300 dev rows (RPT 'train'; flagged in test meta)")),
        _info("2wikimultihopqa", "qa", test=("qa/2wikimultihopqa/test.jsonl.gz", "dev, full")),
        _info("musique", "qa", test=("qa/musique/test.jsonl.gz", "MuSiQue-Ans dev, full")),
        _info("bamboogle", "qa", test=("qa/bamboogle/test.jsonl.gz", "test, full")),
        _info("nq_gold", "qa", test=("qa/nq_gold/test.jsonl.gz",
                                     "NQ-open test questions with an annotated gold passage")),
        _info("qa_pool", "qa", train=("qa/pool/train.jsonl.gz",
                                      "the answerable training pool: bundled QA questions outside every held-out split whose "
                                      "answer is in the top-3 passages of the bundled index (data/qa/pool/record.json)")),
        _info("qa_pool_informative", "qa", train=("qa/pool/informative.jsonl.gz",
                                                  "the pool questions the starter solved in some but not all of its samples "
                                                  "(offline difficulty curation: data/qa/pool/informative_record.json, "
                                                  "scripts/curate_pool.py)")),
        _info("qa_pool_v2", "qa", train=("qa/pool_v2/train.jsonl.gz",
                                         "training pool v2: multi-hop questions one search answers and questions a second "
                                         "search answers, plus qa_pool questions, none held out (data/qa/pool_v2/record.json, "
                                         "scripts/build_search_data.py)")),
        _info("aime2024", "math", test=("math/aime2024.jsonl.gz", "AIME 2024 I+II")),
        _info("amc", "math", test=("math/amc.jsonl.gz",
                                   "AMC 2022-23 (DeepScaleR); not the paper's LiveMathBench AMC")),
        _info("math500", "math", test=("math/math500.jsonl.gz", "MATH-500")),
        _info("minerva", "math", test=("math/minerva.jsonl.gz", "Minerva math")),
        _info("olympiadbench", "math", test=("math/olympiadbench.jsonl.gz", "OlympiadBench (English, math)")),
        _info("math", "math", train=("math/math_train.jsonl.gz", "MATH train (4 rows without an answer dropped)")),
        _info("aime2025", "math"),  # no bundled file: pass path= or an hf: name
    )
}

for _name in QA_DATASETS:  # the held-out split: a recorded subset of the test file (HELDOUT_FILE)
    REGISTRY[_name].files["heldout"] = REGISTRY[_name].files["test"]
    REGISTRY[_name].upstream_split["heldout"] = (f"{HELDOUT_PER_DATASET}-question held-out sample of: "
                                                 f"{REGISTRY[_name].upstream_split['test']}")


def heldout_ids(name: str) -> list[str]:
    """The recorded held-out question ids of QA set ``name`` (:data:`HELDOUT_FILE`)."""
    if not HELDOUT_FILE.is_file():
        raise DatasetError(f"the held-out split record {HELDOUT_FILE} is missing; run scripts/build_qa_pool.py")
    record = json.loads(HELDOUT_FILE.read_text())
    if name not in record.get("ids", {}):
        raise DatasetError(f"dataset {name!r} has no held-out split (held-out sets: {', '.join(record.get('ids', {}))})")
    return list(record["ids"][name])


_ANSWER_KEYS = ("golden_answers", "answers", "answer")
_CONSUMED_KEYS = {"id", "_id", "question", "problem", "golden_answers", "answers", "answer", "answer_aliases",
                  "reward_model", "data_source"}


def load_dataset(
    name: str,
    *,
    split: str = "test",
    path: str | Path | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[Example]:
    """Load a dataset as a list of :class:`Example` with unique ids.

    Args:
        name: a registered name (``REGISTRY``), ``"hf:org/name[:config][@split]"``, or, with
            ``path``, any label (used as ``data_source`` when rows do not carry one). When the
            file mixes several ``data_source`` values and ``name`` is one of them, only those
            rows are kept, so a Search-R1 7-dataset test parquet can be loaded per dataset.
        split: which bundled split (``"test"``, ``"train"``, or ``"heldout"``: the recorded held-out
            subset of a QA test split, :data:`HELDOUT_FILE`), or the split of an ``hf:`` name without
            ``@split``; ignored with ``path``.
        path: a user file (``.jsonl``, ``.json``, optionally gzipped, or ``.parquet``) used
            instead of the bundled one.
        limit: keep this many examples, chosen by a seeded hash of the id: the same subset on
            every run and platform, and the subset for ``limit=n`` contains the one for ``n-1``.
            Examples keep their file order.
        seed: the sampling seed.
    """
    if not isinstance(name, str) or not name:
        raise DatasetError(f"dataset name must be a non-empty string, got {name!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DatasetError(f"limit must be a positive integer or None, got {limit!r}")
    info = REGISTRY.get(name)
    meta: dict[str, Any] = {}
    if name.startswith("hf:"):
        hf_name, records = _read_hf(name[3:], split)
        label, origin = hf_name, name
    elif path is not None:
        label, origin = name, str(path)
        records = _read_file(Path(path))
    else:
        if info is None:
            raise DatasetError(
                f"unknown dataset {name!r}; registered: {', '.join(REGISTRY)}; "
                "or pass path=<file> or use 'hf:org/name'")
        if split not in info.files:
            have = ", ".join(info.files) or "none"
            raise DatasetError(
                f"dataset {name!r} has no bundled {split!r} split (bundled: {have}); pass path=<file>")
        file = DATA_DIR / info.files[split]
        label, origin = name, str(file)
        records = _read_file(file)
        meta = {"split": split, "upstream_split": info.upstream_split[split]}
    records = _select_source(records, label)
    if path is None and split == "heldout" and info is not None:
        wanted = set(heldout_ids(name))
        records = [(n, row) for n, row in records if str(row.get("id", "")) in wanted]
        if len(records) != len(wanted):
            raise DatasetError(f"{HELDOUT_FILE}: {len(wanted) - len(records)} held-out ids of {name!r} are not in {origin}")
    task = task_of(label)  # a registered label fixes the task; otherwise it is read off each row
    examples = [_to_example(n, row, label, task, meta, origin) for n, row in records]
    _make_ids_unique(examples, origin)
    return examples if limit is None else _sample(examples, limit, seed)


def task_of(name: str) -> DatasetTask | None:
    """``"qa"`` or ``"math"`` for a registered name, else None (see ``Example.meta["task"]``)."""
    info = REGISTRY.get(name)
    return info.task if info is not None else None


# --------------------------------------------------------------------------- reading


def _read_file(path: Path) -> list[tuple[int, dict]]:
    """Rows of a user or bundled file as (1-based row/line number, record)."""
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    if not path.is_file():
        raise DatasetError(f"dataset path is not a file: {path}")
    suffixes = [s.lower() for s in path.suffixes]
    gz = bool(suffixes) and suffixes[-1] == ".gz"
    kind = suffixes[-2] if gz and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if kind == ".parquet" and not gz:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"{path}: cannot read parquet: {e}") from e
        records = list(enumerate(rows, 1))
    elif kind in (".jsonl", ".json"):
        try:
            with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DatasetError(f"{path}: cannot read: {e}") from e
        records = _parse_json_text(text, path, lines=kind == ".jsonl")
    else:
        raise DatasetError(f"{path}: unsupported file type; use .jsonl, .json (optionally .gz) or .parquet")
    if not records:
        raise DatasetError(f"{path}: the file has no rows")
    for n, row in records:
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {n}: expected a JSON object, got {type(row).__name__}")
    return records


def _parse_json_text(text: str, path: Path, *, lines: bool) -> list[tuple[int, Any]]:
    if not lines and text.strip():
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # "Extra data": a JSON-lines file named .json
                raise DatasetError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        else:
            if isinstance(data, list):
                return list(enumerate(data, 1))
            if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
                # {id: row} mapping: the key becomes the id where the row has none
                return [(n, {"id": k, **v}) for n, (k, v) in enumerate(data.items(), 1)]
            raise DatasetError(f"{path}: expected a JSON list of rows (or an {{id: row}} object)")
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {n}: invalid JSON: {e.msg}") from e
    return records


def _read_hf(spec: str, split: str) -> tuple[str, list[tuple[int, dict]]]:
    """``org/name[:config][@split]`` through ``datasets.load_dataset``; returns (label, rows)."""
    repo_config, at, hf_split = spec.partition("@")
    repo, _, config = repo_config.partition(":")
    if not repo or (at and not hf_split):
        raise DatasetError(f"bad Hugging Face dataset name 'hf:{spec}'; expected hf:org/name[:config][@split]")
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f"loading 'hf:{spec}' needs the `datasets` package: pip install datasets") from e
    hf_split = hf_split or split
    try:
        ds = datasets.load_dataset(repo, config or None, split=hf_split)
    except Exception as e:  # offline hub, unknown repo/config/split: all reported the same way
        raise DatasetError(
            f"cannot load Hugging Face dataset {repo!r} (config {config or None!r}, split {hf_split!r}): "
            f"{type(e).__name__}: {e}. A reachable hub is needed; offline, download the files and pass path=") from e
    label = config or repo.rsplit("/", 1)[-1]
    return label, list(enumerate((dict(r) for r in ds), 1))


# --------------------------------------------------------------------------- rows


def _select_source(records: list[tuple[int, dict]], label: str) -> list[tuple[int, dict]]:
    sources = {row.get("data_source") for _, row in records}
    if len(sources) > 1 and label in sources:
        return [(n, row) for n, row in records if row.get("data_source") == label]
    return records


def _to_example(n: int, row: dict, label: str, task: DatasetTask | None, meta: dict, origin: str) -> Example:
    where = f"{origin} row {n}"
    question = _question(row, where)
    answers = _answers(row, where)
    if task is None:
        task = "math" if "problem" in row or row.get("ability") == "math" else "qa"
    raw_id = row.get("id", row.get("_id"))
    ex_meta = {k: _plain(v) for k, v in row.items() if k not in _CONSUMED_KEYS}
    ex_meta.update(meta, task=task)
    return Example(
        id=f"{label}-{n}" if raw_id is None or str(raw_id) == "" else str(raw_id),
        question=question,
        answers=answers,
        data_source=str(row.get("data_source") or label),
        meta=ex_meta,
    )


def _question(row: dict, where: str) -> str:
    for key in ("question", "problem"):
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # verl chat prompt: use the last user turn
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if isinstance(prompt, str) and prompt.strip():
        # Search-R1 renders "...instructions... Question: <q>"; keep only the question so our
        # templates can render it again. Other prompts are used whole.
        _, marker, tail = prompt.rpartition("Question:")
        return (tail if marker and tail.strip() else prompt).strip()
    raise DatasetError(f"{where}: no question (expected a non-empty 'question', 'problem' or chat 'prompt')")


def _answers(row: dict, where: str) -> list[str]:
    value = next((row[k] for k in _ANSWER_KEYS if row.get(k) is not None), None)
    if value is None and isinstance(row.get("reward_model"), dict):
        truth = row["reward_model"].get("ground_truth")
        value = truth.get("target") if isinstance(truth, dict) else truth
    if value is None:
        raise DatasetError(
            f"{where}: no answer (expected 'golden_answers', 'answers', 'answer' or reward_model.ground_truth)")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    aliases = row.get("answer_aliases")
    if isinstance(aliases, (list, tuple)):
        values += aliases
    answers: list[str] = []
    for v in values:
        text = _answer_text(v, where).strip()
        if text and text not in answers:
            answers.append(text)
    if not answers:
        raise DatasetError(f"{where}: the answer is empty")
    return answers


def _answer_text(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: an answer must be a string or a number, got {value!r}")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _plain(value: Any) -> Any:
    """JSON-like Python values (HF/pyarrow rows may hold tuples or numpy scalars)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _plain(value.tolist())
    return value


def _make_ids_unique(examples: list[Example], origin: str) -> None:
    """Keep ids as given; if they repeat only across data sources (a Search-R1 test parquet
    numbers each source from test_0), qualify them with the source; otherwise refuse."""
    if len({ex.id for ex in examples}) == len(examples):
        return
    qualified = [f"{ex.data_source}-{ex.id}" for ex in examples]
    if len(set(qualified)) == len(examples):
        for ex, new_id in zip(examples, qualified):
            ex.id = new_id
        return
    dup, _ = Counter(ex.id for ex in examples).most_common(1)[0]
    raise DatasetError(f"{origin}: duplicate id {dup!r}; ids must be unique within a dataset")


def _sample(examples: list[Example], limit: int, seed: int) -> list[Example]:
    if limit >= len(examples):
        return examples
    def rank(i: int) -> bytes:
        return hashlib.sha256(f"{seed}\x00{examples[i].id}".encode()).digest()
    keep = set(sorted(range(len(examples)), key=rank)[:limit])
    return [ex for i, ex in enumerate(examples) if i in keep]

