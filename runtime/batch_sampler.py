"""The persistent batch sampler: per-row sampling state on the device, one batched pass per step.

NOTE (persistent batch): every running sequence owns a *row* (`Request.batch_row`, 0 ..
max_num_seqs-1) from its first scheduled step until it finishes or is preempted. Its sampling
parameters live in per-row device tensors (temperature, top-k, top-p, min-p, penalties, seed,
min_tokens), its logit bias / allowed ids / min_tokens stop ids in sparse (row, token) device
lists, and for penalties its output token counts and prompt-token mask in [rows, vocab] device
tensors. `add` and `remove` change the host mirrors of one row and count what it contributes to
the step's summary (greedy or not, top-p, the largest top-k, logprobs, ...) and to the sparse
lists; the device copies are refreshed once, before the next step that samples, only if some row
changed, and the sparse lists only if a row that has entries joined or left: a refresh costs the
rows that changed, not the batch (no pass over every active row). A step then samples from the
logits of its rows ([n, vocab]) and a device tensor of their row ids: no per-row Python, no
device->host synchronisation, and the sampled tokens update the counts on the device, so a step
can be sampled before the previous step's tokens reach the host (overlapped scheduling).

Order (vLLM v1's): logits processors -> logit_bias, allowed_token_ids -> min_tokens (stop ids masked)
-> repetition / frequency / presence penalties -> greedy rows: argmax; other rows: temperature ->
min_p -> top_k -> top_p -> softmax -> exponential race (v1 applies min_p, an argmax-invariant
processor, before top-k/top-p; v0 after: with top_p set too the kept tokens differ).

NOTE (no token allowed): constraints can leave a row nothing to sample (a grammar that is complete
while min_tokens still bans its stop tokens, allowed ids the grammar or bad words all refuse). Such
a row reports `NO_TOKEN` to the host, which ends its sequence there (finish_reason "stop", as if
the grammar had reached its end): nothing is appended, and no token the constraints refuse is ever
sampled. On the device the row samples token 0, a valid input for a next step already launched;
that step's token for the row is dropped with the finished sequence.

NOTE (random numbers): a row is sampled as argmax(probs / q), q = -log(u) ~ Exp(1) per vocabulary
entry. u is a counter-based hash, not a generator's stream: a seeded row hashes (seed, number of
tokens it generated so far, token id), so its samples depend on nothing else in the batch and
need no torch.Generator per request; an unseeded row hashes (engine seed, step counter, row).
The hash is murmur3's 32-bit finalizer over int64 tensors (bits masked to 32 after every
multiply), the same on every device.

Sparse entries of rows that are not in a step point at an extra dummy logits row (index n), so
they can be applied without knowing on the host which rows the step holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llmc.kernels import to_device
from llmc.kernels.sampling import argmax_rows
from llmc.runtime.outputs import Logprob
from llmc.runtime.sampler import _apply_min_p, _apply_top_k, _apply_top_k_top_p
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import unpack_bitmask

NO_TOKEN = -1  # the host's token id for a row whose constraints allowed no token (see the NOTE)
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# per-row float parameters, in the order of the rows of `_float_params`
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# per-row integer parameters, in the order of the rows of `_int_params`
_INT_FIELDS = ("top_k", "min_tokens", "seed", "is_seeded", "is_greedy", "has_allowed")


def fmix32(h: Tensor) -> Tensor:
    """murmur3's finalizer on int64 tensors holding 32-bit values; returns 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def fmix32_int(h: int) -> int:
    """fmix32 of one Python int (host side)."""
    return int(fmix32(torch.tensor([h & _M32]))[0])


def row_keys(seed: Tensor, position: Tensor) -> Tensor:
    """A 32-bit key per row from a 64-bit seed and a position (int64 tensors of equal shape)."""
    high = fmix32(((seed >> 32) & _M32) ^ 0x5BD1E995)
    low = fmix32((seed & _M32) ^ high)
    return fmix32(low ^ ((position * _GOLDEN) & _M32))


