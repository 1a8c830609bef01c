"""experiments/lib/common.py's record writer, shared by every script's --json_out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.lib.common import out_path_problem, write_record


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
    for name, text in (("object.json", '{"a": 1, "b": 2}'), ("broken.json", "[{"), ("empty.json", "")):
        (tmp_path / name).write_text(text)  # not a list of records: an error, the file left as it was
        assert "cannot be appended to" in out_path_problem(str(tmp_path / name), append=True)
        with pytest.raises(ValueError, match="cannot be appended to"):
            write_record(str(tmp_path / name), {"run": 3}, append=True)
        assert (tmp_path / name).read_text() == text
    assert out_path_problem(str(path), append=True) is None
    assert out_path_problem(str(tmp_path / "object.json")) is None  # overwritten, not appended to: fine


def test_write_record_writes_numpy_values_as_numbers(tmp_path):
    path = tmp_path / "rec.json"
    write_record(str(path), {"f": np.float32(0.5), "i": np.int64(3), "a": np.arange(3), "b": np.bool_(True)})
    assert json.loads(path.read_text()) == {"f": 0.5, "i": 3, "a": [0, 1, 2], "b": True}


def test_out_path_problem_says_why_a_path_cannot_be_written(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert out_path_problem(str(tmp_path / "new" / "deeper" / "rec.json")) is None  # folders made at the end
    assert out_path_problem(str(tmp_path / "rec.json")) is None
    assert "is a folder" in out_path_problem(str(tmp_path))
    assert "is a folder" in out_path_problem(str(tmp_path / "not_yet") + "/")  # a trailing slash names a folder
    assert "a_file is a file, not a folder" in out_path_problem(str(tmp_path / "a_file" / "rec.json"))
    assert out_path_problem(str(tmp_path / "draft"), folder=True) is None
    assert out_path_problem(str(tmp_path), folder=True) is None  # an existing folder is written into
    assert "is a file: give a folder path" in out_path_problem(str(tmp_path / "a_file"), folder=True)
    assert not (tmp_path / "new").exists() and not (tmp_path / "draft").exists()  # nothing made


def test_a_script_rejects_a_bad_json_out_before_it_starts(tmp_path):
    """The check runs when absl parses the flags (`check_out_flag`), not after the run."""
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "experiments.bench_decode", "--model=tiny", f"--json_out={tmp_path}"],
                       capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode != 0 and f"{tmp_path} is a folder" in p.stderr, p.stderr[-2000:]
    assert "tok/s" not in p.stdout  # nothing was measured


def test_an_unknown_model_and_workload_are_named_errors():
    """`engine_flags.load_model` (every script's --model): a model that does not load is a usage error naming the
    flag (it had been a traceback in each script); `workload` refuses a name it does not know (it had run "chat")."""
    from absl import app, flags
    from absl.testing import flagsaver

    from experiments import generate  # noqa: F401 (defines the shared flags, --model among them)
    from experiments.lib import engine_flags
    from experiments.lib.common import workload

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["script", "--model=/nonexistent/model_dir"])
        with pytest.raises(app.UsageError, match="--model /nonexistent/model_dir: model source"):
            engine_flags.load_model()
    with pytest.raises(ValueError, match="unknown workload 'bogus'; one of copy, chat"):
        workload("bogus", 2, 0)
    assert len(workload("copy", 2, 0)) == 2
