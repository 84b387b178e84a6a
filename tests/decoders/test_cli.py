"""decoders.cli: output paths refused before work starts, and records kept when a later write fails."""

import json

import pytest

from decoders.base import UsageError
from decoders.cli import JsonlSink, check_figure_file, check_output_dir, check_output_file, check_records_file


def test_output_file_folder_is_made_and_bad_paths_are_refused(tmp_path):
    assert check_output_file(tmp_path / "new" / "deeper" / "r.jsonl", "--out").parent.is_dir()
    (tmp_path / "f").write_text("x")
    for path, message in [(tmp_path, "is a folder"), (tmp_path / "f" / "r.jsonl", "is a file, not a folder")]:
        with pytest.raises(UsageError, match=message):
            check_output_file(path, "--out")
    with pytest.raises(UsageError, match="a figure must end in"):
        check_figure_file(tmp_path / "plot.jpg", "--plot")


def test_a_records_file_must_be_new_empty_or_json_lines(tmp_path):
    assert check_records_file(tmp_path / "new.jsonl", "--out") == tmp_path / "new.jsonl"
    (tmp_path / "empty.jsonl").write_text("")
    check_records_file(tmp_path / "empty.jsonl", "--out")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"a": 1}) + "\n" + json.dumps({"b": 2}) + "\n\n")
    check_records_file(good, "--out")
    for name, data in [("prose.txt", b"a report\nof some kind\n"), ("list.jsonl", json.dumps({"a": 1}).encode() + b"\n[1, 2]\n"),
                       ("binary.bin", b"\xff\xfe\x00\x01")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UsageError, match="not a JSON lines file"):
            check_records_file(tmp_path / name, "--out")


def test_output_dir_is_checked_without_being_made(tmp_path):
    assert not check_output_dir(tmp_path / "a" / "b", "--out").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        check_output_dir(tmp_path / "f" / "b", "--out")


def test_a_write_that_fails_later_moves_to_a_fallback_file(tmp_path, capsys):
    folder = tmp_path / "out"
    sink = JsonlSink(folder / "r.jsonl")
    sink.append({"n": 1})
    # The folder is replaced by a file mid-sweep: the next append cannot go there.
    (folder / "r.jsonl").unlink()
    folder.rmdir()
    folder.write_text("in the way")
    sink.append({"n": 2})
    sink.append({"n": 3})
    assert sink.fallback is not None and str(sink.fallback) in sink.where
    assert [json.loads(line)["n"] for line in sink.fallback.read_text().splitlines()] == [2, 3]
    err = capsys.readouterr().err
    assert err.count("warning: cannot write") == 1 and str(sink.fallback) in err
    sink.fallback.unlink()
