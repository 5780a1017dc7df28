"""Speculative decoding: draft proposers and each row's draft length.

A proposer guesses the tokens that follow a sequence; the engine computes
them in the same step as the row's next token and keeps the longest prefix
that the target's own sampling reproduces (see ``Engine._verify``): output is
what decoding without speculation gives, greedy or seeded-sampled.

``NgramProposer`` is prompt lookup: the longest trailing n-gram of the
sequence (prompt and output) that occurred before, and what followed it
there. Its index of n-grams grows with the sequence, so a proposal costs a
dictionary lookup per n, whatever the context length.

``DraftLength`` adapts each row's draft length to its recent acceptance: it
doubles while every draft is accepted, falls to one past what was accepted
otherwise, and after drafts that are wholly rejected it stops drafting for a
while (1, 2, 4 ... 16 steps): a row that copies nothing costs nothing.
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


class DraftLength:
    """One row's draft length, from its recent acceptance."""

    MAX_COOLDOWN = 16

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.k = k_max
        self._misses = 0  # consecutive wholly rejected drafts
        self._cooldown = 0  # steps left without drafting

    def next(self) -> int:
        """How many tokens to draft this step (0: decode plainly)."""
        if self._cooldown > 0:
            self._cooldown -= 1
            return 0
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        if accepted == drafted:
            self.k = min(self.k_max, 2 * self.k)
            self._misses = 0
        elif accepted == 0:
            self.k = 1
            self._misses += 1
            self._cooldown = min(self.MAX_COOLDOWN, 1 << (self._misses - 1))
        else:
            self.k = max(1, accepted + 1)
            self._misses = 0


def speculation_allowed(params) -> bool:
    """Whether a request's sampling can verify drafts position by position
    with one batched sampler call: every processing step must depend on the
    position alone. Penalties read the tokens before each position and a
    grammar advances with each token, so those requests decode plainly."""
    return (params.repetition_penalty == 1 and not params.presence_penalty
            and not params.frequency_penalty and params.grammar is None)
