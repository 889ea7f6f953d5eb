"""What the runner counts: steps, host and device time, tokens per step, and a mixture-of-experts model's
expert load (vLLM's EPLB balancedness)."""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np

# vLLM's iteration_tokens_total histogram bounds: the tokens one step computes
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclasses.dataclass(slots=True)
class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, summed over steps (``tokens [L_moe, E]``), and per
    step and layer the busiest expert's count and the mean count, summed: over a window, their ratio
    mean / max is vLLM's EPLB "balancedness" (1 when every expert gets the same tokens). The counts come from
    the step's forward itself, copied to the host beside its sampled tokens."""
    tokens: np.ndarray
    max_sum: float = 0.0
    mean_sum: float = 0.0

    def add(self, counts: np.ndarray) -> None:
        """One step's ``[L_moe, E]`` counts (a multi-step dispatch: ``[steps, L_moe, E]``)."""
        self.tokens += counts if counts.ndim == 2 else counts.sum(axis=0)
        self.max_sum += float(counts.max(axis=-1).sum())
        self.mean_sum += float(counts.sum()) / counts.shape[-1]

    def snapshot(self) -> dict:
        return {"moe_layers": self.tokens.shape[0], "moe_expert_tokens_total": self.tokens.sum(axis=0).tolist(),
                "moe_max_expert_tokens_total": self.max_sum, "moe_mean_expert_tokens_total": self.mean_sum,
                "moe_expert_balancedness": self.mean_sum / self.max_sum if self.max_sum else 1.0}


@dataclasses.dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    host_ms: float = 0.0        # building inputs + dispatch, summed
    device_ms: float = 0.0      # waiting for the step's results, summed
    tokens: int = 0
    padded_tokens: int = 0      # token rows the dispatched forwards computed (their buckets), padding included
    # steps by tokens computed: [i] counts steps of at most ITERATION_TOKEN_BUCKETS[i] tokens (the last: more)
    token_buckets: list = dataclasses.field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    expert_load: ExpertLoad | None = None       # MoE models

    def count_step(self, num_tokens: int, device_ms: float) -> None:
        """A step read back: ``num_tokens`` computed, ``device_ms`` waited for."""
        self.device_ms += device_ms
        self.steps += 1
        self.tokens += num_tokens
        self.token_buckets[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1

    def snapshot(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "host_ms_per_step": self.host_ms / n,
                "device_ms_per_step": self.device_ms / n, "tokens_per_step": self.tokens / n,
                "iteration_tokens": (ITERATION_TOKEN_BUCKETS, tuple(self.token_buckets), self.tokens),
                **(self.expert_load.snapshot() if self.expert_load is not None else {})}


def moe_layers(model) -> tuple[int, int] | None:
    """(MoE layers, experts) of a mixture-of-experts decoder with at least one MoE layer, else None (a config cut
    to its leading dense layers, DeepSeek's ``first_k_dense_replace``, has no expert load to count)."""
    spec = getattr(model.family, "decoder_spec", None)
    moe = spec(model.config).moe if spec is not None else None
    return (sum(moe.layers), moe.num_experts) if moe is not None and sum(moe.layers) else None


def runner_stats(moe: tuple[int, int] | None) -> RunnerStats:
    """Empty stats, with an expert-load counter for an MoE model (``moe``: its layers and experts)."""
    return RunnerStats(expert_load=ExpertLoad(np.zeros(moe, np.int64)) if moe else None)
