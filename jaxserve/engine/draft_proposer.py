"""The draft-model proposer (``--speculative-config '{"method": "draft_model", "model": ...}'``): a second, smaller
model sharing the target's tokenizer, with its own runner and KV cache on the target's mesh (sharded over "tp"
as the target is), run greedily, without LoRA adapters, to propose each request's draft tokens.

A round (one per engine step): each request's draft sequence catches up on the tokens the draft has not
computed (its prompt the first time; after a verification, the accepted tokens and the target's next one; the
drafts the target rejected are recomputed: their K/V are overwritten), within the draft's token budget (a long
prompt catches up over several rounds, proposing nothing until it has), and samples the first draft; then
K - 1 one-token steps each feed the previous draft to the next on the device (the runner's placeholders), and
the host reads the drafts once, at the end. A request the draft's pool cannot hold proposes nothing; a
request that stops speculating (finished, preempted) frees its draft blocks.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.runner.step_contract import PLACEHOLDER
from jaxserve.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


class _DraftSeq:
    """A request as the draft runner sees it (``step_contract.StepRequest``): the tokens whose K/V the draft
    computed, then the ones it is fed."""
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "sampling_seed",
                 "lora_slot", "mm_features", "all_token_ids", "num_computed_tokens", "num_known", "block_hashes",
                 "cache_salt", "lora_request")

    def __init__(self, req):
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_token_ids
        self.output_token_ids: list[int] = []          # the sampler's counters only (greedy: unused)
        self.sampling_params, self.sampling_seed, self.lora_slot, self.mm_features = _GREEDY, None, 0, None
        self.all_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_known = 0          # leading tokens that are the request's own (verified), not drafts
        # a draft pool with a prefix cache (EAGLE's): the prefix-cache key (``KVCacheManager``)
        self.block_hashes: list = []
        self.cache_salt, self.lora_request = None, None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def check_same_tokenizer(target, draft, name: str) -> None:
    """Refuse a draft whose vocabulary is not the target's (its token ids would mean other tokens)."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    t_tok, d_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    same = t_tok.get_vocab() == d_tok.get_vocab() if t_tok is not None and d_tok is not None else tv == dv
    if not same or dv > tv:
        raise ValueError(f"draft model {name!r} does not share the target's tokenizer (vocabularies of {dv} and {tv} "
                         "tokens, or different tokens): speculative decoding needs a draft of the same tokenizer")


