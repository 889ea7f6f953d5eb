"""What the speculative-decoding tests share: greedy parameters, the outputs' token ids, and a recorder of
the drafts a draft proposer makes."""
from jaxserve import SamplingParams


def greedy(m: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def record_drafts(llm) -> list[tuple[int, list[int]]]:
    """A list that fills, as ``llm`` runs, with (the request's last token, its drafts) for each proposal of its
    draft proposer to a request that has outputs (a prompt's last token is not the target's)."""
    draft, seen = llm.engine.core.speculator.draft, []
    propose = draft.propose

    def recording(wanted):
        out = propose(wanted)
        seen.extend((req._all_token_ids[-1], d) for (req, _), d in zip(wanted, out) if d and req.output_token_ids)
        return out
    draft.propose = recording
    return seen
