"""Speculative decoding: draft proposers, and which drafts a step verifies.

A proposer guesses the tokens that follow a sequence; the engine computes
them in the same step as the row's next token and keeps the longest prefix
that the target's own sampling reproduces (see ``Engine._verify``): output is
what decoding without speculation gives, greedy or seeded-sampled.

``NgramProposer`` is prompt lookup (``engine/draft.py`` drafts from a
second model instead): the longest trailing n-gram of the
sequence (prompt and output) that occurred before, and what followed it
there. Its index of n-grams grows with the sequence, so a proposal costs a
dictionary lookup per n, whatever the context length.

Verifying is not free: each draft token is one more token through the model
and one more row of the output head and the sampler (on the default model,
on 2 cores: about 0.5 ms at one stream, where a step takes 6 ms; more per
token at eight streams). So a step takes a draft token only where it pays:
``Acceptance`` estimates each row's chance that its next draft token is
accepted (a draft's j-th token then comes with probability alpha^j),
``StepCost`` fits the step time to the step's tokens and output rows as they
are measured, and ``select`` adds draft tokens, best first, while each raises
the step's expected tokens per second. A row that copies nothing, or a batch
where verification costs more than it brings, decodes plainly.
"""

from __future__ import annotations


class NgramProposer:
    """Prompt-lookup drafts for one sequence."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram min ({n_min}) <= ngram max ({n_max})")
        self.n_min, self.n_max = n_min, n_max
        # n -> {n-gram: the index just past its latest occurrence that is not the sequence's end}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # n-grams ending before this index are in the index

    def _grow(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (the suffix itself is
        looked up, so it must not find its own occurrence)."""
        end = len(tokens) - 1
        for i in range(max(self._indexed, self.n_min), end + 1):
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self._index[n][tuple(tokens[i - n:i])] = i
        self._indexed = max(self._indexed, end + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.n_min + 1:
            return []
        self._grow(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            at = self._index[n].get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + k]
        return []


class Acceptance:
    """A row's chance that a draft token is accepted, given the ones before
    it were: accepted and rejected draft tokens counted with decay (recent
    drafts weigh most) over a uniform prior. The counts also decay on steps
    without drafts, so a row that stopped drafting tries again later."""

    DECAY = 0.7  # per verified draft
    IDLE_DECAY = 0.95  # per step without one

    def __init__(self):
        self.accepted = 0.0
        self.rejected = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (1 if accepted < drafted else 0)

    def idle(self) -> None:
        self.accepted *= self.IDLE_DECAY
        self.rejected *= self.IDLE_DECAY


class StepCost:
    """Step time ~ base + per_token * tokens + per_row * output rows, fitted
    by recursive least squares with forgetting over the steps measured (a
    prior keeps it sane before there are any). Kept in milliseconds, where
    the measurement noise is of order one."""

    FORGET = 0.995

    def __init__(self, base: float = 5e-3, per_token: float = 2e-4, per_row: float = 3e-4):
        import numpy as np

        self._np = np
        self.prior = np.array([base, per_token, per_row]) * 1e3
        self.P0 = np.diag([25.0, 0.25, 0.25])  # prior variance (ms^2)
        self.theta, self.P = self.prior.copy(), self.P0.copy()

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        np = self._np
        x = np.array([1.0, tokens, rows])
        Px = self.P @ x
        gain = Px / (self.FORGET + x @ Px)
        self.theta = self.theta + gain * (seconds * 1e3 - x @ self.theta)
        self.P = (self.P - np.outer(gain, Px)) / self.FORGET
        # Decode steps have as many tokens as output rows, so one direction is
        # never observed and forgetting would grow its variance without bound:
        # keep the covariance within the prior's (and start over on a blow-up).
        trace = np.trace(self.P)
        if not (np.isfinite(trace) and np.isfinite(self.theta).all()):
            self.theta, self.P = self.prior.copy(), self.P0.copy()
        elif trace > np.trace(self.P0):
            self.P *= np.trace(self.P0) / trace

    def seconds(self, tokens: int, rows: int) -> float:
        return max(1e-6, float(self.theta @ (1.0, tokens, rows)) * 1e-3)

    @property
    def per_draft_token(self) -> float:
        """What one more draft token costs: a token and an output row."""
        return max(1e-6, float(self.theta[1] + self.theta[2]) * 1e-3)


def select(candidates: list[tuple[float, int]], tokens: int, rows: int, sampled: int,
           cost: StepCost) -> list[int]:
    """How many draft tokens each candidate row verifies. ``candidates`` are
    (alpha, tokens proposed) per row; the step already computes ``tokens``
    tokens and ``rows`` output rows and yields ``sampled`` tokens. Draft
    tokens go in by their chance of being accepted (alpha^j for a row's j-th),
    each while it raises expected tokens per second."""
    order = sorted(((alpha ** j, i) for i, (alpha, n) in enumerate(candidates) for j in range(1, n + 1)),
                   reverse=True)
    take = [0] * len(candidates)
    expected = float(sampled)
    seconds = max(cost.seconds(tokens, rows), 1e-6)
    extra = cost.per_draft_token
    for value, i in order:
        if (expected + value) * seconds <= expected * (seconds + extra):
            break  # this one and every later one (worth less) would lower the rate
        take[i] += 1
        expected += value
        seconds += extra
    return take


def speculation_allowed(params) -> bool:
    """Whether a request can verify drafts position by position with one
    batched sampler call: every processing step must depend on the position
    alone. Penalties read the tokens before each position, so those requests
    decode plainly. A grammar advances with each token: its requests draft
    only the tokens the grammar forces (``RowSpec.forced``), which need no
    sampling, and sample the position after them from the advanced grammar."""
    return (params.repetition_penalty == 1 and not params.presence_penalty
            and not params.frequency_penalty)


class RowSpec:
    """One request's speculative decoding state."""

    def __init__(self, n_min: int, n_max: int, forced: bool = False):
        self.forced = forced  # a grammar row: its drafts are the tokens the grammar forces next
        self.proposer = NgramProposer(n_min, n_max)
        self.acceptance = Acceptance()
        self.draft = None  # its state in a draft model's pool (engine/draft.py)
        self.drafted = 0
        self.accepted = 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted


class Drafter:
    """What the scheduler asks of speculative decoding: the drafts a step
    verifies. ``seq.data.spec`` is a row's RowSpec (None where the request's
    sampling does not allow speculation). With ``draft_model``
    (engine/draft.py) drafts come from it, else from prompt lookup."""

    def __init__(self, k_max: int, draft_model=None):
        self.k_max = k_max
        self.draft_model = draft_model
        self.cost = StepCost()

    def draft(self, rows: list[tuple[object, int]], tokens: int, out_rows: int, sampled: int) -> list[list[int]]:
        """Drafts for ``(seq, at most k)`` rows of a step that computes
        ``tokens`` tokens and ``out_rows`` output rows and yields ``sampled``
        tokens: proposals cut to what ``select`` finds worth verifying."""
        out: list[list[int]] = [[] for _ in rows]
        live = [(i, seq, min(k, self.k_max)) for i, (seq, k) in enumerate(rows)
                if getattr(seq.data, "spec", None) is not None and k > 0]
        if not live:
            return out
        specs = [seq.data.spec for _, seq, _ in live]
        forced = [sp.forced for sp in specs]
        proposals: list[list[int]] = [[] for _ in live]
        for j, (sp, (_, seq, k)) in enumerate(zip(specs, live)):
            if sp.forced:  # free, and certain: the grammar allows nothing else
                proposals[j] = list(seq.data.sampling.matcher.compute_ff_tokens())[:k]
            elif self.draft_model is None:  # prompt lookup proposes for free
                proposals[j] = sp.proposer.propose(seq.tokens, k)
        if self.draft_model is None:  # choose among the proposals
            take = select([(1.0 if f else sp.acceptance.alpha, len(p))
                           for sp, f, p in zip(specs, forced, proposals)], tokens, out_rows, sampled, self.cost)
        else:  # a draft model's tokens cost a forward each: choose lengths first
            take = select([(1.0, len(p)) if f else (sp.acceptance.alpha, k)
                           for sp, f, p, (_, _, k) in zip(specs, forced, proposals, live)],
                          tokens, out_rows, sampled, self.cost)
            drafted = self.draft_model.propose([(seq, 0 if f else n)
                                                for (_, seq, _), f, n in zip(live, forced, take)])
            proposals = [p if f else d for p, f, d in zip(proposals, forced, drafted)]
        for sp, (i, _, _), p, n in zip(specs, live, proposals, take):
            out[i] = list(p[:n])
            if not out[i]:
                sp.acceptance.idle()
        return out

    def verified(self, seq, old_len: int, drafted: int, accepted: int) -> None:
        seq.data.spec.observe(drafted, accepted)
        if self.draft_model is not None:
            self.draft_model.accepted(seq, old_len, drafted, accepted)

    def release(self, seq) -> None:
        if self.draft_model is not None:
            self.draft_model.release(seq)


def check_draft_model(draft, target) -> None:
    """A ValueError naming the problem unless ``draft`` can draft for
    ``target``: the same vocabulary size, and smaller."""
    from mlx.utils import tree_flatten

    dv, tv = draft.args.vocab_size, target.args.vocab_size
    if dv != tv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}): "
                         "a draft model must share the target's tokenizer")
    ds, ts = (sum(v.nbytes for _, v in tree_flatten(m.parameters())) for m in (draft, target))
    tp = getattr(target, "tp", None)  # a tensor-parallel shard (models/shard.py): the whole model's size
    if tp is not None:
        ts = tp.full_param_bytes
    if ds >= ts:
        raise ValueError(f"the draft model ({ds / 1e6:.0f} MB) is not smaller than the target "
                         f"({ts / 1e6:.0f} MB): drafting with it cannot pay")
