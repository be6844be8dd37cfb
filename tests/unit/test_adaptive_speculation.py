"""The adaptive speculation policy on its own: when a request stops drafting, for how long,
when it drafts again, and when a batch is too large to draft."""

from __future__ import annotations

from types import SimpleNamespace

from kdaserve.speculative.adaptive import FIRST_BACKOFF, MIN_VERIFIES, AdaptiveSpeculation


def _req(n: int = 0) -> SimpleNamespace:
    return SimpleNamespace(output_ids=[0] * n)


def test_low_acceptance_switches_a_request_off_then_backs_off_longer() -> None:
    policy = AdaptiveSpeculation(min_acceptance_rate=0.2)
    req, good = _req(10), _req(10)
    for _ in range(MIN_VERIFIES):
        assert policy.allows(req)
        req.output_ids.append(0)  # each verify's token
        policy.record(req, 4, 0)
        policy.record(good, 4, 3)
    assert not policy.allows(req) and policy.allows(good)
    assert policy.num_switched_off == 1
    off_for = FIRST_BACKOFF
    req.output_ids += [0] * (off_for - 1)
    assert not policy.allows(req)
    req.output_ids.append(0)
    assert policy.allows(req)  # tries again
    for _ in range(MIN_VERIFIES):
        policy.record(req, 4, 0)
    req.output_ids += [0] * (2 * FIRST_BACKOFF - 1)
    assert not policy.allows(req)  # the second failure waits twice as long
    req.output_ids.append(0)
    assert policy.allows(req) and policy.num_switched_off == 2
    policy.forget(req)
    assert id(req) not in policy.tracks


def test_recovery_resets_the_backoff_and_a_rate_of_zero_never_switches_off() -> None:
    policy = AdaptiveSpeculation(min_acceptance_rate=0.2)
    req = _req()
    for _ in range(MIN_VERIFIES):
        policy.record(req, 4, 0)
    req.output_ids += [0] * FIRST_BACKOFF
    for _ in range(MIN_VERIFIES):
        policy.record(req, 4, 4)
    assert policy.allows(req) and policy.tracks[id(req)].backoff == FIRST_BACKOFF
    never = AdaptiveSpeculation(min_acceptance_rate=0.0)
    for _ in range(10):
        never.record(req, 4, 0)
    assert never.allows(req) and never.num_switched_off == 0


def test_batch_size_limit() -> None:
    policy = AdaptiveSpeculation(disable_by_batch_size=4)
    decoding = [SimpleNamespace(is_prefilling=False) for _ in range(5)]
    prefilling = SimpleNamespace(is_prefilling=True)
    assert policy.batch_allows(decoding[:4] + [prefilling])  # a prefill does not count
    assert not policy.batch_allows(decoding)
    assert policy.num_batch_skips == 1
    assert AdaptiveSpeculation().batch_allows(decoding * 2000)


def test_offline_ngram_replay_counts_verifies_like_the_engine() -> None:
    from kdaserve.bench.spec import ngram_acceptance

    prompt, out = [1, 2, 3, 4, 5, 9], [2, 3, 4, 5, 7, 8]
    # min_n 1: at "... 9 2" the unigram "2" recurs: drafts 3 4, both kept (+ bonus 5); at
    # "... 4 5" the bigram recurs: draft 9, wrong (+ bonus 7); the last token is not drafted
    # 5 tokens after the first in 3 forwards (two verifies, one plain decode)
    assert ngram_acceptance([prompt], [out], k=2, max_n=2, min_n=1) == ((3 + 1) / 2, 5 / 3)
    # min_n 2: "9 2" never recurs, the next step's "2 3" does: one verify keeping 2 drafts
    assert ngram_acceptance([prompt], [out], k=2, max_n=2, min_n=2) == (3.0, 5 / 3)
