"""On-device sampling: batched, per-request parameters as arrays, jit-friendly (no host round trip).

Order (vLLM v1's ``Sampler``): the structured-output bitmask (tokens outside a request's grammar → -inf; vLLM
applies it to the logits before its sampler) → logprobs taken here (vLLM's default `raw_logprobs`) →
allowed_token_ids (-inf elsewhere) → bad words and min_tokens (their ids -inf) → logit_bias (added) →
penalties (repetition, then frequency/presence) → greedy argmax, or: temperature → top-k → top-p → min-p → an
inverse-CDF draw with a per-request key. The blocked ids (bad words, min_tokens) are masked after the
penalties here: an -inf logit stays -inf through the bias and every penalty, so the result is vLLM's order's.

Shapes are static per (rows, penalty-history width, blocked-ids width, and the widths of the optional id
arrays). The penalty id arrays have width 0 (no work) unless some request in the batch uses a penalty; then
`penalty_width` (the runner passes its max_model_len bucket: one extra compiled variant) or else a power-of-two
bucket of the longest history. The blocked ids are 8 wide (wider only for a request with more stop ids and
bad words this step) and cost an R*8 scatter. allowed_token_ids and logit_bias are absent (None: not in the
packed layout, so a step without them runs exactly the program it ran before they existed) unless some row of
the step uses them; then a power-of-two bucket of the longest list: one scatter each.

Cost notes (benchmarks/sampler_bench.py on a shared 2-core CPU; R=64, V=49152, best of 10): the draw itself
5 ms by inverse CDF vs 202 ms by Gumbel-max (threefry noise for R*V floats); top_k=50 + top_p=0.9 through 256
candidates 162 ms vs 1375 ms with a full sort; greedy 94 ms; random T=0.8 125 ms.
- greedy-only and unfiltered batches never sort: top-k/top-p run under a `lax.cond` on "any row filters".
- top-k/top-p take the `max_candidates` largest logits with `lax.top_k` and are exact when every row's
  kept set lies inside them (top_k <= K, and for top-p the K candidates hold at least top_p of the mass,
  which a peaked LM distribution almost always does); otherwise a second `lax.cond` falls back to one full
  sort of the rows. Results are exact either way; only the cost differs.
- penalties: output ids [R, L] become counts with one scatter-add into [R, V] (O(R·L) scatter + a few
  O(R·V) elementwise passes); the prompt ids (for repetition_penalty) are the one large transfer, R x
  width int32 per step, and ship only while some request uses a penalty.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import SamplingParams

# Top-k/top-p candidates taken by lax.top_k before falling back to a full sort (see the module doc).
DEFAULT_MAX_CANDIDATES = 256
_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters for one step (R rows = the request bucket; padding rows are greedy).

    Token-id arrays are padded with `vocab_size` (out of range: dropped by the scatters)."""
    temperature: jax.Array          # [R] f32, 0 = greedy
    top_p: jax.Array                # [R] f32, 1 = off
    top_k: jax.Array                # [R] i32, 0 = off
    min_p: jax.Array                # [R] f32, 0 = off
    presence_penalty: jax.Array     # [R] f32
    frequency_penalty: jax.Array    # [R] f32
    repetition_penalty: jax.Array   # [R] f32, 1 = off
    seed_key_data: jax.Array        # [R, 2] u32: PRNGKey(seed) for seeded rows
    seeded: jax.Array               # [R] bool
    request_hash: jax.Array         # [R] u32: crc32 of the request id (unseeded rows)
    key_counter: jax.Array          # [R] u32: num_output_tokens (seeded) or the engine step (unseeded)
    engine_key_data: jax.Array      # [2] u32: PRNGKey(engine_seed)
    output_token_ids: jax.Array     # [R, Lo] i32: ids generated so far (frequency/presence/repetition)
    prompt_token_ids: jax.Array     # [R, Lp] i32: prompt ids (repetition penalty only)
    blocked_token_ids: jax.Array    # [R, S] i32: masked this step: bad words, and stop/eos ids below min_tokens
    # Optional: None unless some row of the step uses them (then absent from the packed layout).
    allowed_token_ids: jax.Array | None = None    # [R, A] i32: a row with ids may sample only those
    logit_bias_ids: jax.Array | None = None       # [R, B] i32
    logit_bias_values: jax.Array | None = None    # [R, B] f32: added to the logits of logit_bias_ids

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=[f.name for f in dataclasses.fields(SamplingMetadata)], meta_fields=[])


