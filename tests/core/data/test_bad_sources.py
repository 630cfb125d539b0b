"""Sources a new user may hand to data prepare: each row that cannot be used counted by reason
with its first example (row id and line), each file that cannot be read refused in one line; a
huge row bounded before it is tokenized."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data.conversations import Malformed, read_rows
from dflash_core.data.prepare import PrepareOptions, prepare
from dflash_core.data.shards import DataError

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


def _prepare(src, tmp_path, **kw):
    return prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False, **kw))


def _write(tmp_path, name, data: bytes):
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def test_lines_of_bytes_that_are_not_text_are_counted_not_fatal(tmp_path):
    src = _write(tmp_path, "mixed.jsonl", json.dumps(GOOD).encode() + b"\n"
                 + b"\x90\xff\x00binary\n" + json.dumps(GOOD).encode() + b"\n")
    m = _prepare(src, tmp_path)
    assert m["counts"]["samples"] == 2 and m["counts"]["dropped"] == {"not_utf8": 1}
    assert m["examples"]["not_utf8"] == ("row-1: the line is not UTF-8 text: line 2: byte 0x90 "
                                         "at column 1")


def test_a_binary_file_named_jsonl_is_refused_with_the_reason_and_first_line(tmp_path):
    src = _write(tmp_path, "garbage.jsonl", bytes(range(256)) * 40)
    with pytest.raises(DataError, match="no row could be used") as e:
        _prepare(src, tmp_path)
    assert "not_utf8: 40 (e.g. row-1: the line is not UTF-8 text: line 2: byte 0x80" in str(e.value)
    assert e.value.hint and not (tmp_path / "out").exists()


@pytest.mark.parametrize("line,reason,words", [
    (b"[1, 2]", "not_json", "a JSON list, not an object"),
    (b'"just text"', "not_json", "a JSON string"),
    (b"null", "not_json", "a JSON null"),
    (b'{"id": 1, "text": "no turns"}', "no_turns", "no 'messages'"),
    (b'{"messages": "hello"}', "no_turns", "no 'messages'"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}, '
     b'{"role": "assistant", "content": "x"}]}', "bad_turn", "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}',
     "bad_turn", "content is a list"),
    (b"{broken", "not_json", "line 2: Expecting property name"),
])
def test_rows_that_are_not_conversations_are_counted_with_an_example(tmp_path, line, reason,
                                                                     words):
    src = _write(tmp_path, "c.jsonl", json.dumps(GOOD).encode() + b"\n" + line + b"\n")
    m = _prepare(src, tmp_path)
    assert m["counts"]["samples"] == 1 and m["counts"]["dropped"] == {reason: 1}
    assert words in m["examples"][reason]


def test_an_empty_file_is_refused_as_empty(tmp_path):
    with pytest.raises(DataError, match="the source is empty"):
        _prepare(_write(tmp_path, "empty.jsonl", b"\n\n"), tmp_path)


def test_a_byte_order_mark_and_a_json_array_are_read(tmp_path):
    bom = _write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert [type(r) for r in read_rows(bom)] != [Malformed]
    arr = _write(tmp_path, "arr.json", b"\xef\xbb\xbf [\n" + json.dumps(GOOD).encode() + b",\n"
                 + json.dumps(GOOD | {"id": "two"}).encode() + b", 3\n]\n")
    rows = list(read_rows(arr))
    assert [getattr(r, "reason", "ok") for r in rows] == ["ok", "ok", "not_json"]
    with pytest.raises(DataError, match="neither JSON lines nor one JSON array"):
        list(read_rows(_write(tmp_path, "bad.json", b"[{\n")))


@pytest.mark.parametrize("setup,words", [
    (lambda d: (d / "x.parquet").write_bytes(b"not parquet at all" * 10),
     "not a readable Parquet file"),
    (lambda d: (d / "data-0.arrow").write_bytes(b"\x00" * 64), "not a readable Arrow file"),
    (lambda d: (d / "state.json").write_text("{"), "unreadable state.json"),
    (lambda d: (d / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}'),
     "lists data files that are not there"),
    (lambda d: (d / "state.json").write_text('{"x": 1}'), "does not list its data files"),
    (lambda d: (d / "dataset_dict.json").write_text("[]"), "none is 'train'"),
    (lambda d: (d / "dataset_dict.json").write_bytes(b"\xff"), "unreadable dataset_dict.json"),
    (lambda d: (d / "dflash_data.json").write_text("{}"), "a prepared data folder"),
    (lambda d: (d / "notes.txt").write_text("x"), "no .jsonl, .parquet or .arrow files"),
])
def test_a_source_folder_that_cannot_be_read_is_one_error_with_a_hint(tmp_path, setup, words):
    src = tmp_path / "src"
    src.mkdir()
    setup(src)
    with pytest.raises(DataError, match=words) as e:
        _prepare(src, tmp_path)
    assert e.value.hint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written


def test_a_folder_of_parquet_parts_with_a_bad_part_is_refused(tmp_path):
    src = tmp_path / "parts"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist([GOOD]), src / "part-00000.parquet")
    (src / "part-00001.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(DataError, match="part-00001.parquet: not a readable Parquet"):
        _prepare(src, tmp_path)


def test_a_huge_row_is_counted_without_being_tokenized(tmp_path, monkeypatch):
    from dflash_core.data.chat_render import ChatRenderer

    huge = {"id": "huge", "messages": [{"role": "user", "content": "x" * 200_000},
                                       {"role": "assistant", "content": "y"}]}
    src = _write(tmp_path, "c.jsonl", (json.dumps(huge) + "\n" + json.dumps(GOOD) + "\n")
                 .encode())
    rendered = []
    real = ChatRenderer.render
    monkeypatch.setattr(ChatRenderer, "render",
                        lambda self, conv, stats=None: (rendered.append(conv.id),
                                                        real(self, conv, stats))[1])
    m = _prepare(src, tmp_path, max_length=64)
    assert m["counts"]["dropped"] == {"too_long_chars": 1} and m["counts"]["samples"] == 1
    assert m["examples"]["too_long_chars"].startswith("huge: 200001 characters > ")
    assert rendered == ["row-1"]  # the huge one never reached the tokenizer
    # a row under the character bound but over the token bound is still measured in tokens
    near = {"id": "near", "messages": [{"role": "user", "content": "x" * 100},
                                       {"role": "assistant", "content": "y"}]}
    src.write_text(json.dumps(near) + "\n" + json.dumps(GOOD) + "\n")
    m = _prepare(src, tmp_path, max_length=64, overwrite=True)
    assert m["counts"]["dropped"] == {"too_long": 1}


def test_a_tokenizer_error_on_one_row_is_counted_for_that_row(tmp_path, monkeypatch):
    from dflash_core.data.chat_render import ChatRenderer

    real = ChatRenderer.encode

    def picky(self, text):
        if "poison" in text:
            raise TypeError("TextEncodeInput must be Union[...]")
        return real(self, text)

    monkeypatch.setattr(ChatRenderer, "encode", picky)
    bad = {"id": "p", "messages": [{"role": "user", "content": "poison"},
                                   {"role": "assistant", "content": "x"}]}
    src = _write(tmp_path, "c.jsonl", (json.dumps(bad) + "\n" + json.dumps(GOOD) + "\n")
                 .encode())
    m = _prepare(src, tmp_path)
    assert m["counts"]["dropped"] == {"render_error": 1}
    assert m["examples"]["render_error"].startswith("p: TypeError")


def test_numbers_given_to_the_function_are_checked(tmp_path):
    src = _write(tmp_path, "c.jsonl", json.dumps(GOOD).encode() + b"\n")
    with pytest.raises(DataError, match="max_length must be >= 0.*samples_per_shard must be >= 1"):
        prepare(PrepareOptions(src, tmp_path / "out", samples_per_shard=0, max_length=-1))
    assert not (tmp_path / "out").exists()
