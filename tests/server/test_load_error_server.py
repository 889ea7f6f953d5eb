"""`serve` of a checkpoint that cannot load: one line on stderr naming the file and the tensor, exit 1, no
traceback, and no server left half-started (the engine core in its own process, as `serve` runs it)."""
import subprocess
import sys

from support.safetensors_files import write_sharded
from support.server_fakes import free_port
from support.server_process import ROOT


def test_a_truncated_shard_stops_serve_with_one_line(tmp_path):
    files = write_sharded(tmp_path)
    path = tmp_path / files[1]
    path.write_bytes(path.read_bytes()[:-1000])
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "serve", str(tmp_path), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("jaxserve serve:")]
    assert f"{files[1]}: corrupt safetensors file: tensor model.layers." in line, line