class SamplerOutput(NamedTuple):
    token_ids: jax.Array       # [R] i32
    logprob: jax.Array         # [R] f32: raw log-softmax of the sampled token
    rank: jax.Array            # [R] i32: 1 = the most likely token
    topk_ids: jax.Array        # [R, k] i32 (k = num_logprobs; 0 = none)
    topk_logprobs: jax.Array   # [R, k] f32, descending

    # the names vLLM's logprobs tensors use
    @property
    def logprobs(self) -> jax.Array:
        return self.logprob

    @property
    def ranks(self) -> jax.Array:
        return self.rank


# ---------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------
def length_bucket(n: int, minimum: int = 16) -> int:
    """Width of a padded id array: 0 when unused, else the next power of two >= max(n, minimum)."""
    if n <= 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


def seed_key_data(seed: int) -> np.ndarray:
    """`jax.random.key_data(jax.random.PRNGKey(seed))` for threefry, computed in numpy (no dispatch)."""
    seed %= 1 << 64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def request_hash(request_id: str | int) -> int:
    """A stable 32-bit hash of a request id (Python's hash() changes from process to process)."""
    return zlib.crc32(str(request_id).encode())


def _pad_ids(rows: Sequence[Sequence[int]], num_rows: int, width: int, fill: int) -> np.ndarray:
    out = np.full((num_rows, width), fill, dtype=np.int32)
    for i, ids in enumerate(rows):
        if len(ids):
            out[i, :len(ids)] = ids
    return out


