"""Helpers the test folders share, imported as ``support.<module>`` (pytest puts tests/ on the path; a test run
as a script in a subprocess gets it through PYTHONPATH, see ``fake_devices``)."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)                   # the repository
FIXTURES = os.path.join(TESTS, "fixtures")      # checkpoints and goldens the make_*_fixtures.py scripts write
# the tests' persistent XLA cache: none unless $JAXSERVE_TEST_XLA_CACHE names a folder (runner/compile_cache.py),
# and the servers' flag for it
XLA_CACHE_DIR = os.environ.get("JAXSERVE_TEST_XLA_CACHE") or None
XLA_CACHE_FLAGS = ("--compilation-cache-dir", XLA_CACHE_DIR) if XLA_CACHE_DIR else ()
# XLA:CPU's backend at optimization level 1: the default level's compile time outweighs what it saves in
# running the tests' small programs, level 0's slower programs outweigh what it saves in compiling (measured in
# the make-test results); every test process, subprocesses included, runs with it
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"


def xla_flags(*flags: str | None) -> str:
    """XLA_FLAGS for a test process: ``TEST_XLA_FLAGS`` and then ``flags`` (a later flag overrides an earlier)."""
    return " ".join(filter(None, (TEST_XLA_FLAGS, *flags)))
