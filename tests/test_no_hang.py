"""No test can stall the suite: pytest-timeout bounds every test, fixtures included.

The load tests step engines with a step limit of their own (``helpers``); this is the bound on the
rest: a wait that never returns fails its test after ``timeout`` seconds instead of holding CI.
"""

import subprocess
import sys
import textwrap
import time


def test_every_test_has_a_timeout(pytestconfig):
    timeout = float(pytestconfig.getini("timeout") or 0)
    assert 0 < timeout <= 600, f"pytest-timeout's timeout is {timeout!r}: set it in pyproject.toml"


def test_a_hanging_test_fails_within_its_timeout(tmp_path):
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent("""
        import threading

        def test_waits_forever():
            threading.Event().wait()
    """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "timeout=2", str(tmp_path / "test_hangs.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Timeout" in proc.stdout, proc.stdout
    assert elapsed < 60
