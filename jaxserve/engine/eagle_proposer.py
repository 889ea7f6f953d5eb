"""The EAGLE proposer (``--speculative-config '{"method": "eagle", "model": HEAD}'``, ``eagle3`` (an EAGLE-3
head, ``models.eagle3``: the target's hidden states are three of its layers' residual streams) and
``deepseek_mtp``: a DeepSeek target's multi-token-prediction layer as the head): a draft head
(``models.eagle``) that reads the target's hidden states, with its own runner and KV cache
(``DraftProposer``'s), run greedily.

The head's position ``i`` takes the token at ``i + 1`` and the target's hidden state at ``i`` (vLLM's
layout: the positions are the target's). A round (before each schedule): the head catches up on the rows of
the target's latest step (``ModelRunner.last_hidden``; every request in it, speculating or not, so that its
K/V covers what the target computed) whose next token is verified: a prefill chunk's rows, or a verified
step's last token and accepted drafts; the rejected drafts' rows are left out. The hidden states go from the
target's step to the head's on the device (the head gathers its rows from them); the head samples the first
draft at each proposing request's last verified position, then K - 1 one-token steps each feed the previous
draft and the head's own output hidden state at it. The drafts' K/V are recomputed from the target's hidden
states in the next round.

The head's blocks enter a prefix cache of its own (with ``--enable-prefix-caching``), keyed by the tokens
they depend on: a request the target finds in its prefix cache finds the head's K/V of those positions
there too, when the head computed them (the target's hidden states of cached positions do not exist). A
request whose positions the head has no K/V of proposes nothing until it is recomputed from its start
(preemption); a request that stops running frees its head blocks.
"""
from __future__ import annotations

from jaxserve.engine.draft_proposer import DraftProposer, _DraftSeq
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.scheduler_output import ScheduledRequest


class EagleProposer(DraftProposer):
    every_step = True

    def __init__(self, executor, config):
        from jaxserve.models.eagle_loader import load_eagle3_head, load_eagle_head, load_mtp_head  # noqa: PLC0415
        spec = config.speculative_config
        # on the target's mesh: sharded over "tp" as the target's layers are
        kw = {"load_format": config.load_format, "seed": config.seed, "mesh": executor.mesh}
        if spec.method == "deepseek_mtp":
            head = load_mtp_head(spec.model or config.model, executor.model, **kw)
        elif spec.method == "eagle3":
            head = load_eagle3_head(spec.model, executor.model, **kw)
        else:
            head = load_eagle_head(spec.model, executor.model, **kw)
        super().__init__(executor, config, head, prefix_caching=config.cache.enable_prefix_caching)
        self.executor = executor
        self._seen = None           # the target step last read (``HiddenRows``)
        self._reqs: dict[str, object] = {}
        self._lost: dict[str, object] = {}     # running requests the head has no K/V of (until they stop)

    def propose(self, wanted: list[tuple[object, int]]) -> list[list[int]]:
        """Catch the head up on the target's latest step; up to ``room`` greedy drafts for each (request,
        room) of ``wanted`` whose last verified position it has just computed ([] for the others)."""
        for rid in [rid for rid, req in self._reqs.items() if req.status != RequestStatus.RUNNING]:
            self._free(rid)
            del self._reqs[rid]
        self._lost = {rid: req for rid, req in self._lost.items() if req.status == RequestStatus.RUNNING}
        last = self.executor.runner.last_hidden
        if last is None or last is self._seen:
            return [[] for _ in wanted]
        self._seen = last
        want = {req.request_id: room for req, room in wanted}
        first, index, rooms = [], [], {}
        for req, row0, start, num_rows in last.rows:
            rid = req.request_id
            tokens = req._all_token_ids
            end = min(start + num_rows, len(tokens) - 1)      # the positions whose next token is verified
            seq = self.seqs.get(rid)
            hits = None
            if seq is None and req.status == RequestStatus.RUNNING and end > start and rid not in self._lost:
                seq, hits = self._new_seq(req, start, end)
            if seq is None or start > seq.num_known or end <= start:
                continue            # positions before ``start`` the head has no K/V of
            samples = rid in want and end == len(tokens) - 1
            room = want[rid] if samples else 1
            first_pos = max(start, len(hits) * self.kv.block_size) if hits else start
            seq.num_computed_tokens = 0 if hits else first_pos
            del seq.all_token_ids[first_pos:]
            seq.all_token_ids += tokens[first_pos + 1:end + 1]
            if self.kv.allocate_slots(seq, end - first_pos + room - 1, hits) is None:
                self._free(rid)
                del self._reqs[rid]
                continue
            seq.num_computed_tokens, seq.num_known = first_pos, end
            first.append(ScheduledRequest(seq, end - first_pos, first_pos, self.kv.live_block_ids(rid), samples))
            index += range(row0 + first_pos - start, row0 + end - start)
            if samples:
                rooms[rid] = room
        if not first:
            return [[] for _ in wanted]
        drafts = self._run_round(first, rooms, (last.hidden, index))
        for s in first:         # the blocks whose K/V came from the target's hidden states (not the drafts')
            self.kv.cache_blocks(s.request, s.request.num_known)
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _new_seq(self, req, start: int, end: int) -> tuple[_DraftSeq | None, list]:
        """A request new to the head: its sequence and the head's cached blocks of its prefix before ``end``
        (the head computes from there), or None where the target starts past them (a prefix-cache hit of the
        target's alone). A block's K/V depend on the request's tokens up to the one after it, and on the
        target's hidden states (its first token and adapter, in the key's salt)."""
        seq = _DraftSeq(req)
        seq.cache_salt, seq.lora_request = (req.cache_salt, req._all_token_ids[0]), req.lora_request
        seq.all_token_ids = req._all_token_ids[1:]
        hits, _ = self.kv.get_computed_blocks(seq)
        hits = hits[:(end - 1) // self.kv.block_size]
        num_hit = len(hits) * self.kv.block_size
        if num_hit < start:
            self._lost[req.request_id] = req
            return None, []
        seq.num_known = num_hit
        self.seqs[req.request_id], self._reqs[req.request_id] = seq, req
        return seq, hits

    def _dispatch_next(self, step: list[ScheduledRequest], prev, last_row: dict[str, int]):
        """The next draft step: each request's previous draft and the head's hidden state at its row (an
        EAGLE-3 head's marked as its own, ``~row``: it is not the target's, which its ``fc`` reads)."""
        rows = [last_row[s.request_id] for s in step]
        if getattr(self.model.family, "marks_own_hidden", False):
            rows = [~r for r in rows]
        return self.runner.dispatch(step, prev, hidden=(prev.hidden, rows))
