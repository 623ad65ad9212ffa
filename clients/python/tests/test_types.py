"""The package is typed: mypy --strict finds nothing in it (Debian's python3-mypy, which scripts/test-deps installs)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TypesTest(unittest.TestCase):
    def test_mypy_strict_finds_nothing(self) -> None:
        # Celery ships no types; its stubs are not the package's to check.
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports", "--cache-dir", cache, "stopgate"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)


if __name__ == "__main__":
    unittest.main()
