"""`best_of`: a request's candidates ranked by their mean log probability per generated token
(OpenAI's "highest log probability per token"), of which the `n` best are returned. The figures
are the model's raw ones (engine/logprobs.py), whatever the sampler did."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from strata.server.schema import GenerationOptions


def candidate_options(options: GenerationOptions, is_ranked: bool) -> GenerationOptions:
    """What candidates are generated with: ranking needs each token's log probability, so a
    request that asked for none has the chosen token's alone (logprobs 0, no alternatives)
    computed; its reply still carries none, as AnswerLogprobs follows the request's own."""
    if not is_ranked or options.logprobs is not None:
        return options
    return replace(options, logprobs=0)


@dataclass
class CandidateScore:
    """The log probabilities of one candidate's generated tokens, summed as they arrive (the
    stop token has none: it is not output)."""
    total_logprob: float = 0.0
    num_tokens: int = 0

    def add(self, event) -> None:
        if event.logprob is not None:
            self.total_logprob += event.logprob.logprob
            self.num_tokens += 1

    @property
    def mean_logprob(self) -> float:
        # A candidate with no token (the stop token came first) has no mean. 0.0 would rank it
        # above every answer (a mean is never above 0), as if an empty answer were the most
        # likely one: -inf ranks it below every candidate with a finite mean instead. When all
        # are empty they tie, and the tie rule (lower index first) keeps candidate order.
        if not self.num_tokens:
            return -math.inf
        return self.total_logprob / self.num_tokens


def best_candidates(scores: list[CandidateScore], n: int) -> list[int]:
    """The indexes of the `n` best candidates, best first: highest mean log probability per
    token; ties go to the lower index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i].mean_logprob, i))[:n]
