"""The commit a benchmark's JSON names, and whether the tree differs from it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from flashcodec._provenance import source_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_a_clean_tree_names_its_commit_and_a_changed_one_says_so(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    assert source_commit(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("not a tracked file\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == f"{head} + changes"


def test_outside_a_checkout_there_is_no_commit(tmp_path, monkeypatch):
    assert source_commit(tmp_path / "nowhere") is None  # no folder: git cannot even start there
    (tmp_path / "ceiling").mkdir()
    # a folder git finds no repository for (GIT_CEILING_DIRECTORIES: not even one above pytest's tmp folder)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert source_commit(tmp_path / "ceiling") is None
