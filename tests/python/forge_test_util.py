"""Shared helpers for the Python reference tests: where the forge binaries are, a scratch
directory per test, and the relative-error measure the tests use."""
import os
import subprocess
import tempfile


def tool(name):
    return os.path.join(os.environ["FORGE_TOOLS_DIR"], name)


def forge_bin():
    return os.environ["FORGE_BIN"]


def source_dir():
    return os.environ["FORGE_SOURCE_DIR"]


def run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def scratch_dir():
    return tempfile.mkdtemp(prefix="forge-test-")


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (0 when both are 0)."""
    scale = float(abs(expected).max())
    diff = float(abs(actual - expected).max())
    return diff / scale if scale > 0 else diff
