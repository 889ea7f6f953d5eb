"""N-gram (prompt lookup) proposals on the device, so that under async scheduling every step can speculate with
no host in the loop (``--speculative-config`` method ``ngram`` under ``spec_async``).

NOTE (the design): the device keeps each request's tokens, ``hist [C, L]`` and ``hist_len [C]`` (C rows of
its own, handed out like ``InputBatch``'s; L: ``max_model_len``, at most ``WINDOW``: a longer request keeps its
latest L tokens, sliding, and its lookup finds the latest match within them). The host writes a request's known
tokens (prompt + verified outputs) once, with its first sampling step (a row of its own for its life; when the
rows run out, the step's requests keep theirs, moved to the first rows, and the others get them afresh). After
every step one small jitted call appends each row's emitted tokens (the sampler's output, still on the device)
to its history and proposes the next step's drafts from it: ``lookup``, ``propose_ngram``'s semantics, as
``drafts [max_num_seqs * K]`` and ``counts [max_num_seqs]`` by the step's rows. The next step places K draft
slots for a request whose drafts exist (it was in that step; the host does not know their values: placeholders),
its forward takes those slots' input ids from ``drafts`` (``draft_index``: the previous step's row * K + slot)
and its rejection sampler verifies ``min(slots, count)`` of them; the slots past the count are computed and
rejected. Proposing from the device's verified tokens, a step's drafts continue the tokens the step before it
accepted, whichever they were: no draft ever follows an unverified one.

The counts come back with the step's tokens (``proposed``): the host gives a request draft slots while its last
count read was > 0 (one step late), so a request whose text offers no match decodes a plain token a step.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import envs
from jaxserve.runner.step_contract import PLACEHOLDER

# the longest history a request keeps on the device (its latest tokens): bounds the lookup's work per step
WINDOW = 8192


def spec_async() -> bool:
    """Whether n-gram speculation runs under async scheduling: ``JAXSERVE_SPEC_ASYNC``, by default on a GPU (a
    synchronous step waits for the device each step: 0.64x of decoding without speculation on text that offers
    no drafts; async steps with drafts on the device 0.99x) and not on the CPU (host and device share the cores
    there, and synchronous steps measured faster)."""
    chosen = envs.JAXSERVE_SPEC_ASYNC
    return jax.default_backend() == "gpu" if chosen is None else chosen


def device_ngram_enabled(config) -> bool:
    """Whether n-gram drafts are proposed on the device: method ngram under async scheduling (``spec_async``;
    else the speculator proposes on the host, before each schedule)."""
    spec = getattr(config, "speculative_config", None)
    return spec is not None and spec.method == "ngram" and bool(config.async_scheduling) and spec_async()


def lookup(hist: jax.Array, n: jax.Array, min_n: int, max_n: int, k: int) -> tuple[jax.Array, jax.Array]:
    """``propose_ngram`` for each row of ``hist`` [R, L] (its first ``n`` [R] tokens): the up to ``k`` tokens
    after the latest earlier occurrence of the longest suffix of ``min_n`` .. ``max_n`` tokens, as
    ``(drafts [R, k], counts [R])`` (drafts past a row's count are 0)."""
    R, L = hist.shape
    rows = jnp.arange(R)
    i = jnp.arange(L, dtype=jnp.int32)[None, :]
    last = hist[rows, jnp.clip(n - 1, 0, L - 1)]
    cand = (i < (n - 1)[:, None]) & (hist == last[:, None])           # candidate match ends, before the suffix's
    alive, length = cand, cand.astype(jnp.int32)
    for j in range(1, max_n):
        back = jnp.concatenate([jnp.full((R, j), -1, hist.dtype), hist[:, :L - j]], axis=1)   # hist[:, i - j]
        alive = alive & (i >= j) & (back == hist[rows, jnp.clip(n - 1 - j, 0, L - 1)][:, None])
        length = length + alive
    best = length.max(axis=1)
    end = jnp.max(jnp.where(cand & (length == best[:, None]), i, -1), axis=1)     # the latest of the longest
    ok = (best >= min_n) & (n >= min_n + 1) & (end >= 0)
    count = jnp.where(ok, jnp.clip(n - 1 - end, 0, k), 0).astype(jnp.int32)
    at = end[:, None] + 1 + jnp.arange(k)[None, :]
    drafts = jnp.where(jnp.arange(k)[None, :] < count[:, None], hist[rows[:, None], jnp.clip(at, 0, L - 1)], 0)
    return drafts.astype(jnp.int32), count


def append_and_propose(hist, hist_len, rows, emitted, counts, *, min_n, max_n, k, max_rows, force=False):
    """Append each step row's ``counts`` [R] tokens of ``emitted`` [R, W] to its history row ``rows`` [R] (-1:
    a row that sampled nothing), sliding a full row to keep its latest tokens, then propose from it. Returns the
    new ``hist``, ``hist_len`` and, padded to ``max_rows`` step rows, the drafts (flat, row * k + slot) and
    their counts. ``force``: K drafts for every row, its last token repeated (``JAXSERVE_SPEC_FORCE_DRAFTS``)."""
    if emitted.ndim == 1:           # a plain step: one token a row
        emitted = emitted[:, None]
    C, L = hist.shape
    R, W = emitted.shape
    if counts is None:
        counts = jnp.ones(R, jnp.int32)
    valid = rows >= 0
    src = jnp.where(valid, rows, 0)
    counts = jnp.where(valid, counts, 0).astype(jnp.int32)
    n0 = hist_len[src]
    shift = jnp.maximum(n0 + counts - L, 0)
    h = jnp.take_along_axis(hist[src], jnp.minimum(jnp.arange(L)[None, :] + shift[:, None], L - 1), axis=1)
    n0 = n0 - shift
    slot = jnp.arange(W)[None, :]
    at = jnp.where(slot < counts[:, None], n0[:, None] + slot, L)           # L: dropped
    h = h.at[jnp.arange(R)[:, None], at].set(emitted.astype(jnp.int32), mode="drop")
    n = n0 + counts
    dst = jnp.where(valid, rows, C)
    hist = hist.at[dst].set(h, mode="drop")
    hist_len = hist_len.at[dst].set(n, mode="drop")
    if force:
        last = h[jnp.arange(R), jnp.clip(n - 1, 0, L - 1)]
        drafts, count = jnp.broadcast_to(last[:, None], (R, k)), jnp.full(R, k, jnp.int32)
    else:
        drafts, count = lookup(h, n, min_n, max_n, k)
    count = jnp.where(valid, count, 0)
    return (hist, hist_len, jnp.zeros((max_rows, k), jnp.int32).at[:R].set(drafts).reshape(-1),
            jnp.zeros(max_rows, jnp.int32).at[:R].set(count))


def _write(hist, hist_len, rows, tokens, lens):
    """The host's tokens for new rows (``rows`` [W], C: padding)."""
    return hist.at[rows].set(tokens, mode="drop"), hist_len.at[rows].set(lens, mode="drop")


def _move(hist, hist_len, src):
    """Row r takes row ``src[r]``'s history (-1: an empty row)."""
    keep = src >= 0
    s = jnp.maximum(src, 0)
    return jnp.where(keep[:, None], hist[s], 0), jnp.where(keep, hist_len[s], 0)


class DeviceNgram:
    """The runner's device n-gram state: the histories, the latest step's proposals and its rows."""

    def __init__(self, spec, max_model_len: int, max_num_seqs: int, replicated=None):
        self.k, self.max_rows = spec.num_speculative_tokens, max_num_seqs
        self.capacity = 2 * max_num_seqs
        self.window = min(max_model_len, WINDOW)
        put = (lambda x: jax.device_put(x, replicated if replicated is not None else jax.devices()[0]))
        self.hist = put(np.zeros((self.capacity, self.window), np.int32))
        self.hist_len = put(np.zeros(self.capacity, np.int32))
        self.drafts = put(np.zeros(max_num_seqs * self.k, np.int32))     # the latest step's proposals
        self.counts = put(np.zeros(max_num_seqs, np.int32))
        self.last_rows: dict[str, int] = {}     # request id -> its row in the latest step (those that sampled)
        self._row_of: dict[str, tuple[object, int]] = {}    # request id -> (its Request, history row)
        self._next = 0
        out = {"out_shardings": replicated} if replicated is not None else {}
        self._step = jax.jit(partial(append_and_propose, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                                     k=self.k, max_rows=max_num_seqs, force=envs.JAXSERVE_SPEC_FORCE_DRAFTS),
                             donate_argnums=(0, 1), **out)
        self._write = jax.jit(_write, donate_argnums=(0, 1), **out)
        self._move = jax.jit(_move, **out)
        # compiled ahead by shape and called directly (a jitted call would compile again for inputs that
        # differ only in being committed to a device): ("step", R, W), ("write", W), ("move",) -> executable
        self.executables: dict[tuple, object] = {}
        self._sharding = replicated if replicated is not None else \
            jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def _exe(self, key: tuple):
        """The executable of ``key`` (compiled now if it is not yet: ``warmup`` compiles them all)."""
        exe = self.executables.get(key)
        if exe is None:
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._sharding)  # noqa: E731
            C, L = self.capacity, self.window
            if key[0] == "step":
                _, R, W = key
                args = (i32(C, L), i32(C), np.zeros(R, np.int32), i32(R) if W == 1 else i32(R, W),
                        None if W == 1 else i32(R))
                exe = self._step.lower(*args).compile()
            elif key[0] == "move":
                exe = self._move.lower(i32(C, L), i32(C), np.zeros(C, np.int32)).compile()
            else:
                _, W = key
                exe = self._write.lower(i32(C, L), i32(C), np.zeros(W, np.int32), np.zeros((W, L), np.int32),
                                        np.zeros(W, np.int32)).compile()
            self.executables[key] = exe
        return exe

    def warmup(self, request_counts: list[int]) -> None:
        """Compile the per-step call for each step's request count (plain and speculative steps), the row
        writes for each padded count and the compaction, so that no step compiles them."""
        for R in request_counts:
            for W in (1, self.k + 1):
                self._exe(("step", R, W))
        for W in {self._write_width(n) for n in range(1, self.max_rows + 1)}:
            self._exe(("write", W))
        self._exe(("move",))

    def _write_width(self, n: int) -> int:
        """The rows a write of ``n`` new rows pads to (a power of two, at most a step's)."""
        return min(1 << (n - 1).bit_length(), self.max_rows)

    # ------------------------------------------------------------------ before a step
    def hist_rows(self, scheduled, R: int) -> np.ndarray:
        """Each step row's history row ``[R]`` (-1: it samples nothing), giving a request that samples for the
        first time its row and writing its known tokens there."""
        out = np.full(R, -1, np.int32)
        sampling = [(i, s.request, self._owner(s.request)) for i, s in enumerate(scheduled) if s.samples]
        if self._next + sum(row is None for *_, row in sampling) > self.capacity:
            self._compact([r for _, r, _ in sampling])
            sampling = [(i, r, self._owner(r)) for i, r, _ in sampling]
        new = []
        for i, req, row in sampling:
            if row is None:
                row = self._next
                self._next += 1
                self._row_of[req.request_id] = (req, row)
                new.append((row, scheduled[i]))
            out[i] = row
        if new:
            self._write_rows(new)
        return out

    def _owner(self, req) -> int | None:
        hit = self._row_of.get(req.request_id)
        return hit[1] if hit is not None and hit[0] is req else None

    def _compact(self, keep: list) -> None:
        """Out of rows: the step's requests that have rows move to the first ones; the others' rows are freed."""
        src = np.full(self.capacity, -1, np.int32)
        row_of = {}
        for req in keep:
            row = self._owner(req)
            if row is not None:
                src[len(row_of)] = row
                row_of[req.request_id] = (req, len(row_of))
        self.hist, self.hist_len = self._exe(("move",))(self.hist, self.hist_len, src)
        self._row_of, self._next = row_of, len(row_of)

    def _write_rows(self, new: list) -> None:
        """Write the new rows' known tokens (their latest ``window``), padded to a power of two of rows."""
        W = self._write_width(len(new))
        rows = np.full(W, self.capacity, np.int32)
        tokens = np.zeros((W, self.window), np.int32)
        lens = np.zeros(W, np.int32)
        for j, (row, s) in enumerate(new):
            req = s.request
            # the tokens before the one this step samples after, known ones only (a request resumed while
            # its last token is in flight: up to it)
            n = s.start_pos + s.num_new_tokens - len(s.spec_token_ids or ())
            toks = req.all_token_ids[:n]
            if PLACEHOLDER in toks:
                toks = toks[:toks.index(PLACEHOLDER)]
            toks = toks[-self.window:]
            rows[j], lens[j] = row, len(toks)
            tokens[j, :len(toks)] = toks
        self.hist, self.hist_len = self._exe(("write", W))(self.hist, self.hist_len, rows, tokens, lens)

    def draft_sources(self, scheduled, input_ids: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
        """A speculative step's ``draft_index`` [T] (each draft slot's index into the latest step's ``drafts``,
        -1 elsewhere) and ``draft_src`` [R] (each row's row in the latest step, -1: none, so no drafts
        verified). A draft slot without a source reads token 0 (``input_ids`` is set so)."""
        T, k = input_ids.shape[0], self.k
        index, src = np.full(T, -1, np.int32), np.full(R, -1, np.int32)
        end = 0
        for i, s in enumerate(scheduled):
            end += s.num_new_tokens
            d = len(s.spec_token_ids or ())
            if d:
                row = self.last_rows.get(s.request.request_id, -1)
                src[i] = row
                if row >= 0:
                    index[end - d:end] = row * k + np.arange(d, dtype=np.int32)
                else:
                    input_ids[end - d:end] = 0
        return index, src

    # ------------------------------------------------------------------ after a step
    def after_step(self, out, rows: dict[str, int], hist_rows: np.ndarray, spec: bool) -> jax.Array:
        """Append the step's emitted tokens (``out``: its sampler's output, on the device) to the histories and
        propose the next step's drafts; returns their counts (the host reads them with the step's tokens)."""
        emitted, counts = (out.token_ids, out.num_tokens) if spec else (out.token_ids, None)
        exe = self._exe(("step", *emitted.shape[:1], emitted.shape[1] if spec else 1))
        self.hist, self.hist_len, self.drafts, self.counts = exe(self.hist, self.hist_len, hist_rows, emitted, counts)
        self.last_rows = rows
        return self.counts

    @staticmethod
    def read_counts(counts: jax.Array, rows: dict[str, int]) -> dict[str, int]:
        """A read step's proposal counts by request id (``after_step``'s, copied to the host meanwhile)."""
        c = np.asarray(counts).tolist()
        return {rid: c[i] for rid, i in rows.items()}
