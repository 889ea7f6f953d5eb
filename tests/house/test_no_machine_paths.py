"""The repository holds no absolute paths of a machine it was written on (a developer's checkout, a device host's
home): commands and docs name paths relative to the repository root, or placeholders."""
import re
import subprocess

import support

# the development machine's and the device host's folders as written in a command or a docstring (a container's
# own paths, /tmp, /usr ... are fine)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root)/[\w.-]")


def test_no_absolute_paths_of_a_machine():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=support.ROOT, capture_output=True, check=True,
                           text=True).stdout.split("\0")
    hits = []
    for name in filter(None, files):
        try:
            with open(f"{support.ROOT}/{name}", encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        hits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in MACHINE_PATH.finditer(text)]
    assert not hits, "absolute paths of a machine (name them relative to the repository root):\n" + "\n".join(hits[:20])
