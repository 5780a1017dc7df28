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
on 2 cores, a draft token costs about what a seventh of a one-row step
does, and it is compute, where one row is streaming weights). So a step takes
a draft token only where it pays: ``MatchAcceptance`` estimates a prompt-lookup
token's chance of acceptance from the length of the context match behind it
(scoring every proposal against what its step produced, drafted or not),
``Acceptance`` a draft-model row's from its recent drafts, ``StepCost``
learns the target's step time by the number of tokens the step computes
(and a draft model's forward time by the tokens it feeds: keyed by the
step's tokens alone, one row's eight forwards and eight rows' one were the
same count), and ``select`` takes the most likely draft tokens, as many as
give the most expected tokens per second. A row that copies nothing, or a batch where
verification costs more than it brings, decodes plainly.
"""

from __future__ import annotations

MATCH_CAP = 32  # context matches are measured up to this length


class NgramProposer:
    """Prompt-lookup drafts for one sequence. After ``propose``, ``match``
    is how many trailing tokens of the sequence agree with the context of
    the occurrence it drafted from (at least the n-gram's length; 0 when it
    proposed nothing): the best predictor of a draft's acceptance."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram min ({n_min}) <= ngram max ({n_max})")
        self.n_min, self.n_max = n_min, n_max
        # n -> {n-gram: the index just past its latest occurrence that is not the sequence's end}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # n-grams ending before this index are in the index
        self.match = 0

    def _grow(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (the suffix itself is
        looked up, so it must not find its own occurrence)."""
        end = len(tokens) - 1
        for i in range(max(self._indexed, self.n_min), end + 1):
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self._index[n][tuple(tokens[i - n:i])] = i
        self._indexed = max(self._indexed, end + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.match = 0
        if k <= 0 or len(tokens) < self.n_min + 1:
            return []
        self._grow(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            at = self._index[n].get(tuple(tokens[-n:]))
            if at is not None:
                match, end = n, len(tokens)
                while match < MATCH_CAP and at - match > 0 and tokens[at - match - 1] == tokens[end - match - 1]:
                    match += 1
                self.match = match
                return tokens[at:at + k]
        return []


class MatchAcceptance:
    """The chance that a prompt-lookup draft token is accepted, given the
    length of the context match behind it (``NgramProposer.match``; a
    token's own match is the proposal's plus the draft tokens before it):
    decayed counts per band of match lengths over a uniform prior, shared
    by every row, and read as never lower for a longer match than for a
    shorter one already seen. Measured on the default model (greedy, code
    and prose): a 1-token match is right 12-24% of the time, a 4-token one
    70-87%, one of 17 or more 88-99%, so the length says far more than a
    row's history does."""

    DECAY = 0.99  # per observation in a band
    BANDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # a band's longest match

    def __init__(self):
        import bisect

        cap = MATCH_CAP
        self._band = [min(bisect.bisect_left(self.BANDS, m), len(self.BANDS) - 1) for m in range(cap + 1)]
        self.cap = cap
        self.hits = [0.0] * len(self.BANDS)
        self.trials = [0.0] * len(self.BANDS)
        self._rates = [0.5] * len(self.BANDS)

    def band(self, match: int) -> int:
        return self._band[min(max(match, 1), self.cap)]

    def rate(self, match: int) -> float:
        return self._rates[self.band(match)]

    def chances(self, match: int, n: int) -> list[float]:
        """The chance that each of a proposal's first n tokens is accepted
        with every token before it."""
        out, p = [], 1.0
        for j in range(n):
            p *= self.rate(match + j)
            out.append(p)
        return out

    def observe(self, match: int, proposal: list[int], produced: list[int]) -> None:
        """Score a proposal against the tokens its step produced: its j-th
        token is a trial at match + j while the ones before it agreed."""
        for j in range(min(len(proposal), len(produced))):
            b = self.band(match + j)
            hit = proposal[j] == produced[j]
            self.hits[b] = self.hits[b] * self.DECAY + hit
            self.trials[b] = self.trials[b] * self.DECAY + 1.0
            if not hit:
                break
        top = 0.0  # the best of the shorter bands seen
        for b, (h, t) in enumerate(zip(self.hits, self.trials)):
            r = (h + 1.0) / (t + 2.0)
            self._rates[b] = max(top, r)
            if t >= 1.0:
                top = max(top, r)


class Acceptance:
    """A draft model row's chance that a draft token is accepted, given the
    ones before it were: accepted and rejected draft tokens counted with
    decay (recent drafts weigh most) over a prior worth two drafts whose
    mean is ``prior``'s chance (the drafter's pool of every row's drafts:
    how well this draft model predicts this target lately), or 1/2. The
    counts also decay on steps without drafts, so a row that stopped
    drafting tries again later. With a uniform prior every request began
    at 1/2, where a draft model's dear forwards barely paid at one stream:
    ~13 of a 160-token answer's steps went undrafted before its own drafts
    raised it (bench_spec.py --draft)."""

    DECAY = 0.7  # per verified draft
    IDLE_DECAY = 0.95  # per step without one

    def __init__(self, prior: "Acceptance | None" = None):
        self.prior = prior
        self.accepted = 0.0
        self.rejected = 0.0

    @property
    def alpha(self) -> float:
        mean = 0.5 if self.prior is None else self.prior.alpha
        return (self.accepted + 2.0 * mean) / (self.accepted + self.rejected + 2.0)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.rejected = self.rejected * self.DECAY + (1 if accepted < drafted else 0)

    def idle(self) -> None:
        self.accepted *= self.IDLE_DECAY
        self.rejected *= self.IDLE_DECAY


class StepCost:
    """Step time by the number of tokens the step computes: a running
    average per count (counts past 256 in buckets of 64), read as the
    non-decreasing curve nearest to them (isotonic regression, each count
    weighted by its readings, up to WEIGHT_CAP), between counts by linear
    interpolation; past the counts seen, along the slope of the last two,
    at least FIRST_SLOPE of the last count's time per token (with one seen,
    that: optimistic, so that a longer step gets tried and measured). A
    running maximum read one stalled count as the floor of every longer
    one: at eight streams on prose (the default model, 2 cores) one 6-token
    reading of 48.5 ms made 8, 9 and 10 tokens cost the same, so 17% drafts
    looked free and 362 of them were verified in 160 steps (0.87-0.92x of
    speculation off). Not a line: one row streams the weights, each
    further token adds compute, and kernels change paths with the number of
    rows (measured on the default model, 2 cores: 1 row and 1, 2, 4, 8
    draft tokens 13.8, 15.0, 16.4, 19.5, 32 ms; 8 rows and as many drafts
    each 29.5, 34.3, 42.4, 59.1, 77.6 ms; a loaded machine).

    A count not read again within EXPIRE readings is forgotten: a count is
    read only when a step takes it, so one priced too high (a stall during
    its only readings) would never be drafted, and so never re-read; and,
    as the floor of every longer count, it would price those out too.
    Forgotten, it is read between its neighbours again, and a step that
    takes it measures it anew (one step in EXPIRE at most)."""

    SMOOTH = 0.2
    FIRST_SLOPE = 0.1  # per token, as a share of the last count's time
    WEIGHT_CAP = 32  # readings
    EXPIRE = 1000  # readings

    def __init__(self, base: float = 5e-3, per_token: float = 5e-4):
        self.base, self.per_token = base, per_token  # before any step is measured
        self._counts: list[int] = []  # sorted
        self._seconds: list[float] = []  # running average at each count
        self._weight: list[int] = []  # readings of each count, up to WEIGHT_CAP
        self._floor: list[float] = []  # the non-decreasing fit to them, by count
        self._read: list[int] = []  # the reading that last updated each count
        self._readings = 0

    @staticmethod
    def _bucket(tokens: int) -> int:
        return tokens if tokens <= 256 else tokens // 64 * 64

    def observe(self, tokens: int, seconds: float) -> None:
        import bisect

        self._readings += 1
        k = self._bucket(tokens)
        i = bisect.bisect_left(self._counts, k)
        if i < len(self._counts) and self._counts[i] == k:
            v = self._seconds[i]  # a stall (a collection, another process) moves it by at most 2x's share
            self._seconds[i] += self.SMOOTH * (min(seconds, 2 * v) - v)
            self._read[i] = self._readings
            self._weight[i] = min(self._weight[i] + 1, self.WEIGHT_CAP)
        else:
            self._counts.insert(i, k)
            self._seconds.insert(i, seconds)
            self._read.insert(i, self._readings)
            self._weight.insert(i, 1)
        stale = [j for j, r in enumerate(self._read) if self._readings - r >= self.EXPIRE]
        for j in reversed(stale):
            for lst in (self._counts, self._seconds, self._read, self._weight):
                del lst[j]
        self._floor = _isotonic(self._seconds, self._weight)

    def _slope(self, lo: int) -> float:
        counts, vals = self._counts, self._floor
        least = self.FIRST_SLOPE * vals[-1] / counts[-1]
        if len(counts) == 1:
            return least
        return max(least, (vals[lo + 1] - vals[lo]) / (counts[lo + 1] - counts[lo]))

    def seconds(self, tokens: int) -> float:
        import bisect

        counts, vals = self._counts, self._floor
        if not counts:
            return self.base + self.per_token * tokens
        i = bisect.bisect_left(counts, tokens)
        if i < len(counts) and counts[i] == tokens:
            return vals[i]
        if i == 0:
            return max(1e-6, vals[0] - self._slope(0) * (counts[0] - tokens))
        if i == len(counts):
            return vals[-1] + self._slope(max(len(counts) - 2, 0)) * (tokens - counts[-1])
        lo, hi = counts[i - 1], counts[i]
        return vals[i - 1] + (vals[i] - vals[i - 1]) * (tokens - lo) / (hi - lo)


def _isotonic(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest to ``values`` in weighted least
    squares (pool-adjacent-violators): a run that falls is replaced by its
    weighted mean."""
    pools: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        pools.append([v, float(w), 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            v2, w2, n2 = pools.pop()
            p = pools[-1]
            p[0] = (p[0] * p[1] + v2 * w2) / (p[1] + w2)
            p[1] += w2
            p[2] += n2
    return [v for v, _, n in pools for _ in range(int(n))]


def select(candidates: list[list[float]], tokens: int, sampled: int, cost: StepCost,
           draft_cost: StepCost | None = None, feeds: list[int] | None = None,
           surcharge: float = 0.0) -> list[int]:
    """How many draft tokens each candidate row verifies. ``candidates``
    are, per row, the chance that each of its proposed tokens is accepted
    with those before it (non-increasing); the step already computes
    ``tokens`` tokens and yields ``sampled``. Draft tokens go in by their
    chance, and the step takes the first so many of them that give the
    most expected tokens per second (the cost is not linear, so not only
    while each one pays).

    With ``draft_cost`` (a draft model's forward time by the tokens it
    feeds) drafting costs time too: a row's j-th draft token needs the
    draft model's j-th forward, which is batched over the rows drafting that
    far; ``feeds[i]`` is what row i adds to the first one (0: its drafts
    are free, a grammar's forced tokens), every later one takes a token a
    row. ``surcharge`` is added to any step that drafts at all."""
    order = sorted(((p, i) for i, ps in enumerate(candidates) for p in ps), reverse=True)
    take = [0] * len(candidates)
    counted = [0] * len(candidates)
    fed = [0]  # tokens each draft forward feeds, the first one's included
    drafting = 0.0  # those forwards' seconds
    expected, best_rate, best = float(sampled), sampled / cost.seconds(tokens), 0
    for n, (p, i) in enumerate(order, 1):
        if p <= 0:
            break
        expected += p
        if draft_cost is not None and feeds[i]:
            f = counted[i]
            if f == len(fed):
                fed.append(0)
            before = draft_cost.seconds(fed[f]) if fed[f] else 0.0
            fed[f] += feeds[i] if f == 0 else 1
            drafting += draft_cost.seconds(fed[f]) - before
        counted[i] += 1
        rate = expected / (cost.seconds(tokens + n) + drafting + surcharge)
        if rate > best_rate:
            best_rate, best = rate, n
    for _, i in order[:best]:
        take[i] += 1
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

    def __init__(self, n_min: int, n_max: int, forced: bool = False, pooled: Acceptance | None = None):
        self.forced = forced  # a grammar row: its drafts are the tokens the grammar forces next
        self.proposer = NgramProposer(n_min, n_max)
        self.acceptance = Acceptance(pooled)  # a draft model's rows
        self.draft = None  # its state in a draft model's pool (engine/draft.py)
        self.proposal = None  # this step's prompt-lookup proposal, scored by Drafter.verified
        self.proposed_at = -1  # the sequence's length when it was made
        self.match = 0  # its context match (NgramProposer.match)
        self.drafted = 0
        self.accepted = 0



class Drafter:
    """What the scheduler asks of speculative decoding: the drafts a step
    verifies. ``seq.data.spec`` is a row's RowSpec (None where the request's
    sampling does not allow speculation). With ``draft_model``
    (engine/draft.py) drafts come from it, else from prompt lookup."""

    def __init__(self, k_max: int, draft_model=None, select_all: bool = False, ahead: bool = True):
        self.k_max = k_max
        self.draft_model = draft_model
        self.ahead = ahead  # whether the engine builds undrafted steps ahead (async scheduling)
        self.select_all = select_all  # verify every proposed token (--draft-select all)
        self.cost = StepCost()  # the target's step, without a draft model's forwards
        # A draft model's forward by the tokens it feeds (steady state only)
        self.draft_cost = StepCost() if draft_model is not None else None
        self.lookup = MatchAcceptance()  # prompt lookup's acceptance, by match length
        self.pooled = Acceptance()  # a draft model's drafts, every row's: new rows' prior
        self.host = 0.0  # a step's host work when nothing overlaps it (seconds, running average)

    def step_done(self, tokens: int, seconds: float) -> None:
        """A step's time: the target's share for ``cost``; a draft model's
        forwards, timed apart, for ``draft_cost``, but not one that caught a
        row up on its prompt (tens of tokens, once per request: read as a
        price, one such forward priced every draft out for good)."""
        dm = self.draft_model
        if dm is not None:
            for fed, took, steady in dm.forwards:
                seconds -= took
                if steady:
                    self.draft_cost.observe(fed, took)
            dm.forwards = []
        self.cost.observe(tokens, max(seconds, 1e-6))

    def _propose(self, sp: RowSpec, seq, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """A free proposal for a row whose tokens are ``tokens`` (a grammar's
        forced tokens, or prompt lookup's) and each token's chance, kept to
        be scored against what the row's next step produces."""
        if sp.forced:  # free, and certain: the grammar allows nothing else
            p = list(seq.data.sampling.matcher.compute_ff_tokens())[:k]
            sp.proposal = None
            return p, [1.0] * len(p)
        p = sp.proposer.propose(tokens, k)
        sp.match = sp.proposer.match
        sp.proposal = p or None  # scored against what the step produces, taken or not
        sp.proposed_at = len(tokens)
        return p, self.lookup.chances(sp.match, len(p))

    HOST_SMOOTH = 0.1

    def host_done(self, seconds: float) -> None:
        """The host work (planning, the graph build, output) of a step that
        was not built ahead and did not build the next one: what breaking
        the engine's async scheduling costs a step."""
        self.host += self.HOST_SMOOTH * (seconds - self.host) if self.host else seconds

    def _surcharge(self) -> float:
        """What drafting costs beyond its step's own time: with prompt lookup
        the steps are built ahead while none drafts, and a drafting step's
        successor cannot be (its inputs depend on the drafts accepted), so
        drafting costs one more step's host work that nothing overlaps (at
        eight streams on prose ~2.2 ms of a 25-28 ms step: unpriced, drafts
        that paid by the step's own time lost 6-12% there). A draft model's
        steps are never built ahead, nor any without async scheduling:
        nothing to add."""
        return self.host if self.ahead and self.draft_model is None else 0.0

    def _take(self, chances: list[list[float]], tokens: int, sampled: int) -> list[int]:
        """How many of each row's free proposals (chances) a step verifies."""
        if self.select_all:
            return [len(c) for c in chances]
        return select(chances, tokens, sampled, self.cost, surcharge=self._surcharge())

    def draft(self, rows: list[tuple[object, int]], tokens: int, sampled: int) -> list[list[int]]:
        """Drafts for ``(seq, at most k)`` rows of a step that computes
        ``tokens`` tokens and yields ``sampled`` tokens: proposals cut to
        what ``select`` finds worth verifying."""
        out: list[list[int]] = [[] for _ in rows]
        live = [(i, seq, min(k, self.k_max)) for i, (seq, k) in enumerate(rows)
                if getattr(seq.data, "spec", None) is not None and k > 0]
        if not live:
            return out
        specs = [seq.data.spec for _, seq, _ in live]
        proposals: list[list[int]] = [[] for _ in live]
        chances: list[list[float]] = []
        for j, (sp, (_, seq, k)) in enumerate(zip(specs, live)):
            if sp.forced or self.draft_model is None:
                proposals[j], c = self._propose(sp, seq, seq.tokens, k)
                chances.append(c)
            else:  # a draft model's tokens cost a forward each: choose lengths first
                a = sp.acceptance.alpha
                chances.append([a ** n for n in range(1, k + 1)])
        if self.select_all or self.draft_model is None:
            take = self._take(chances, tokens, sampled)
        else:
            feeds = [0 if sp.forced else self.draft_model.first_feed(seq) for sp, (_, seq, _) in zip(specs, live)]
            take = select(chances, tokens, sampled, self.cost, self.draft_cost, feeds)
        if self.draft_model is not None:
            drafted = self.draft_model.propose([(seq, 0 if sp.forced else n)
                                                for (_, seq, _), sp, n in zip(live, specs, take)])
            proposals = [p if sp.forced else d for p, sp, d in zip(proposals, specs, drafted)]
        for sp, (i, seq, _), p, n in zip(specs, live, proposals, take):
            out[i] = list(p[:n])
            if not out[i] and self.draft_model is not None:
                sp.acceptance.idle()
        if self.draft_model is not None and not any(out):
            self.pooled.idle()
        return out

    def may_build_ahead(self) -> bool:
        """Whether an undrafted step may be built ahead (the engine's async
        scheduling) and kept unless ``peek`` finds drafts worth verifying
        once the tokens it takes are known: prompt lookup (its proposals are
        free). A draft model's steps are never built ahead."""
        return self.ahead and self.draft_model is None

    def peek(self, rows: list[tuple[object, list[int], int]], tokens: int, sampled: int) -> bool:
        """Whether the step after a plain one should draft: ``rows`` are its
        decoding rows as (sequence, its tokens with the one just sampled, at
        most k drafts), and the step computes ``tokens`` and yields
        ``sampled``. The choice ``draft`` would make, on the same proposals;
        the engine built that step ahead, undrafted, and drops it
        (unevaluated) for a drafting one when this says so. Deciding on the
        known tokens, every step, is what lets a row that starts copying
        draft from its next step while prose pays for no unoverlapped steps
        (before, every fourth to eighth step was scheduled without being
        built ahead, only to ask for drafts)."""
        chances = []
        for seq, toks, k in rows:
            sp = getattr(seq.data, "spec", None)
            if sp is None or min(k, self.k_max) <= 0:
                continue
            chances.append(self._propose(sp, seq, toks, min(k, self.k_max))[1])
        if not any(chances):
            return False
        return any(self._take(chances, tokens, sampled))

    def verified(self, seq, old_len: int, produced: list[int], drafted: int, accepted: int) -> None:
        """A step's outcome for a row it drafted for, or proposed to: the
        tokens it produced (``accepted`` drafts, then, unless its grammar
        ended there, the token after them)."""
        sp = seq.data.spec
        proposal, sp.proposal = sp.proposal, None
        if sp.proposed_at != len(seq.tokens):  # proposed for a step that did not run (preempted)
            proposal = None
        if drafted:
            sp.drafted += drafted
            sp.accepted += accepted
        if proposal is not None:
            # Prompt lookup: score the proposal as far as the produced tokens
            # reach, drafted or not. Scoring only what was verified would
            # leave a length whose prior is below a step's threshold (as at
            # eight streams) never drafted, and so never learnt.
            self.lookup.observe(sp.match, proposal, produced)
        elif drafted and self.draft_model is not None:
            sp.acceptance.observe(drafted, accepted)
            self.pooled.observe(drafted, accepted)
        if self.draft_model is not None and drafted:
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