def blocked_by_bad_words(bad_words_token_ids: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens vLLM's bad-words rule blocks next: a one-token word always; a longer word's last token when
    the output so far ends with the word's other tokens."""
    out: list[int] = []
    if isinstance(output, np.ndarray):
        output = output.tolist()
    n = len(output)
    for word in bad_words_token_ids:
        k = len(word) - 1
        if k == 0 or (k <= n and list(output[n - k:]) == list(word[:k])):
            out.append(word[-1])
    return out


def make_sampling_metadata(params_list: Sequence[SamplingParams],
                           output_token_ids_list: Sequence[Sequence[int]],
                           prompt_token_ids_list: Sequence[Sequence[int]],
                           num_output_tokens_list: Sequence[int],
                           vocab_size: int,
                           pad_to: int,
                           *,
                           request_ids: Sequence[str | int] | None = None,
                           request_seeds: Sequence[int | None] | None = None,
                           step: int = 0,
                           engine_seed: int = 0,
                           penalty_width: int | None = None) -> SamplingMetadata:
    """Build the metadata for a step's sampled rows (numpy arrays; jit transfers them).

    Row i is request i; rows len(params_list)..pad_to-1 are padding (greedy, no penalties). Keys: a row
    with a seed (`params.seed`, else `request_seeds[i]` when given: the engine may draw one per request)
    uses fold_in(PRNGKey(seed), num_output_tokens), so it samples the same tokens whatever batch it runs
    in; other rows use fold_in(fold_in(PRNGKey(engine_seed), crc32(request_ids[i])), step).
    `num_output_tokens_list[i]` is the number of tokens request i has already generated (the index of
    the token sampled now); it also decides whether min_tokens still blocks the stop ids.
    Token-id rows may be lists or int32 numpy arrays; with penalties on, converting Python lists costs
    ~50 ns a token (20 ms for 256 rows of 1200 ids), arrays are a memcpy (0.1 ms): cache them per request.
    `penalty_width` fixes the width of the output/prompt id arrays whenever a penalty is in use (the engine
    passes its max_model_len bucket), so penalties add one compiled variant, not one per history length.
    A row's bad words (``params.bad_words_token_ids``, after the engine tokenized them) are matched against
    its output ids here; its allowed_token_ids and logit_bias fill the optional arrays.
    """
    n = len(params_list)
    if n > pad_to:
        raise ValueError(f"{n} requests do not fit the request bucket pad_to={pad_to}")
    if request_ids is None:
        request_ids = range(n)
    (temperature, top_p, top_k, min_p, presence, frequency, repetition, seed_keys, seeded, hashes,
     counters) = padding_rows(pad_to)
    blocked: list[list[int]] = []
    allowed: dict[int, list[int]] = {}
    bias: dict[int, dict[int, float]] = {}
    for i, p in enumerate(params_list):
        temperature[i] = p.temperature
        top_p[i] = p.top_p
        top_k[i] = p.top_k if 0 < p.top_k < vocab_size else 0
        min_p[i] = p.min_p
        presence[i] = p.presence_penalty
        frequency[i] = p.frequency_penalty
        repetition[i] = p.repetition_penalty
        seed = p.seed if p.seed is not None else (request_seeds[i] if request_seeds is not None else None)
        if seed is not None:
            seeded[i] = True
            seed_keys[i] = seed_key_data(seed)
            counters[i] = num_output_tokens_list[i]
        else:
            hashes[i] = request_hash(request_ids[i])
            counters[i] = step % (1 << 32)
        if num_output_tokens_list[i] < p.min_tokens:
            blocked.append(sorted(t for t in p.all_stop_token_ids if t < vocab_size))
        else:
            blocked.append([])
        if p.bad_words:
            words = blocked_by_bad_words(p.bad_words_token_ids or (), output_token_ids_list[i])
            blocked[i] = sorted({*blocked[i], *(t for t in words if t < vocab_size)})
        if p.allowed_token_ids:
            allowed[i] = p.allowed_token_ids
        if p.logit_bias:
            bias[i] = p.logit_bias

    uses_output = bool(np.any(presence[:n] != 0) or np.any(frequency[:n] != 0) or np.any(repetition[:n] != 1))
    uses_prompt = bool(np.any(repetition[:n] != 1))
    if penalty_width is not None:
        out_width = prompt_width = penalty_width if uses_output else 0
        longest = max((len(ids) for ids in [*output_token_ids_list, *prompt_token_ids_list]), default=0)
        if uses_output and longest > penalty_width:
            raise ValueError(f"a prompt or output of {longest} tokens exceeds penalty_width={penalty_width}")
    else:
        out_width = length_bucket(max((len(o) for o in output_token_ids_list), default=0)) if uses_output else 0
        prompt_width = length_bucket(max((len(o) for o in prompt_token_ids_list), default=0)) if uses_prompt \
            else 0
    # fixed at 8 unless a request has more stop ids (then the next power of two: a rare extra compile)
    blocked_width = max(8, length_bucket(max((len(b) for b in blocked), default=0), minimum=8))
    optional = {}
    if allowed:
        rows = [allowed.get(i, ()) for i in range(n)]
        optional["allowed_token_ids"] = _pad_ids(rows, pad_to, length_bucket(max(map(len, rows))), vocab_size)
    if bias:
        width = length_bucket(max(map(len, bias.values())))
        optional["logit_bias_ids"] = _pad_ids([list(bias.get(i, ())) for i in range(n)], pad_to, width, vocab_size)
        values = optional["logit_bias_values"] = np.zeros((pad_to, width), np.float32)
        for i, b in bias.items():
            values[i, :len(b)] = list(b.values())
    return SamplingMetadata(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        seed_key_data=seed_keys, seeded=seeded, request_hash=hashes, key_counter=counters,
        engine_key_data=seed_key_data(engine_seed),
        output_token_ids=_pad_ids(output_token_ids_list if out_width else [], pad_to, out_width, vocab_size),
        prompt_token_ids=_pad_ids(prompt_token_ids_list if prompt_width else [], pad_to, prompt_width, vocab_size),
        blocked_token_ids=_pad_ids(blocked, pad_to, blocked_width, vocab_size),
        **optional,
    )


def padding_rows(pad_to: int):
    """The per-row arrays of `SamplingMetadata`, every row greedy with no filter, penalty or seed (the value
    padding rows keep): temperature, top_p, top_k, min_p, presence, frequency, repetition, seed keys,
    seeded, request hash, key counter."""
    f32 = np.float32
    return (np.zeros(pad_to, f32), np.ones(pad_to, f32), np.zeros(pad_to, np.int32), np.zeros(pad_to, f32),
            np.zeros(pad_to, f32), np.zeros(pad_to, f32), np.ones(pad_to, f32), np.zeros((pad_to, 2), np.uint32),
            np.zeros(pad_to, bool), np.zeros(pad_to, np.uint32), np.zeros(pad_to, np.uint32))


# ---------------------------------------------------------------------------------------------------
# device side (call inside jit; `num_logprobs` and `max_candidates` are static)
# ---------------------------------------------------------------------------------------------------
def _token_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """[R, L] ids (vocab_size = padding) -> [R, V] bool, True where the id occurs."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab_size), bool).at[rows, ids].set(True, mode="drop")


def apply_allowed_token_ids(logits: jax.Array, allowed_ids: jax.Array) -> jax.Array:
    """-inf outside each row's allowed ids ([R, A], vocab_size = padding); a row of padding only (no
    allowed_token_ids: a list is never empty) keeps every token."""
    vocab = logits.shape[1]
    restricted = jnp.any(allowed_ids < vocab, axis=1)
    return jnp.where(restricted[:, None] & ~_token_mask(allowed_ids, vocab), _NEG_INF, logits)


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """Add each row's bias values to the logits of its ids ([R, B]; padding ids are dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits + jnp.zeros_like(logits).at[rows, ids].add(values, mode="drop")


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """vLLM's penalties: repetition divides positive / multiplies non-positive logits of every token seen
    in the prompt or the output; then frequency * count and presence * [count > 0] over the output."""
    num_rows, vocab = logits.shape
    if meta.output_token_ids.shape[1] == 0 and meta.prompt_token_ids.shape[1] == 0:
        return logits
    rows = jnp.arange(num_rows)[:, None]
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, meta.output_token_ids].add(1.0, mode="drop")
    in_output = counts > 0
    seen = in_output
    if meta.prompt_token_ids.shape[1]:
        seen = seen | _token_mask(meta.prompt_token_ids, vocab)
    rep = jnp.where(seen, meta.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - meta.frequency_penalty[:, None] * counts
    return logits - meta.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _keep_threshold(sorted_desc: jax.Array, lse_all: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """From each row's K largest logits (descending), the smallest logit top-k/top-p keep, and whether
    those K candidates were enough to decide it exactly.

    top-p as vLLM: probabilities renormalised over the top-k set (or the whole vocab when top-k is off);
    a token goes when the probability mass of the tokens above it already reaches top_p."""
    num_cands = sorted_desc.shape[1]
    k_on = top_k > 0
    p_on = top_p < 1.0
    pos = jnp.arange(num_cands)[None, :]
    in_top_k = jnp.where(k_on[:, None], pos < top_k[:, None], True)
    kept_logits = jnp.where(in_top_k, sorted_desc, _NEG_INF)
    lse = jnp.where(k_on, jax.nn.logsumexp(kept_logits, axis=1), lse_all)
    probs = jnp.exp(kept_logits - lse[:, None])
    mass_above = jnp.cumsum(probs, axis=1) - probs
    in_top_p = jnp.where(p_on[:, None], mass_above < top_p[:, None], True)
    num_kept = jnp.maximum(jnp.sum(in_top_k & in_top_p, axis=1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=1)[:, 0]
    threshold = jnp.where(k_on | p_on, threshold, _NEG_INF)
    k_exact = ~k_on | (top_k <= num_cands)
    p_exact = ~p_on | k_on | (jnp.sum(probs, axis=1) >= top_p)
    return threshold, k_exact & p_exact


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
                      max_candidates: int = DEFAULT_MAX_CANDIDATES, branchless: bool = False) -> jax.Array:
    """Mask (-inf) what top-k then top-p remove. No sort when no row filters; `lax.top_k` of
    `max_candidates` when that decides every row exactly; one full sort otherwise.

    `branchless=True` (the caller knows some row filters) replaces both `lax.cond`s with arithmetic: on GPU
    an XLA conditional copies its predicate to the host, which stalls the dispatching thread until the
    device gets there — the host could no longer run ahead of the device. It then always sorts fully
    (exact; ~1 ms for 256 x 128k on an H200) unless every row is decided by the candidates."""
    vocab = logits.shape[1]
    top_k = jnp.where((top_k > 0) & (top_k < vocab), top_k, 0)
    any_filter = jnp.any((top_k > 0) | (top_p < 1.0))

    def full_sort_threshold(x):
        return _keep_threshold(jnp.sort(x, axis=1)[:, ::-1], jax.nn.logsumexp(x, axis=1), top_k, top_p)[0]

    def filtered(x):
        lse_all = jax.nn.logsumexp(x, axis=1)
        if max_candidates >= vocab:
            threshold = full_sort_threshold(x)
        else:
            candidates = jax.lax.top_k(x, max_candidates)[0]
            threshold, exact = _keep_threshold(candidates, lse_all, top_k, top_p)
            if branchless:
                threshold = jnp.where(exact, threshold, full_sort_threshold(x))
            else:
                threshold = jax.lax.cond(jnp.all(exact), lambda x: threshold, full_sort_threshold, x)
        return jnp.where(x < threshold[:, None], _NEG_INF, x)

    if branchless:
        return filtered(logits)
    return jax.lax.cond(any_filter, filtered, lambda x: x, logits)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens with probability < min_p * max probability, i.e. logit < max logit + log(min_p)
    (the ratio, hence the test, is the same before and after top-k/top-p renormalise)."""
    cutoff = jnp.max(logits, axis=1) + jnp.log(jnp.maximum(min_p, 1e-30))
    return jnp.where((min_p[:, None] > 0) & (logits < cutoff[:, None]), _NEG_INF, logits)


def row_keys(meta: SamplingMetadata) -> jax.Array:
    """One typed PRNG key per row: fold_in(PRNGKey(seed), num_output_tokens) for seeded rows,
    fold_in(fold_in(PRNGKey(engine_seed), request_hash), step) for the others."""
    wrap = lambda data: jax.random.wrap_key_data(data, impl="threefry2x32")  # noqa: E731
    engine_key = wrap(meta.engine_key_data)
    unseeded = jax.vmap(lambda h: jax.random.key_data(jax.random.fold_in(engine_key, h)))(meta.request_hash)
    base = jnp.where(meta.seeded[:, None], meta.seed_key_data, unseeded)
    return jax.vmap(lambda d, c: jax.random.fold_in(wrap(d), c))(base, meta.key_counter)


def sample_inverse_cdf(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One categorical draw per row from softmax(logits) (-inf = excluded) with one uniform per row: the
    first token whose cumulative probability reaches u * total. A zero-probability token is never picked
    (its cumulative value equals its predecessor's). Gumbel-max needs R*V random numbers; on the CPU that
    threefry noise cost 10x this (351 vs 35 ms at R=64, V=49152); on GPU jnp.cumsum is a CUB scan."""
    probs = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    cdf = jnp.cumsum(probs, axis=1)
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    target = (1.0 - u) * cdf[:, -1]                       # in (0, total]
    token = jnp.sum(cdf < target[:, None], axis=1)
    return jnp.minimum(token, logits.shape[1] - 1).astype(jnp.int32)


def compute_logprobs(logprobs: jax.Array, token_ids: jax.Array, num_logprobs: int):
    """(logprob of token_ids, their rank (1 = best; ties count as better, as vLLM), top-k ids, top-k
    logprobs) from [N, V] log-probabilities. Also what the runner uses for prompt logprobs."""
    token_logprob = jnp.take_along_axis(logprobs, token_ids[:, None], axis=1)[:, 0]
    rank = jnp.sum(logprobs >= token_logprob[:, None], axis=1).astype(jnp.int32)
    if num_logprobs > 0:
        topk_logprobs, topk_ids = jax.lax.top_k(logprobs, num_logprobs)
    else:
        topk_logprobs = jnp.zeros((logprobs.shape[0], 0), jnp.float32)
        topk_ids = jnp.zeros((logprobs.shape[0], 0), jnp.int32)
    return token_logprob, rank, topk_ids.astype(jnp.int32), topk_logprobs


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's bitmask bit is 0: token t is bit t % 32 of int32 word t // 32 ([R, ceil(V/32)]:
    llguidance's layout). Bits past the logits' width are ignored."""
    vocab = logits.shape[1]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)
    bits = (words[:, :, None] >> shifts[None, None, :]) & jnp.uint32(1)   # logical: unsigned words
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, _NEG_INF)


def processed_logits(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """The logits greedy takes the argmax of and temperature scales (float32, after any bitmask): allowed
    token ids, logit bias, penalties, then the blocked ids (bad words, min_tokens; see the module doc)."""
    x = logits
    if meta.allowed_token_ids is not None:
        x = apply_allowed_token_ids(x, meta.allowed_token_ids)
    if meta.logit_bias_ids is not None:
        x = apply_logit_bias(x, meta.logit_bias_ids, meta.logit_bias_values)
    x = apply_penalties(x, meta)
    if meta.blocked_token_ids.shape[1]:
        x = jnp.where(_token_mask(meta.blocked_token_ids, x.shape[1]), _NEG_INF, x)
    return x


def filtered_logits(x: jax.Array, meta: SamplingMetadata, filtering: bool | None,
                    max_candidates: int = DEFAULT_MAX_CANDIDATES) -> jax.Array:
    """What a random row draws from: ``processed_logits`` over the temperature (greedy rows: 1), then top-k /
    top-p and min-p (-inf where they remove). ``filtering``: as ``sample``'s."""
    x = x / jnp.where(meta.temperature > 0.0, meta.temperature, 1.0)[:, None]
    if filtering is None:
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p, max_candidates=max_candidates)
    elif filtering:
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p, max_candidates=max_candidates, branchless=True)
    return apply_min_p(x, meta.min_p)


