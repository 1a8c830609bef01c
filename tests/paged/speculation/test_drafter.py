"""`paged.speculation.drafter`: the `Drafter` protocol, prompt lookup behind it (`NgramDrafter`), and a drafter of
one's own handed to the `Speculator`. Over the fake engine (its next token is the last one + 1): no model, no
compilation."""

from __future__ import annotations

import pytest

from paged import DynamicGenerator, Job
from paged.errors import InvalidConfigError
from paged.speculation.config import SpeculationConfig
from paged.speculation.draft import DraftModel
from paged.speculation.drafter import Drafter, NgramDrafter, make_drafter
from paged.speculation.rows import Proposal, SpecRow
from paged.speculation.speculator import Speculator
from paged.testing import ByteTokenizer, FakeEngine, drain, verification_for

TOK = ByteTokenizer()
KW = dict(num_pages=64, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96)


def test_prompt_lookup_proposes_the_continuation_of_the_longest_earlier_match():
    d = NgramDrafter(max_ngram=3)
    assert isinstance(d, Drafter) and not d.gate_first and d.step_cost(None) == 0.0
    seq = [1, 2, 3, 4, 5, 9, 9, 2, 3]  # the suffix [2, 3] occurred before, followed by 4, 5, 9
    spec = SpecRow(key="a", row=None, sequence=seq)
    p = d.propose(None, [spec, SpecRow(key="b", row=None, sequence=[7, 8])], [3, 2], host=True)
    assert p.drafts == [[4, 5, 9], []] and p.want == [3, 0] and p.classes[0] == 2 and p.draft_logprobs is None
    assert d.propose(None, [spec], [0], host=True).want == [0]  # nothing asked: nothing looked up
    assert set(d._index) == {"a", "b"}
    d.release("a")
    assert set(d._index) == {"b"}


def test_make_drafter_builds_what_the_config_names():
    engine = FakeEngine(**KW, verification=verification_for(use_ngram_draft=True, max_ngram=2))
    d = make_drafter(SpeculationConfig("ngram", max_ngram=2), engine)
    assert isinstance(d, NgramDrafter) and d.max_ngram == 2 and d.corpus is None
    with pytest.raises(InvalidConfigError, match="built with verification=.*fed_drafts=False.*needs one built"):
        make_drafter(SpeculationConfig("model"), engine)  # the target is checked first: built for prompt lookup
    assert DraftModel.gate_first  # a draft step costs a forward: the gate decides before it


class NextTokens:
    """A drafter of one's own: proposes what the fake engine will emit (each token the last + 1), so every draft is
    accepted."""

    gate_first = False

    def __init__(self):
        self.seen = []

    def propose(self, target, specs, want, host):
        drafts = [[(s.sequence[-1] + 1 + j) % target.vocab_size for j in range(n)] for s, n in zip(specs, want)]
        self.seen.append(sum(want))
        return Proposal(want=list(want), drafts=drafts, classes=[0] * len(specs))

    def accepted(self, spec, item, num_drafted):
        pass

    def release(self, key):
        pass

    def warmup(self, progress=False):
        return 0

    def stats(self):
        return {}

    def step_cost(self, target):
        return 0.0


def test_a_drafter_of_ones_own_is_handed_to_the_speculator():
    spec = dict(use_ngram_draft=True, num_draft_tokens=3)
    plain = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW))
    plain.enqueue([Job([5, 6, 7], 12, identifier=0), Job([40, 41], 9, identifier=1)])
    want = {i: r["full_completion"] for i, r in drain(plain).finals.items()}
    g = DynamicGenerator(tokenizer=TOK, engine=FakeEngine(**KW, verification=verification_for(**spec)), **spec)
    mine = NextTokens()
    g.speculation.speculator = Speculator(g.engine, g.speculation_config, mine)
    g.enqueue([Job([5, 6, 7], 12, identifier=0), Job([40, 41], 9, identifier=1)])
    got = drain(g)
    assert {i: r["full_completion"] for i, r in got.finals.items()} == want
    stats = g.speculation.speculator.stats()
    assert sum(mine.seen) == stats["drafted_tokens"] == stats["accepted_draft_tokens"] > 0
    with pytest.raises(InvalidConfigError, match="must implement paged.speculation.drafter.Drafter"):
        Speculator(g.engine, g.speculation_config, object())
