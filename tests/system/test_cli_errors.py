"""Bad input gets exit status 2 and one clear line on stderr, and never touches the named process."""
import os
import subprocess

import pytest
from conftest import one_line_error, run


def unused_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_no_such_pid():
    pid = unused_pid()
    assert f"no such process: {pid}" in one_line_error(run("diagnose", "--pid", str(pid), "--duration", "1"))


@pytest.mark.parametrize("pids", ["abc", "12,x", ",", "-5"])
def test_malformed_pid_list(pids):
    line = one_line_error(run("diagnose", f"--pid={pids}", "--duration", "1"))
    assert "process id" in line


def test_process_without_probed_libraries(tmp_path):
    saved = tmp_path / "w.msgpack"
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            line = one_line_error(run("diagnose", "--pid", str(sleeper.pid), "--duration", "1",
                                      "--save-patterns", str(saved)))
            assert "maps none of the libraries" in line
            assert sleeper.poll() is None  # untouched
            assert not saved.exists()  # nothing observed, no empty file left behind
        finally:
            sleeper.kill()


def test_unwritable_patterns_file_fails_before_attaching():
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            line = one_line_error(run("diagnose", "--pid", str(sleeper.pid), "--duration", "1",
                                      "--save-patterns", "/nonexistent/dir/w.msgpack"))
            assert "--save-patterns" in line and "/nonexistent/dir/w.msgpack" in line
        finally:
            sleeper.kill()


def test_insufficient_privilege():
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            line = one_line_error(run("diagnose", "--pid", str(sleeper.pid), "--duration", "1", user=65534))
            assert "not permitted" in line and "root" in line
        finally:
            sleeper.kill()


@pytest.mark.parametrize("args", [["agent", "--listen", "nonsense"], ["agent"], ["diagnose", "--pid", "1", "--duration", "0"],
                                  ["agent", "--pid", "1", "--deep-seconds", "0"],
                                  ["agent", "--pid", "1", "--slowdown-threshold", "-1"],
                                  ["agent", "--pid", "1", "--slowdown-threshold", "0"]])
def test_bad_agent_and_duration_arguments(args):
    one_line_error(run(*args))


@pytest.mark.parametrize("url", ["foo", "127.0.0.1:9464", "ftp://host", "http://", "http://127.0.0.1:abc", "http://host:70000"])
def test_malformed_agent_url(url):
    line = one_line_error(run("diagnose", "--pid", str(os.getpid()), "--duration", "1", "--agent", url))
    assert "--agent takes the agent's URL" in line