def int64_seed(seed: int) -> int:
    """A request's seed (in [-2**63, 2**64), as torch.Generator.manual_seed takes them) as the int64
    that `row_keys` hashes: its two's complement, so seeds differ here where they differ mod 2**64."""
    return (seed + 2**63) % 2**64 - 2**63


def exponentials(keys: Tensor, vocab_ids: Tensor) -> Tensor:
    """q ~ Exp(1) for every (row, token): [n, vocab] float32 from keys [n] and vocab_ids [vocab]."""
    h = fmix32(keys.unsqueeze(1) ^ ((vocab_ids * _GOLDEN) & _M32).unsqueeze(0))  # [n, vocab]
    u = (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)  # in (0, 1)
    return (-torch.log(u)).to(torch.float32)


@dataclass
class SampledStep:
    """One step's sampled tokens on the device.

    Fields:
        token_ids: [n] int64, one per sampled row, in the step's row order.
        logprobs: None unless some row asked for logprobs; else [n, 3 + 2 * num_top] float32 per
            row: sampled token id, its raw logprob, its rank, the top token ids, their logprobs
            (token ids are exact in float32 up to 2**24).
        num_top: the number of top logprobs packed per row.
        reported: None, or `token_ids` with NO_TOKEN in the rows that had no token allowed (what
            the host receives; `logprobs` carries it too).
    """

    token_ids: Tensor
    logprobs: Tensor | None
    num_top: int
    reported: Tensor | None = None


@dataclass(frozen=True)
class _RowTraits:
    """One row's part of the step's summary (the flags it sets) and its sparse (row, token, value)
    entries: logit bias and one-token bad words (bias), allowed ids, and while min_tokens holds, its
    stop ids (stop)."""

    flags: tuple[str, ...]
    bias: tuple[tuple[int, int, float], ...]
    allowed: tuple[tuple[int, int, float], ...]
    stop: tuple[tuple[int, int, float], ...]

    @property
    def has_sparse(self) -> bool:
        return bool(self.bias or self.allowed or self.stop)

    @classmethod
    def of(cls, row: int, params: SamplingParams, constrained: bool, banned_token_ids, eos_token_ids: list[int],
           vocab_size: int) -> _RowTraits:
        is_plain_greedy = params.is_greedy and not (params.changes_logits or params.logprobs is not None)
        flags = (("not_greedy", not params.is_greedy), ("top_p", params.top_p < 1.0), ("min_p", params.min_p > 0.0),
                 ("penalties", params.has_penalties), ("processors", bool(params.logits_processors)),
                 ("constrained", constrained), ("not_plain_greedy", not is_plain_greedy))
        stops = sorted(params.all_stop_token_ids(eos_token_ids)) if params.min_tokens > 0 else ()
        return cls(tuple(name for name, is_set in flags if is_set),
                   tuple((row, t, b) for t, b in (params.logit_bias or {}).items())
                   + tuple((row, t, float("-inf")) for t in banned_token_ids),
                   tuple((row, t, 0.0) for t in params.allowed_token_ids or ()),
                   tuple((row, t, 0.0) for t in stops if t < vocab_size))


def _discard(counter: Counter, key) -> None:
    counter[key] -= 1
    if not counter[key]:
        del counter[key]