class DraftProposer:
    # whether ``propose`` must see every engine step, even one with no request to propose for (EAGLE: its
    # head reads each target step's hidden states)
    every_step = False

    def __init__(self, executor, config, model=None, prefix_caching: bool = False):
        """``model``: the draft, already loaded (an EAGLE head), else ``config``'s speculative model;
        ``prefix_caching``: the draft's blocks enter a prefix cache of their own (the proposer keys them)."""
        from jaxserve.config import LoRAConfig
        from jaxserve.models import load_model
        from jaxserve.runner.model_runner import ModelRunner
        spec = config.speculative_config
        target = executor.model
        max_len = target.max_model_len
        if model is None:
            model = load_model(spec.model, dtype=config.dtype, load_format=config.load_format,
                               max_model_len=max_len, mesh=executor.mesh)
            check_same_tokenizer(target, model, spec.model)
        self.model = model
        bs = config.cache.block_size
        blocks = config.scheduler.max_num_seqs * math.ceil(max_len / bs) + 1
        draft_config = config.replace(
            model=spec.model, tokenizer=None, speculative_config=None, lora=LoRAConfig(),
            cache=dataclasses.replace(config.cache, enable_prefix_caching=False, num_gpu_blocks_override=blocks))
        self.runner = ModelRunner(self.model, draft_config, max_len, mesh=executor.mesh)
        self.kv = KVCacheManager(self.runner.num_blocks, bs, prefix_caching, self.runner.max_model_len)
        self.budget = self.runner.max_num_tokens
        self.seqs: dict[str, _DraftSeq] = {}

    def warmup(self, progress: bool = True) -> None:
        self.runner.warmup(progress=progress)

    def _free(self, rid: str) -> None:
        self.kv.free(self.seqs.pop(rid))

    def propose(self, wanted: list[tuple[object, int]]) -> list[list[int]]:
        """Up to ``room`` greedy draft tokens for each (request, room) of ``wanted`` ([] where none this round)."""
        ids = {req.request_id for req, _ in wanted}
        for rid in [rid for rid in self.seqs if rid not in ids]:
            self._free(rid)
        first, budget, rooms = [], self.budget, {}
        for req, room in wanted:
            seq = self.seqs.get(req.request_id)
            if seq is None:
                seq = self.seqs[req.request_id] = _DraftSeq(req)
            self._sync(seq, req._all_token_ids)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            reaches_end = seq.num_computed_tokens + num_new == seq.num_tokens
            extra = room - 1 if reaches_end else 0
            if self.kv.allocate_slots(seq, num_new + extra) is None:
                self._free(req.request_id)
                continue
            budget -= num_new
            first.append(ScheduledRequest(seq, num_new, seq.num_computed_tokens,
                                          self.kv.live_block_ids(seq.request_id), reaches_end))
            if reaches_end:
                rooms[seq.request_id] = room
        if not first:
            return [[] for _ in wanted]
        drafts = self._run_round(first, rooms)
        for rid, toks in drafts.items():       # the drafts fed back (all but the last) hold their K/V now
            seq = self.seqs[rid]
            seq.all_token_ids[seq.num_known:] = toks[:-1]
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _run_round(self, first: list[ScheduledRequest], rooms: dict[str, int],
                   hidden: tuple | None = None) -> dict[str, list[int]]:
        """Dispatch ``first`` (``hidden``: an EAGLE head's inputs, ``ModelRunner.dispatch``), then one-token
        steps each feeding the previous drafts on the device until each request has ``rooms`` of them; read
        them once at the end: request id -> its drafts."""
        pendings = [self.runner.dispatch(first, hidden=hidden) if hidden is not None else self.runner.dispatch(first)]
        self._advance(first)
        live = [s.request for s in first if s.samples]
        # each request's row in the step before (its last token's): where an EAGLE head's next input is
        ends = itertools.accumulate(s.num_new_tokens for s in first)
        last_row = {s.request.request_id: end - 1 for s, end in zip(first, ends)}
        for i in range(1, max(rooms.values(), default=1)):
            live = [seq for seq in live if rooms[seq.request_id] > i]
            if not live:
                break
            step = [ScheduledRequest(seq, 1, seq.num_computed_tokens, self.kv.live_block_ids(seq.request_id))
                    for seq in live]
            pendings.append(self._dispatch_next(step, pendings[-1], last_row))
            last_row = {seq.request_id: j for j, seq in enumerate(live)}
            self._advance(step)
        drafts: dict[str, list[int]] = {rid: [] for rid in rooms}
        for pending in pendings:
            for rid, tok in self.runner.collect(pending).token_ids.items():
                drafts[rid].append(tok)
        return drafts

    def _dispatch_next(self, step: list[ScheduledRequest], prev, last_row: dict[str, int]):
        """A one-token step fed the drafts ``prev`` sampled (``last_row``: each request's row in it)."""
        return self.runner.dispatch(step, prev)

    @staticmethod
    def _advance(step: list[ScheduledRequest]) -> None:
        """A dispatched draft step: its chunks are computed, and each sampling one feeds its draft (on the
        device: a placeholder here) to the next step."""
        for s in step:
            seq = s.request
            seq.num_computed_tokens = s.start_pos + s.num_new_tokens
            if s.samples:
                seq.all_token_ids.append(PLACEHOLDER)

    @staticmethod
    def _sync(seq: _DraftSeq, tokens: list[int]) -> None:
        """Bring a draft sequence to the request's tokens: the K/V computed for drafts the target rejected
        are recomputed (its computed tokens go back to the first difference)."""
        fed = seq.all_token_ids
        known = seq.num_known
        keep = known
        while keep < min(seq.num_computed_tokens, len(tokens)) and fed[keep] == tokens[keep]:
            keep += 1
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep)
        del fed[keep:]                      # the prefix kept never changes: only the tail is copied
        fed += tokens[keep:]
        seq.num_known = len(fed)
