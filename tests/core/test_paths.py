"""Output paths: why nothing could be written there, found before any work."""
import os
from pathlib import Path

import pytest

from mpishard.core.paths import inside, why_unwritable


def test_writable_paths_pass_and_leave_nothing_behind(tmp_path):
    assert why_unwritable(tmp_path / "new" / "deeper" / "ck", folder=True) is None
    (tmp_path / "m.jsonl").write_text("kept\n")
    assert why_unwritable(tmp_path / "m.jsonl", folder=False) is None
    assert (tmp_path / "m.jsonl").read_text() == "kept\n"       # opened, not changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]   # no scratch file


def test_a_device_is_not_probed_in_its_folder(monkeypatch):
    """``--metrics /dev/null`` was refused for anyone who cannot make files in /dev."""
    from mpishard.core import paths

    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(paths.tempfile, "TemporaryFile", refused)    # not root
    assert why_unwritable(os.devnull, folder=False) is None
    assert "writing in /dev fails (Permission denied)" in why_unwritable("/dev/new.jsonl",
                                                                          folder=False)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_folder_that_takes_no_new_entries_is_named():
    assert why_unwritable("/proc/mpishard-ck", folder=True) == (
        "cannot be written: writing in /proc fails (No such file or directory); pass a "
        "path you can write to")


def test_inside(tmp_path):
    assert inside(tmp_path / "a" / "b", tmp_path / "a") and inside(tmp_path, tmp_path)
    assert not inside(tmp_path / "ab", tmp_path / "a")
