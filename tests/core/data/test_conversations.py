"""Reading conversations: the three source layouts, role normalisation, malformed rows by reason."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, normalise, read_rows, source_files,
)
from dflash_core.data.shards import DataError

ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello"}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
]


def test_openai_and_sharegpt_rows_normalise_alike():
    a, b = normalise(ROWS[0], 0), normalise(ROWS[1], 1)
    assert a.id == "a" and b.id == "row-1"
    assert [m["role"] for m in b.messages] == ["user", "assistant"]
    assert b.messages[1]["content"] == "Yo"


@pytest.mark.parametrize("row, reason", [
    ({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}, "missing_role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
     "empty_assistant"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant"),
    ({"text": "no turns"}, "no_turns"),
    ({"messages": [{"role": "user", "content": ["parts"]}]}, "bad_turn"),
])
def test_malformed_rows_name_their_reason(row, reason):
    with pytest.raises(RowError) as e:
        normalise(row, 0)
    assert e.value.reason == reason


def test_jsonl_parquet_and_save_to_disk_read_the_same(tmp_path):
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\nnot json\n"
                  + json.dumps(ROWS[0]) + "\n")
    got = list(read_rows(jl))
    assert [type(r) for r in got] == [Conversation, Conversation, Malformed, Malformed]
    assert (got[2].reason, got[3].reason) == ("not_json", "duplicate_id")

    table = pa.Table.from_pylist([ROWS[0]])
    pq.write_table(table, tmp_path / "c.parquet")
    folder = tmp_path / "saved"
    folder.mkdir()
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    for src in (tmp_path / "c.parquet", folder):
        [c] = list(read_rows(src))
        assert c.messages == got[0].messages and c.id == "a"
    assert source_files(folder)[0] == "arrow"


def test_a_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        source_files(tmp_path / "nope.jsonl")
