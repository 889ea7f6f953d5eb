"""The model on its devices, built from an ``EngineConfig``: what every process of an engine builds alike.

``ModelExecutor(config)`` starts the ``mp`` executor's workers, or the ``ray`` executor's, when the config asks
for them (before anything starts a JAX backend), turns on the compile cache, builds the tensor-parallel mesh (or
the pipeline stages' meshes, each weight loading onto its own stage's) and loads the model;
``build_runner`` builds the decoder's ``ModelRunner`` (its KV cache sized) and ``warm_up`` compiles its steps.
On process 0 of a
multi-process engine the runner sends each step to the other processes before it launches it
(``BroadcastingRunner``); the other processes build the same executor and follow those steps
(``jaxserve.executor.worker``, ``follow_runner``). The engine core on process 0 adds the scheduler on top.
"""
from __future__ import annotations

import logging
import time

import jax

from jaxserve.config import EngineConfig
from jaxserve.executor import launcher
from jaxserve.utils import startup_timeline

logger = logging.getLogger(__name__)


def make_tp_mesh(config: EngineConfig):
    """The tensor-parallel mesh (None for one device) and whether the CUDA one-shot all-reduce is on. Every
    process runs this before the first trace: the row-parallel layers pick their all-reduce at trace time."""
    tp = config.parallel.tensor_parallel_size
    if tp <= 1:
        return None, False
    from jaxserve.parallel import collectives, enable_custom_all_reduce, make_mesh
    mesh = make_mesh(tp)
    why_not = enable_custom_all_reduce(mesh, disable=config.parallel.disable_custom_all_reduce)
    fused = " (fused with the residual add and RMSNorm)" if collectives.fuses_norm() else ""
    logger.info("tensor parallelism %d: %s", tp, f"CUDA one-shot all-reduce for steps up to 1 MiB{fused}"
                if why_not is None else f"XLA's all-reduce ({why_not})")
    return mesh, why_not is None


def make_stages(config: EngineConfig):
    """The pipeline stages' meshes (``parallel.pipeline``; None for one stage). Each stage's tensor-parallel
    all-reduce is XLA's (the CUDA one-shot all-reduce is set up for one mesh)."""
    pp = config.parallel.pipeline_parallel_size
    if pp <= 1:
        return None
    from jaxserve.parallel.pipeline import make_stage_meshes
    stages = make_stage_meshes(pp, config.parallel.tensor_parallel_size)
    logger.info("pipeline parallelism %d × tensor parallelism %d over %d devices", pp,
                config.parallel.tensor_parallel_size, pp * config.parallel.tensor_parallel_size)
    return stages


def tree_nbytes(tree) -> int:
    return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(tree))


class ModelExecutor:
    """The loaded model, its mesh and (after ``build_runner``) its runner; ``config`` is resolved for the
    backend. ``workers``: the ``mp`` executor's worker processes that process 0 started, or None."""

    def __init__(self, config: EngineConfig):
        from jaxserve.models import load_model
        from jaxserve.quantization import describe_bytes
        from jaxserve.runner import compile_cache

        # --distributed-executor-backend mp: spawn the per-device workers and join jax.distributed before
        # anything below starts a JAX backend
        self.workers = launcher.maybe_start(config)
        compile_cache.enable(config.compilation_cache_dir)
        t0 = time.perf_counter()
        with startup_timeline.phase("device init"):
            config = self.config = config.resolved(jax.default_backend())
            self.multi_process = jax.process_count() > 1
            self.stages = make_stages(config)
            self.mesh, self.custom_all_reduce = make_tp_mesh(config) if self.stages is None else (None, False)
        # with pipeline stages each weight loads onto its own stage's mesh (``parallel.pipeline.placing``)
        from jaxserve.parallel.pipeline import placing
        load_mesh = self.mesh if self.stages is None else self.stages.meshes[0]
        with startup_timeline.phase("weights") as weights:
            with placing(self.stages):
                self.model = load_model(config.model, dtype=config.dtype, load_format=config.load_format,
                                        max_model_len=config.max_model_len, mesh=load_mesh,
                                        quantization=config.quantization,
                                        enable_expert_parallel=config.parallel.enable_expert_parallel,
                                        hf_overrides=config.hf_overrides)
            # the weights' seconds are the device's too: wait for the last fill or copy (warm-up would)
            weights.nbytes = tree_nbytes(jax.block_until_ready(self.model.params))
            weights.note = "by storage: " + describe_bytes(self.model.params)
        self.load_seconds = time.perf_counter() - t0
        if config.tokenizer:                # --tokenizer: another HF tokenizer folder for this model
            from transformers import AutoTokenizer
            with startup_timeline.phase("config/tokenizer"):
                self.model.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.runner = None

    def build_runner(self):
        """The decoder's runner, its KV cache sized (not warmed up yet: ``warm_up``); the model's max_model_len
        becomes the runner's (lower where a model default does not fit the cache). On process 0 of a
        multi-process engine it comes wrapped in a ``BroadcastingRunner``."""
        from jaxserve.runner.model_runner import ModelRunner
        with startup_timeline.phase("KV cache") as kv:
            runner = ModelRunner(self.model, self.config, self.model.max_model_len, mesh=self.mesh,
                                 stages=self.stages)
            kv.nbytes = tree_nbytes(jax.block_until_ready(runner.kv_caches))
        self.model.max_model_len = runner.max_model_len
        if self.multi_process and jax.process_index() == 0:
            # the other processes run follow_runner: each step is sent to them before it launches
            from jaxserve.executor.distributed import BroadcastingRunner
            channel = self.workers.step_channel() if self.workers is not None else None
            runner = BroadcastingRunner(runner, channel)
            if self.workers is not None:
                self.workers.set_release(runner.stop)
        self.runner = runner
        return runner

    def warm_up(self, *, progress: bool = True) -> None:
        """Compile the runner's planned steps (every process alike, in the same order), unless skip_warmup."""
        if not self.config.skip_warmup:
            with startup_timeline.phase("warm-up"):
                self.runner.warmup(progress=progress)