class BatchSampler:
    """Per-row sampling state of up to `num_rows` running sequences, and the step's sampling."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device, eos_token_ids: list[int],
                 seed: int = 0):
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.eos_token_ids = list(eos_token_ids)
        self.params: list[SamplingParams | None] = [None] * num_rows
        self._floats = np.zeros((len(_FLOAT_FIELDS), num_rows), dtype=np.float32)
        self._ints = np.zeros((len(_INT_FIELDS), num_rows), dtype=np.int64)
        # what each active row contributes to the step's summary and to the sparse lists, counted as
        # rows join and leave: a refresh costs the rows that changed, not the batch
        self._traits: list[_RowTraits | None] = [None] * num_rows
        self._num_set: Counter[str] = Counter()  # summary flag -> active rows that set it
        self._top_ks: Counter[int] = Counter()  # top_k -> active rows
        self._num_logprobs: Counter[int] = Counter()  # logprobs -> active rows that ask for them
        self._sparse_rows: set[int] = set()  # active rows with sparse entries
        self._is_sparse_dirty = True
        self._is_dirty = True
        self._engine_key = int(row_keys(torch.tensor([seed]), torch.tensor([0]))[0])
        self.num_steps = 0
        self.vocab_ids = torch.arange(vocab_size, device=device)
        # [num_rows] tokens each row generated: kept on the device, advanced by every sampled step
        self.num_output = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._new_num_output: dict[int, int] = {}  # rows that joined since the last upload: their counts
        self._sparse_t: dict[str, tuple[Tensor, Tensor, Tensor] | None] = {}
        # [num_rows, vocab]: allocated when the first row with penalties joins
        self.output_counts: Tensor | None = None
        self.prompt_mask: Tensor | None = None
        self._upload()
        if device.type == "cuda":  # the argmax kernels compile now, not in the first request's step
            argmax_rows(torch.zeros(1, vocab_size, device=device))

    # ---- rows join and leave (host mirrors; the device copies follow at the next step) ----------

    def add(self, row: int, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
            banned_token_ids: list[int] = (), constrained: bool = False) -> None:
        """Give `row` to a sequence: its params, and for penalties its token counts so far.
        `banned_token_ids`: never sampled (one-token bad words); `constrained`: the row's steps
        come with a bitmask (a grammar, bad words of several tokens)."""
        if self.params[row] is not None:
            self.remove(row)
        self.params[row] = params
        traits = self._traits[row] = _RowTraits.of(row, params, constrained, banned_token_ids, self.eos_token_ids,
                                                    self.vocab_size)
        self._num_set.update(traits.flags)
        self._top_ks[params.top_k] += 1
        if params.logprobs is not None:
            self._num_logprobs[params.logprobs] += 1
        if traits.has_sparse:
            self._sparse_rows.add(row)
            self._is_sparse_dirty = True
        floats = {"temperature": 1.0 if params.is_greedy else params.temperature, "top_p": params.top_p,
                  "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
                  "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty}
        self._floats[:, row] = [floats[name] for name in _FLOAT_FIELDS]
        ints = {"top_k": min(params.top_k, self.vocab_size), "min_tokens": params.min_tokens,
                "seed": 0 if params.seed is None else int64_seed(params.seed), "is_seeded": params.seed is not None,
                "is_greedy": params.is_greedy, "has_allowed": params.allowed_token_ids is not None}
        self._ints[:, row] = [ints[name] for name in _INT_FIELDS]
        self._is_dirty = True
        self._new_num_output[row] = len(output_token_ids)  # written to the device by the next _upload
        if params.has_penalties:
            self._set_counts(row, prompt_token_ids, output_token_ids)

    def remove(self, row: int) -> None:
        params, traits = self.params[row], self._traits[row]
        if params is None:
            return
        self.params[row] = self._traits[row] = None
        self._num_set.subtract(traits.flags)
        _discard(self._top_ks, params.top_k)
        if params.logprobs is not None:
            _discard(self._num_logprobs, params.logprobs)
        if traits.has_sparse:
            self._sparse_rows.discard(row)
            self._is_sparse_dirty = True
        self._is_dirty = True

    def _set_counts(self, row: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        if self.output_counts is None:
            shape = (self.num_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        ids = to_device(torch.tensor(output_token_ids, dtype=torch.long), self.device)
        self.output_counts[row].zero_().index_add_(0, ids, torch.ones(len(output_token_ids), device=self.device))
        self.prompt_mask[row].zero_()[to_device(torch.tensor(prompt_token_ids, dtype=torch.long), self.device)] = True

    def _upload(self) -> None:
        """Refresh the device copies of the per-row parameters (and the sparse lists, if a row that has
        entries joined or left) and the step's summary."""
        if self._is_sparse_dirty:  # rows in ascending order, each row's entries as it gave them
            for name in ("bias", "allowed", "stop"):
                entries = [entry for row in sorted(self._sparse_rows) for entry in getattr(self._traits[row], name)]
                self._sparse_t[name] = self._sparse_tensors(entries)
            self._is_sparse_dirty = False
        if self._new_num_output:  # one scatter for all the rows that joined (not a fill each)
            rows, counts = zip(*self._new_num_output.items())
            self.num_output[to_device(torch.tensor(rows), self.device)] = to_device(torch.tensor(counts), self.device)
            self._new_num_output.clear()
        # no stream sync: rows join on steps launched while the previous one runs
        self._float_params = to_device(torch.from_numpy(self._floats.copy()), self.device)
        self._int_params = to_device(torch.from_numpy(self._ints.copy()), self.device)
        num_set = self._num_set
        self._summary = {  # what the active rows need at all (host values: they choose the step's code path)
            "all_greedy": num_set["not_greedy"] == 0,
            "top_p": num_set["top_p"] > 0,
            "max_top_k": max(self._top_ks, default=0),
            "min_p": num_set["min_p"] > 0,
            "penalties": num_set["penalties"] > 0,
            "num_logprobs": max(self._num_logprobs, default=None),
            "processors": num_set["processors"] > 0,
            "is_plain_greedy": num_set["not_plain_greedy"] == 0,
            "constrained": num_set["constrained"] > 0,
        }
        self._is_dirty = False

    def _sparse_tensors(self, entries: list[tuple[int, int, float]]) -> tuple[Tensor, Tensor, Tensor] | None:
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        return (to_device(torch.tensor(rows), self.device), to_device(torch.tensor(tokens), self.device),
                to_device(torch.tensor(values, dtype=torch.float32), self.device))

    # ---- one step ---------------------------------------------------------------------------------

    def _column(self, name: str, rows: Tensor) -> Tensor:
        if name in _FLOAT_FIELDS:
            return self._float_params[_FLOAT_FIELDS.index(name)][rows]
        return self._int_params[_INT_FIELDS.index(name)][rows]

    def sample(self, logits: Tensor, rows: Tensor, processors: list[tuple[int, int, list[int], list[int]]] = (),
               bitmask: Tensor | None = None, bad_words: Tensor | None = None) -> SampledStep:
        """Sample one token for each of `logits` [n, vocab] (rows: `rows` [n] int64 on the device).

        `processors`: (index in the step, row, prompt ids, output ids) of each row with logits
        processors (user callables see its tokens; the caller makes sure they are known).
        `bitmask`: [n, ceil(vocab / 32)] int32 on the device, bit t of row i clear: token t is
        banned in row i by its grammar (applied first, as vLLM applies its grammar bitmask before
        the sampler: the reported logprobs see it). `bad_words`: the same for bad words of several
        tokens, applied after the logprobs are taken, as vLLM v1's sampler applies bad words."""
        if self._is_dirty:
            self._upload()
        self.num_steps += 1
        if self.is_plain_greedy() and not processors and bitmask is None and bad_words is None:
            # Nothing to process (no bias or banned token either): the argmax is the token. Nothing
            # to record either: a plain greedy row never reads its output count or its token counts
            # (they are set afresh when the row gets new parameters).
            return SampledStep(argmax_rows(logits), None, 0)
        return self._sample(logits, rows, processors, bitmask, bad_words)

    def is_plain_greedy(self) -> bool:
        """Every active row takes the argmax of its raw logits: greedy, with nothing that changes
        them (penalties, bias, allowed ids, min_tokens) and no logprobs to report."""
        if self._is_dirty:
            self._upload()
        return self._summary["is_plain_greedy"] and self._sparse_t["bias"] is None

    @torch.inference_mode()
    def _sample(self, logits: Tensor, rows: Tensor, processors: list[tuple[int, int, list[int], list[int]]],
                bitmask: Tensor | None, bad_words: Tensor | None) -> SampledStep:
        summary, n = self._summary, logits.shape[0]
        x = torch.empty(n + 1, self.vocab_size, dtype=torch.float32, device=self.device)  # row n: dummy
        x[:n].copy_(logits)
        if bitmask is not None:
            x[:n].masked_fill_(~unpack_bitmask(bitmask, self.vocab_size), float("-inf"))
        raw_logprobs = torch.log_softmax(x[:n], dim=-1) if summary["num_logprobs"] is not None else None
        if bad_words is not None:
            x[:n].masked_fill_(~unpack_bitmask(bad_words, self.vocab_size), float("-inf"))
        self._apply_processors(x, processors)
        row_of = torch.full((self.num_rows,), n, dtype=torch.long, device=self.device)
        row_of[rows] = torch.arange(n, device=self.device)  # sparse entries of absent rows -> dummy row
        self._apply_sparse(x, rows, row_of)
        logits_n = x[:n]
        if summary["penalties"]:
            self._apply_penalties(logits_n, rows)
        blocked = None
        if bitmask is not None or bad_words is not None or processors or any(t is not None for t in self._sparse_t.values()):
            blocked = logits_n.amax(dim=-1) == float("-inf")  # [n]: no token allowed
        token_ids = argmax_rows(logits_n)  # [n]
        if not summary["all_greedy"]:
            token_ids = torch.where(self._column("is_greedy", rows) > 0, token_ids, self._race(logits_n, rows))
        reported = None
        if blocked is not None:
            token_ids = token_ids.masked_fill(blocked, 0)
            reported = token_ids.masked_fill(blocked, NO_TOKEN)
        self._record(rows, token_ids)
        packed = None
        if raw_logprobs is not None:
            packed = _pack_logprobs(raw_logprobs, token_ids, summary["num_logprobs"])
            if reported is not None:
                packed[:, 0] = reported
        return SampledStep(token_ids, packed, summary["num_logprobs"] or 0, reported)

    def _apply_processors(self, x: Tensor, processors: list[tuple[int, int, list[int], list[int]]]) -> None:
        # User callables take one row each: the one per-row loop, over the rows that have them.
        for i, row, prompt, outputs in processors:
            params = self.params[row]
            for processor, arity in zip(params.logits_processors, params.logits_processor_arities):
                x[i] = processor(prompt, outputs, x[i]) if arity == 3 else processor(outputs, x[i])

    def _apply_sparse(self, x: Tensor, rows: Tensor, row_of: Tensor) -> None:
        bias, allowed, stop = (self._sparse_t[name] for name in ("bias", "allowed", "stop"))
        if bias is not None:
            x.index_put_((row_of[bias[0]], bias[1]), bias[2], accumulate=True)
        if allowed is not None:
            is_allowed = torch.zeros_like(x, dtype=torch.bool)  # [n + 1, vocab]
            is_allowed[row_of[allowed[0]], allowed[1]] = True
            has_list = self._column("has_allowed", rows) > 0  # [n]
            x[:-1].masked_fill_(~is_allowed[:-1] & has_list.unsqueeze(1), float("-inf"))
        if stop is not None:  # min_tokens: stop ids masked while the row has fewer outputs
            is_early = self.num_output[stop[0]] < self._int_params[_INT_FIELDS.index("min_tokens")][stop[0]]
            target = (row_of[stop[0]], stop[1])
            x.index_put_(target, torch.where(is_early, float("-inf"), x[target]))

    def _apply_penalties(self, logits: Tensor, rows: Tensor) -> None:
        counts = self.output_counts[rows]  # [n, vocab]
        is_seen = self.prompt_mask[rows] | (counts > 0)
        repetition = self._column("repetition_penalty", rows).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(is_seen, penalized, logits))
        logits -= self._column("frequency_penalty", rows).unsqueeze(1) * counts
        logits -= self._column("presence_penalty", rows).unsqueeze(1) * (counts > 0).float()

    def _race(self, logits: Tensor, rows: Tensor) -> Tensor:
        """Temperature, min-p, top-k/top-p, softmax, then the exponential race. [n] token ids."""
        summary = self._summary
        logits.div_(self._column("temperature", rows).unsqueeze(1))
        if summary["min_p"]:
            _apply_min_p(logits, self._column("min_p", rows))
        top_k = self._column("top_k", rows)
        if summary["top_p"]:
            _apply_top_k_top_p(logits, top_k, self._column("top_p", rows))
        elif summary["max_top_k"] > 0:
            _apply_top_k(logits, top_k, summary["max_top_k"])
        probs = torch.softmax(logits, dim=-1)  # [n, vocab]
        seeded = row_keys(self._column("seed", rows), self.num_output[rows])
        unseeded = fmix32(rows ^ fmix32_int(self._engine_key ^ self.num_steps))
        keys = torch.where(self._column("is_seeded", rows) > 0, seeded, unseeded)
        q = exponentials(keys, self.vocab_ids)
        return argmax_rows(probs.div_(q))

    def _record(self, rows: Tensor, token_ids: Tensor) -> None:
        """The sampled tokens, on the device: one more output per row, and its count."""
        self.num_output.index_add_(0, rows, torch.ones_like(rows))
        if self.output_counts is not None:
            self.output_counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.float32),
                                          accumulate=True)

    @property
    def has_processors(self) -> bool:
        """Some active row has logits processors: its step needs the host's token histories."""
        if self._is_dirty:
            self._upload()
        return self._summary["processors"]

    @property
    def has_constraints(self) -> bool:
        """Some active row takes a bitmask computed from its tokens on the host (grammars, bad words)."""
        if self._is_dirty:
            self._upload()
        return self._summary["constrained"]