def sample(logits: jax.Array, meta: SamplingMetadata, *, num_logprobs: int = 0,
           max_candidates: int = DEFAULT_MAX_CANDIDATES, filtering: bool | None = None,
           bitmask: jax.Array | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [R, V]. `num_logprobs` (static) is the number of top
    logprobs to return per row (the batch's max `logprobs`); the sampled token's logprob and rank are
    always returned.

    `filtering` (static): None decides on the device with `lax.cond` whether to skip the random path (all
    greedy) and the top-k/top-p filter (no row filters) — cheapest on CPU. True/False is the host's answer
    to "does any row use top-k/top-p", and the sampler then has no conditionals at all (what the GPU
    needs: an XLA conditional there syncs the host with the device).

    `bitmask` ([R, ceil(V/32)] int32, structured outputs): the tokens each row may produce; None (no
    constrained row in the step) compiles no mask at all."""
    logits = logits.astype(jnp.float32)
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    raw_logprobs = jax.nn.log_softmax(logits, axis=1)
    x = processed_logits(logits, meta)
    greedy_ids = jnp.argmax(x, axis=1).astype(jnp.int32)
    is_greedy = meta.temperature <= 0.0

    def random_ids(x):
        return sample_inverse_cdf(filtered_logits(x, meta, filtering, max_candidates), row_keys(meta))

    if filtering is None:
        sampled = jax.lax.cond(jnp.all(is_greedy), lambda x: greedy_ids, random_ids, x)
    else:
        sampled = random_ids(x)
    token_ids = jnp.where(is_greedy, greedy_ids, sampled)
    return SamplerOutput(token_ids, *compute_logprobs(raw_logprobs, token_ids, num_logprobs))
