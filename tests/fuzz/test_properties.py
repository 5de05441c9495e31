"""Property tests for the two readers of user files: the corpus reader and the config loader.

Whatever the bytes, ``retriever.corpus.iter_corpus`` yields passages or raises ``CorpusError`` (never a
raw ``UnicodeDecodeError``, ``EOFError`` or ``RecursionError``), and ``emapg.config.load_config`` returns
a config or raises ``ConfigError``. Derandomized with fixed example counts, so CI sends the same inputs.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import retriever.corpus as corpus  # noqa: E402
from emapg.config import ConfigError, describe, load_config  # noqa: E402
from emapg.paths import CONFIG_DIR  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402

SETTINGS = settings(max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
rows = st.fixed_dictionaries({}, optional={"id": json_values, "contents": json_values, "title": json_values, "text": json_values})
tricky_lines = st.sampled_from([
    b'{"id": "a", "contents": "\\"T\\"\\ntext"}', b'{"id": "a", "contents": "\\ud800"}', b'{"id": "\\udc00", "text": "x"}',
    b"[" * 5000, b'{"a":' * 3000, b'{"contents": 1e999}', b'{"contents": NaN}', b"\xff\xfe\x00", b"\xc0\xaf", b"\x00" * 8,
    '{"id": "é", "contents": "北京"}'.encode(), b'{"id": 1' + b"0" * 5000 + b', "text": "x"}', b"  ", b"\r",
])  # fmt: skip
lines = st.one_of(rows.map(lambda r: json.dumps(r).encode()), json_values.map(lambda v: json.dumps(v).encode()), tricky_lines,
                  st.binary(max_size=40))  # fmt: skip


@SETTINGS
@given(body=st.lists(lines, max_size=6), gz=st.booleans(), cut=st.integers(0, 40))
@example(body=[b'{"id": "a", "contents": "x"}', b"\xff\xfe"], gz=False, cut=0)  # not UTF-8
@example(body=[b'{"id": "a", "contents": "x"}'] * 40, gz=True, cut=20)  # a truncated .gz download
@example(body=[b"[" * 5000 + b"]" * 5000], gz=False, cut=0)  # nested beyond the parser
@example(body=[b'{"id": "a", "contents": "x", "n": ' + b"1" * 5001 + b"}"], gz=False, cut=0)  # found by this test: int > 4300 digits
def test_the_corpus_reader_gives_passages_or_a_corpus_error(body, gz, cut):
    data = b"\n".join(body) + b"\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("c.jsonl.gz" if gz else "c.jsonl")
        if gz:
            packed = gzip.compress(data)
            data = packed[: max(1, len(packed) - cut)] if cut else packed  # a truncated download
        path.write_bytes(data)
        try:
            passages = list(corpus.iter_corpus(path))
        except corpus.CorpusError as e:
            assert str(e)
            return
    for p in passages:
        assert isinstance(p, corpus.Passage) and isinstance(p.id, str) and isinstance(p.contents, str)


PRESET = yaml.safe_load((CONFIG_DIR / "search_tiny_cpu.yaml").read_text())
KEYS = [row[0] for row in describe(TrainConfig)]
yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
raw_values = st.sampled_from(["nan", ".inf", "-.inf", "1e999", "[1, 2]", "{a: 1}", "", "~", "null", "yes", "off", "0x10",
                              "!!python/object/apply:os.system ['true']", "*undefined", "&a [*a]", "[" * 600, "[" * 600 + "]" * 600,
                              "{a: " * 600 + "1" + "}" * 600, "'", "1_000",
                              "2001-01-01", "!!binary aGk=", "é\ud800"])  # fmt: skip
overrides = st.tuples(st.sampled_from(KEYS) | st.text(max_size=12), raw_values | st.text(max_size=12)).map(lambda kv: f"{kv[0]}={kv[1]}")


def _mutated(preset: dict, changes: list[tuple[str, object]]) -> dict:
    data = json.loads(json.dumps(preset))
    for key, value in changes:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[leaf] = value
    return data


@SETTINGS
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=10), yaml_values), max_size=4),
       raw=st.one_of(st.none(), st.text(max_size=80), raw_values.map(lambda v: f"run: {v}")), extra=st.lists(overrides, max_size=3))  # fmt: skip
@example(changes=[], raw="run: " + "[" * 600 + "]" * 600, extra=[])  # found by this test: RecursionError
@example(changes=[], raw=None, extra=["run.name=" + "{a: " * 600 + "1" + "}" * 600])  # the same in an override
@example(changes=[], raw="run: \udcff", extra=[])  # found by this test: a non-UTF-8 file raised UnicodeDecodeError
def test_the_config_loader_gives_a_config_or_a_config_error(changes, raw, extra):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        if raw is None:
            path.write_text(yaml.safe_dump(_mutated(PRESET, changes), allow_unicode=True), encoding="utf-8", errors="surrogatepass")
        else:
            path.write_bytes(raw.encode("utf-8", "surrogatepass"))
        try:
            cfg = load_config(TrainConfig, path, extra)
        except ConfigError as e:
            assert str(e)
            return
    assert isinstance(cfg, TrainConfig)
