"""What a process imports at start-up (jaxserve/utils/startup_imports.py): the tokenizer library imported ahead on
a thread (its phase logged as overlapped), and torch hidden from the processes that run JAX alone. Each check
runs in a fresh interpreter: the test process has imported transformers already."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str, *, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, ROOT) if p))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def fake_torch(folder) -> str:
    """A ``torch`` package that fails when imported, with a version transformers accepts."""
    pkg = folder / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "2.9.0"\nraise RuntimeError("the fake torch was imported")\n')
    return str(folder)


def test_the_tokenizer_library_imports_ahead_and_a_waiter_finds_it_whole():
    done = run("""
        import logging, sys
        logging.basicConfig(level=logging.INFO)
        from jaxserve.utils import startup_imports
        startup_imports.start_tokenizer_imports()
        startup_imports.start_tokenizer_imports()          # a second start starts nothing
        startup_imports.wait_tokenizer_imports()
        from transformers import PreTrainedTokenizerFast
        threads = [t.name for t in __import__("threading").enumerate() if t.name == "tokenizer-imports"]
        print("ok", threads)
    """)
    assert done.returncode == 0, done.stderr
    assert "ok []" in done.stdout
    lines = [ln for ln in done.stderr.splitlines() if "start-up tokenizer imports:" in ln]
    assert len(lines) == 1 and lines[0].endswith("(overlapped)"), done.stderr


def test_a_process_that_hides_torch_builds_its_tokenizer_without_importing_it(tmp_path):
    folder = fake_torch(tmp_path)
    plain = run("import transformers; transformers.PreTrainedTokenizerFast", pythonpath=folder)
    assert "the fake torch was imported" in plain.stderr           # what transformers does where torch is
    hidden = run("""
        import sys
        from jaxserve.utils.startup_imports import hide_torch
        hide_torch()
        from jaxserve.models.tokenizers import embedded_tokenizer
        from transformers.utils import is_torch_available
        assert embedded_tokenizer().encode("hello") and not is_torch_available() and sys.modules["torch"] is None
    """, pythonpath=folder)
    assert hidden.returncode == 0, hidden.stderr
    assert "PyTorch was not found" not in hidden.stderr
