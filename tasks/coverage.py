"""Which questions an index can answer, and with how many searches: the rule of the coverage audit, the search
slice, the training pool v2 and the multi-search demonstrations.

For one question and a retriever (anything with ``retrieve(queries, topk) -> [[{"id", "contents"}]]``):

1. ``answer_in_question``: every gold answer occurs in the question itself (e.g. "A or B?"): a passage holding it
   shows nothing, so the question is not classified further;
2. ``not_in_corpus``: no passage of the corpus holds a gold (when the corpus is given; :class:`CorpusMatcher`);
3. ``first_search``: a gold is in the top-k passages for the question text;
4. ``second_search``: it is not, but a second search with a query the model could write from what it was shown finds
   it (:func:`second_queries`) -- known only where supporting titles or a decomposition are;
5. ``neither``: the second search was tried and failed, or the bridge entity was not shown (a model could not
   write the query);
6. ``unknown_second``: the first search failed and nothing is known to write a second query from.

"Holds a gold" is :func:`tasks.qa.gold_shown` (SQuAD-normalised, token-bounded, golds occurring in the question
left out) over the passages' text (title and body).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks.multihop import MultiHopQuestion, entity_name
from tasks.qa import gold_shown, normalize_answer

CLASSES = ("first_search", "second_search", "neither", "unknown_second", "not_in_corpus", "answer_in_question")

#: The rule as recorded in the files built from it.
RULE = ("top-{topk} passages of the index for the question text; a gold answer is shown when it occurs in a passage "
        "(SQuAD-normalised, token-bounded; golds occurring in the question left out: tasks.qa.gold_shown); the second "
        "query (tasks.coverage.second_queries) is the missing supporting paragraph's entity (its title without the "
        "disambiguation) followed by the relation asked (the question's content words outside the shown titles, at "
        "most 5) -- or, for MuSiQue, hop 2's sub-question with hop 1's answer in place of #1 -- tried only when that "
        "entity occurs in the question or the first passages; then the entity alone; then the title with its "
        "disambiguation as words")

_STOP = frozenset("""a an the of in on at to for from by with and or as is was were are be been being which what who whom
whose when where why how that this these those it its their his her he she they them there do does did has have had
not no yes than then also into about after before during both either same other another one first second more most
many much same film movie""".split())


def words(text: str) -> list[str]:
    return normalize_answer(text).split()


def relation_words(question: str, shown_titles: Iterable[str], entity: str, limit: int = 5) -> list[str]:
    """The relation asked: the question's content words, without stop words and words of the titles shown
    (the first hop) or of the entity, in question order, the last ``limit`` of them (a question ends with what it asks)."""
    drop = set(_STOP) | set(words(entity))
    for t in shown_titles:
        drop.update(words(t))
    kept = [w for w in words(question) if w not in drop]
    return list(dict.fromkeys(kept))[-limit:]


def hit_title(hit: dict) -> str:
    """A passage's title (``"Title"\\ntext``, quotes stripped)."""
    return str(hit.get("contents", "")).partition("\n")[0].strip().strip('"')


def passage_texts(hits: Sequence[dict]) -> list[str]:
    return [str(h.get("contents", "")) for h in hits]


def second_queries(q: MultiHopQuestion, first_hits: Sequence[dict]) -> tuple[list[str], str]:
    """The second queries a model could write after the first search, best first, and why there are none ('' if
    some). Only from what it was shown: the bridge entity must occur in the question or the first passages."""
    shown = " " + " ".join(normalize_answer(t) for t in [q.question, *passage_texts(first_hits)]) + " "
    titles = [hit_title(h) for h in first_hits]
    if q.decomposition:
        if len(q.decomposition) != 2:
            return [], "more_than_two_hops"
        bridge = q.decomposition[0]["answer"]
        if f" {normalize_answer(bridge)} " not in shown:
            return [], "bridge_not_shown"
        hop2 = q.decomposition[1]["question"].replace("#1", bridge)
        return list(dict.fromkeys([" ".join(hop2.split()), bridge])), ""
    if not q.support_titles:
        return [], "no_support_known"
    shown_titles = {normalize_answer(t) for t in titles}
    missing = [t for t in q.support_titles if normalize_answer(t) not in shown_titles]
    if len(missing) != 1:
        return [], "no_paragraph_missing" if not missing else "two_paragraphs_missing"
    entity = entity_name(missing[0])
    if not normalize_answer(entity) or f" {normalize_answer(entity)} " not in shown:
        return [], "bridge_not_shown"
    relation = relation_words(q.question, titles, entity)
    plain_title = " ".join(missing[0].replace("(", " ").replace(")", " ").split())  # "X (band)" -> "X band"
    return list(dict.fromkeys([" ".join([entity, *relation]).strip(), entity, plain_title])), ""


