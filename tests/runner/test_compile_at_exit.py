"""A background compile still tracing when the interpreter exits finishes as it would have otherwise.

At exit ``weakref.finalize`` runs every live finalizer, and JAX's tracer keeps each constant of a trace in
progress alive through one (a cond branch's closed-over values among them): a trace still running on a daemon
thread then lost its constants and lowered to a broken program (``KeyError`` on a jaxpr ``Var``, a shape error),
logged as a failed compile. The compile threads finish their compile before exit instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# traces a cond whose branch closes over a value of the outer trace (a constant of the branch's trace) and is
# still in that branch when the main thread returns
SCRIPT = textwrap.dedent("""
    import logging, threading, time
    import jax, jax.numpy as jnp
    from jaxserve.runner.step_compiler import StepCompiler

    logging.basicConfig(level=logging.WARNING)
    in_branch = threading.Event()

    def step(x):
        y = x * 2.0
        def branch(z):
            out = z + y
            in_branch.set()
            time.sleep(1.0)          # the interpreter starts exiting here
            return out * y
        return jax.lax.cond(x[0] > 0, branch, lambda z: z - y, x)

    class Lowered:                   # says when its compile is done
        def __init__(self, n):
            self.n, self.lowered = n, jax.jit(step).lower(jax.ShapeDtypeStruct((n,), jnp.float32))

        def compile(self):
            exe = self.lowered.compile()
            print("compiled", self.n, flush=True)
            return exe

    StepCompiler(Lowered, workers=1).submit([8, 16])
    in_branch.wait()
    print("main thread returns", flush=True)
""")


def test_a_compile_in_flight_at_exit_is_not_broken_by_exit():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr, r.stderr
    # the compile in flight finished; the queued one was never started
    assert r.stdout.split() == ["main", "thread", "returns", "compiled", "8"], r.stdout
