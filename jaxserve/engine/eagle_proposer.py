"""The EAGLE proposer (``--speculative-config '{"method": "eagle", "model": HEAD}'``, and ``deepseek_mtp``: a
DeepSeek target's multi-token-prediction layer as the head): a draft head (``models.eagle``) that reads the
target's hidden states, with its own runner and KV cache (``DraftProposer``'s), run greedily.

The head's position ``i`` takes the token at ``i + 1`` and the target's hidden state at ``i`` (vLLM's
layout: the positions are the target's). A round (before each schedule): the head catches up on the rows of
the target's latest step (``ModelRunner.last_hidden``; every request in it, speculating or not, so that its
K/V covers what the target computed) whose next token is verified: a prefill chunk's rows, or a verified
step's last token and accepted drafts; the rejected drafts' rows are left out. The hidden states go from the
target's step to the head's on the device (the head gathers its rows from them); the head samples the first
draft at each proposing request's last verified position, then K - 1 one-token steps each feed the previous
draft and the head's own output hidden state at it. The drafts' K/V are recomputed from the target's hidden
states in the next round.

A request whose positions the head did not see (a prefix-cache hit: the target computed no hidden state for
them; a step that ran without the head) has no head K/V there and proposes nothing until it is recomputed
from its start (preemption); a request that stops running frees its head blocks.
"""
from __future__ import annotations

from jaxserve.engine.draft_proposer import DraftProposer, _DraftSeq
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.scheduler_output import ScheduledRequest


class EagleProposer(DraftProposer):
    every_step = True

    def __init__(self, executor, config):
        from jaxserve.models.eagle_loader import load_eagle_head, load_mtp_head  # noqa: PLC0415
        spec = config.speculative_config
        if spec.method == "deepseek_mtp":
            head = load_mtp_head(spec.model or config.model, executor.model, load_format=config.load_format,
                                 seed=config.seed)
        else:
            head = load_eagle_head(spec.model, executor.model, load_format=config.load_format, seed=config.seed)
        super().__init__(executor, config, head)
        self.executor = executor
        self._seen = None           # the target step last read (``HiddenRows``)
        self._reqs: dict[str, object] = {}

    def propose(self, wanted: list[tuple[object, int]]) -> list[list[int]]:
        """Catch the head up on the target's latest step; up to ``room`` greedy drafts for each (request,
        room) of ``wanted`` whose last verified position it has just computed ([] for the others)."""
        for rid in [rid for rid, req in self._reqs.items() if req.status != RequestStatus.RUNNING]:
            self._free(rid)
            del self._reqs[rid]
        last = self.executor.runner.last_hidden
        if last is None or last is self._seen:
            return [[] for _ in wanted]
        self._seen = last
        want = {req.request_id: room for req, room in wanted}
        first, index, rooms = [], [], {}
        for req, row0, start, num_rows in last.rows:
            rid = req.request_id
            seq = self.seqs.get(rid)
            if seq is None and start == 0 and req.status == RequestStatus.RUNNING:
                seq = self.seqs[rid] = _DraftSeq(req)
                self._reqs[rid] = req
            if seq is None or start > seq.num_known:
                continue            # positions before ``start`` the head never saw
            tokens = req._all_token_ids
            end = min(start + num_rows, len(tokens) - 1)      # the positions whose next token is verified
            if end <= start:
                continue
            samples = rid in want and end == len(tokens) - 1
            room = want[rid] if samples else 1
            seq.num_computed_tokens = start
            del seq.all_token_ids[start:]
            seq.all_token_ids += tokens[start + 1:end + 1]
            if self.kv.allocate_slots(seq, end - start + room - 1) is None:
                self._free(rid)
                del self._reqs[rid]
                continue
            seq.num_known = end
            first.append(ScheduledRequest(seq, end - start, start, self.kv.live_block_ids(rid), samples))
            index += range(row0, row0 + end - start)
            if samples:
                rooms[rid] = room
        if not first:
            return [[] for _ in wanted]
        drafts = self._run_round(first, rooms, (last.hidden, index))
        return [drafts.get(req.request_id, []) for req, _ in wanted]

    def _dispatch_next(self, step: list[ScheduledRequest], prev, last_row: dict[str, int]):
        """The next draft step: each request's previous draft and the head's hidden state at its row."""
        return self.runner.dispatch(step, prev, hidden=(prev.hidden, [last_row[s.request_id] for s in step]))
