"""experiments/common.py's record writer, shared by every script's --json_out."""

from __future__ import annotations

import json

from experiments.common import write_record


def test_write_record_makes_the_folder_and_writes_what_json_cannot_hold_as_text(tmp_path, capsys):
    path = tmp_path / "new" / "deeper" / "rec.json"
    write_record(str(path), {"a": 1, "where": tmp_path, "set": {3}})
    assert json.loads(path.read_text()) == {"a": 1, "where": str(tmp_path), "set": "{3}"}
    assert f"wrote {path}" in capsys.readouterr().out
    write_record(str(path), {"b": 2})  # overwrites
    assert json.loads(path.read_text()) == {"b": 2}
    capsys.readouterr()
    write_record(None, {"c": 3})  # no path: nothing written, nothing said
    assert capsys.readouterr().out == ""


def test_write_record_appends_to_a_list(tmp_path):
    path = tmp_path / "runs" / "list.json"
    write_record(str(path), {"run": 1}, append=True)
    write_record(str(path), {"run": 2}, append=True)
    assert json.loads(path.read_text()) == [{"run": 1}, {"run": 2}]