def _pack_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: int) -> Tensor:
    """[n, 3 + 2 * num_top] float32: token id, its logprob, its rank, top ids, top logprobs."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [n, 1]
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [n, num_top]
    return torch.cat([token_ids.unsqueeze(1).float(), chosen, ranks.float(), top_ids.float(), top_values], dim=1)


def unpack_logprobs(row: list[float], num_top: int) -> dict[int, Logprob]:
    """One packed row (host floats) -> {token id: Logprob with its rank}: the sampled token first, then
    the top `num_top` most likely, as `Sampler` returns them. The row holds the step's largest count of top
    entries (`_pack_logprobs`: a row of another request may have asked for more), read off its length."""
    packed = (len(row) - 3) // 2
    token_id = int(row[0])
    result = {token_id: Logprob(row[1], int(row[2]))}
    for rank, (top_id, top_value) in enumerate(zip(row[3 : 3 + min(num_top, packed)], row[3 + packed : 3 + 2 * packed])):
        result.setdefault(int(top_id), Logprob(top_value, rank + 1))
    return result


class HostTokens:
    """A step's sampled tokens (and packed logprobs) on their way to the host: one non-blocking
    copy into pinned memory on a GPU, followed by an event; `wait()` blocks on that event only."""

    def __init__(self, sampled: SampledStep, device: torch.device):
        self.num_top = sampled.num_top
        source = sampled.logprobs  # logprobs carry the ids
        if source is None:
            source = sampled.token_ids if sampled.reported is None else sampled.reported
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            self.host.copy_(source, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = source

    def wait(self) -> tuple[list[int], list[list[float]] | None]:
        """(token ids, packed logprob rows or None), as Python lists."""
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        if self.host.dim() == 1:
            return values, None
        return [int(row[0]) for row in values], values
