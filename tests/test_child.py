"""`python -m kvtier...` children import the installed kvtier even when started from a
directory that holds a `kvtier/` folder (which `-m` puts first on sys.path): -P on Python
>= 3.11, a working directory of the child's own on 3.10 (kvtier.child.python_module)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.child import SAFE_PATH, ChildDaemon, python_module

SHADOW = 'raise ImportError("the kvtier/ folder in the working directory was imported")\n'


@pytest.fixture
def shadowing_dir(tmp_path: Path) -> Path:
    """A directory holding a `kvtier/` package whose import fails."""
    (tmp_path / "kvtier").mkdir()
    (tmp_path / "kvtier" / "__init__.py").write_text(SHADOW)
    return tmp_path


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def test_python_module_argv():
    assert python_module("kvtier", "serve", "--socket", "/s", safe_path=True) == [
        sys.executable, "-P", "-m", "kvtier", "serve", "--socket", "/s"]
    assert python_module("kvtier.mechanism.keeper", "/k", "60", safe_path=False) == [
        sys.executable, "-m", "kvtier.mechanism.keeper", "/k", "60"]
    assert SAFE_PATH == (sys.version_info >= (3, 11))
    assert python_module("kvtier")[1:2] == (["-P"] if SAFE_PATH else ["-m"])


def test_the_folder_shadows_a_plain_python_m(shadowing_dir):
    """What the fix is for: without -P, `python -m kvtier` in that directory imports the folder."""
    done = subprocess.run([sys.executable, "-m", "kvtier", "--version"], cwd=shadowing_dir, capture_output=True,
                          text=True, timeout=60, env=_env())
    assert done.returncode != 0 and "the kvtier/ folder in the working directory was imported" in done.stderr


@pytest.mark.skipif(not SAFE_PATH, reason="-P is Python >= 3.11")
def test_python_module_imports_the_installed_kvtier(shadowing_dir):
    done = subprocess.run(python_module("kvtier", "--version"), cwd=shadowing_dir, capture_output=True, text=True,
                          timeout=60, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["kvtier", "0.1.0"]


def _kvtier_command() -> list[str]:
    """The `kvtier` console script (it does not put the working directory on sys.path)."""
    script = Path(sys.executable).parent / "kvtier"
    found = str(script) if script.exists() else shutil.which("kvtier")
    if found:
        return [found]
    if SAFE_PATH:
        return [sys.executable, "-P", "-m", "kvtier"]
    pytest.skip("no kvtier console script, and no -P on this Python")


def test_demo_from_a_directory_holding_a_kvtier_folder(shadowing_dir):
    done = subprocess.run([*_kvtier_command(), "demo"], cwd=shadowing_dir, capture_output=True, text=True,
                          timeout=120, env=_env())
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "bytes equal to what was written: yes" in done.stdout and "exit code 0" in done.stdout


@pytest.mark.parametrize("safe_path", [True, False], ids=["with -P", "the 3.10 way: own cwd only"])
def test_child_daemon_from_a_directory_holding_a_kvtier_folder(shadowing_dir, monkeypatch, safe_path):
    """The child (and the arena keeper it starts) serve from such a directory, with -P or, as on
    Python 3.10, only in a working directory of its own; relative paths still mean the caller's."""
    if safe_path and not SAFE_PATH:
        pytest.skip("-P is Python >= 3.11")
    monkeypatch.chdir(shadowing_dir)
    Path("work").mkdir()
    daemon = ChildDaemon("work", host_size="1Mi", disk_size="4Mi", arena_prefix=f"kvtier-child-test-{uuid.uuid4().hex[:8]}",
                         safe_path=safe_path)
    try:
        assert ("-P" in daemon.proc.args) == safe_path
        daemon.wait_serving(30.0)
        assert daemon.workdir == shadowing_dir / "work" and (shadowing_dir / "work" / "cache").is_dir()
    finally:
        code = daemon.stop(30.0)
    assert code == 0, daemon.log_tail()