def corpus_passages(path) -> Iterable[str]:
    """The ``contents`` of every row of a corpus jsonl (``.gz`` too), streamed."""
    import gzip
    import json
    from pathlib import Path

    path = Path(path)
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield str(row.get("contents") or f'"{row.get("title", "")}"\n{row.get("text", "")}')


class CorpusMatcher:
    """Whether any corpus passage holds a gold (the normalised, token-bounded match), by an inverted index of tokens."""

    def __init__(self, passages: Iterable[str]) -> None:
        self.texts: list[str] = []
        self.postings: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(passages):
            norm = normalize_answer(p)
            self.texts.append(f" {norm} ")
            for w in set(norm.split()):
                self.postings[w].append(i)

    def holds(self, golds: Iterable[str], question: str | None = None) -> bool:
        asked = f" {normalize_answer(question)} " if question else None
        for g in golds:
            norm = normalize_answer(g)
            if not norm or (asked is not None and f" {norm} " in asked):
                continue
            toks = norm.split()
            rarest = min(toks, key=lambda w: len(self.postings.get(w, ())))
            if any(f" {norm} " in self.texts[i] for i in self.postings.get(rarest, ())):
                return True
        return False


@dataclass
class Coverage:
    """One question's class and the evidence for it."""

    id: str
    source: str
    type: str
    klass: str
    first_ids: list[str] = field(default_factory=list)
    first_gold: str | None = None
    second_query: str | None = None
    second_ids: list[str] = field(default_factory=list)
    second_gold: str | None = None
    why: str = ""  # for neither / unknown_second: why no second search found it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _all_in_question(q: MultiHopQuestion) -> bool:
    asked = f" {normalize_answer(q.question)} "
    return all(not normalize_answer(a) or f" {normalize_answer(a)} " in asked for a in q.answers)


def classify(questions: Sequence[MultiHopQuestion], retriever, *, topk: int = 3, corpus: CorpusMatcher | None = None,
             batch_size: int = 64, progress=None) -> list[Coverage]:
    """Classify every question (see the module docstring); retrieval is batched, ``progress(n_done)`` after each batch."""
    out: list[Coverage] = []
    for start in range(0, len(questions), batch_size):
        batch = questions[start:start + batch_size]
        firsts = retriever.retrieve([q.question for q in batch], topk)
        pending: list[tuple[int, list[str]]] = []
        for q, hits in zip(batch, firsts):
            c = Coverage(q.id, q.source, q.type, "", [str(h["id"]) for h in hits])
            out.append(c)
            c.first_gold = gold_shown(passage_texts(hits), q.answers, q.question)
            if _all_in_question(q):
                c.klass = "answer_in_question"
            elif corpus is not None and not corpus.holds(q.answers, q.question):
                c.klass = "not_in_corpus"
            elif c.first_gold is not None:
                c.klass = "first_search"
            else:
                queries, why = second_queries(q, hits)
                if not queries:
                    c.klass, c.why = ("unknown_second" if why == "no_support_known" else "neither"), why
                else:
                    pending.append((len(out) - 1, queries))
        _second_searches(out, pending, {q.id: q for q in batch}, retriever, topk)
        if progress is not None:
            progress(len(out))
    return out


def _second_searches(out: list[Coverage], pending: list[tuple[int, list[str]]], by_id: dict[str, MultiHopQuestion],
                     retriever, topk: int) -> None:
    """Try each pending question's queries in order (one retrieval call per round); the first that shows a gold wins."""
    round_ = 0
    while pending:
        asked = [(i, qs[round_]) for i, qs in pending if round_ < len(qs)]
        if not asked:
            break
        results = retriever.retrieve([query for _, query in asked], topk)
        done = set()
        for (i, query), hits in zip(asked, results):
            c, q = out[i], by_id[out[i].id]
            gold = gold_shown(passage_texts(hits), q.answers, q.question)
            if gold is not None or c.second_query is None:
                c.second_query, c.second_ids, c.second_gold = query, [str(h["id"]) for h in hits], gold
            if gold is not None:
                c.klass = "second_search"
                done.add(i)
        pending = [(i, qs) for i, qs in pending if i not in done]
        round_ += 1
    for i, _ in pending:
        out[i].klass, out[i].why = "neither", "second_search_missed"


def table(records: Sequence[Coverage], by: str = "source") -> dict[str, dict[str, int]]:
    """Counts of each class per ``by`` (``source`` or ``type``), plus ``all``."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        counts[getattr(r, by)][r.klass] += 1
        counts["all"][r.klass] += 1
    return {k: {c: v[c] for c in CLASSES} | {"questions": sum(v.values())} for k, v in counts.items()}
