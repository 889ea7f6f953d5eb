"""Helpers the test folders share, imported as ``support.<module>`` (pytest puts tests/ on the path; a test run
as a script in a subprocess gets it through PYTHONPATH, see ``fake_devices``)."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)                   # the repository
FIXTURES = os.path.join(TESTS, "fixtures")      # checkpoints and goldens the make_*_fixtures.py scripts write
# the servers' --compilation-cache-dir: none unless $JAXSERVE_TEST_XLA_CACHE names one (runner/compile_cache.py)
XLA_CACHE_FLAGS = (("--compilation-cache-dir", os.environ["JAXSERVE_TEST_XLA_CACHE"])
                   if os.environ.get("JAXSERVE_TEST_XLA_CACHE") else ())
